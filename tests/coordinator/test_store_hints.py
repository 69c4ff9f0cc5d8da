"""Hint writes (a node's last-seen and reported version, prompt-id reservations) skip their own
fsync; nothing else may.

``Database._hint_tx`` lowers ``synchronous`` for one commit. If it ever failed to restore FULL,
every accepted rollout after it would be acknowledged before it was on disk, so these tests
check the setting after hints that commit and after one that fails.
"""

from __future__ import annotations

import pytest

from echo.coordinator.store import Store

FULL = 2  # PRAGMA synchronous's value for FULL


def _sync(store: Store) -> int:
    return store._db.execute("PRAGMA synchronous").fetchone()[0]


def test_hints_commit_and_leave_every_other_write_durable(tmp_path) -> None:
    path = tmp_path / "db.sqlite"
    store = Store.open(path)
    assert _sync(store) == FULL
    store.upsert_node("n1", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    before = store.node("n1").last_seen
    store.touch_node("n1", version=3, digest="d3", tokens_per_s=12.5)
    assert _sync(store) == FULL
    store.record_node_version("job", "n1", 3)
    assert _sync(store) == FULL
    store._db.execute(
        "INSERT INTO jobs (job_id, name, spec_json, status, created_at, updated_at)"
        " VALUES ('job', 'job', '{}', 'running', 0, 0)"
    )
    assert store.next_prompt_ids("job", 3) == [0, 1, 2]
    assert _sync(store) == FULL
    assert not store._db.in_transaction
    store.close()
    # The process ending (not a power cut) keeps every hint.
    store = Store.open(path)
    row = store.node("n1")
    assert (row.version, row.state_digest, row.tokens_per_s) == (3, "d3", 12.5)
    assert row.last_seen >= before
    seen = store._db.execute("SELECT version FROM node_versions WHERE node_id='n1'").fetchall()
    assert [r[0] for r in seen] == [3]
    assert store.next_prompt_ids("job", 1) == [3]
    store.close()


def test_a_failed_hint_rolls_back_and_restores_full(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    store.upsert_node("n1", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    with pytest.raises(RuntimeError), store._hint_tx() as db:
        db.execute("UPDATE nodes SET tokens_per_s=99 WHERE node_id='n1'")
        raise RuntimeError("boom")
    assert _sync(store) == FULL
    assert not store._db.in_transaction
    assert store.node("n1").tokens_per_s == 0.0
    store.close()
