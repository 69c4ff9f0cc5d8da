"""The learner against the ledger (issue 13, item 5): what used to crash-loop a job.

- A learner that crashed after checkpointing a version but before its report re-attaches (its
  batch goes back to the buffer), and the buffer may drop some of those groups as stale before
  the re-sent report arrives: the report must still be booked, or the job is wedged.
- Checkpoints are made durable (fsync) before the report that names their version is sent, so
  the ledger can never be ahead of the newest checkpoint; a learner that finds it so anyway
  (checkpoints lost) stops with a clear reason instead of training a version the ledger refuses.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from echo.coordinator.store import Store
from echo.coordinator.store.rows import LeaseRow
from echo.learner.checkpoints import checkpoint
from echo.learner.service import LedgerAhead, resume_action
from tests.conftest import STORED_GROUP, store_with_anchor


def _store_with_groups(path, n: int) -> tuple[Store, list[str]]:
    store = store_with_anchor(path)
    store.upsert_node("node", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    ids = []
    for i in range(n):
        lid = f"g{i}"
        store.add_leases([LeaseRow(lid, "j", "node", i, 4, 8, 0, 0, 0.0, 1e12, "open")])
        store.accept_rollout(
            lease_id=lid,
            job_id="j",
            node_id="node",
            version=0,
            prompt_id=i,
            engine="torch",
            group=STORED_GROUP,
            rewards=[1.0, 0, 0, 0],
            tokens=12,
            content_hash=hashlib.sha256(lid.encode()).digest(),
            envelope=b"E",
        )
        ids.append(lid)
    return store, ids


def test_a_resent_report_naming_groups_dropped_meanwhile_is_booked(tmp_path) -> None:
    store, ids = _store_with_groups(tmp_path / "c.db", 3)
    assert len(store.take_batch("j", 3, 0)) == 3  # the learner trains on them, checkpoints v1...
    store.attach_learner("j", b"k" * 32, "learner", [])  # ...crashes, re-attaches: back to buffer
    assert store.take_batch("j", 3, 5) == []  # meanwhile the buffer drops them as stale
    store.publish_version(
        "j",
        1,
        kind="patch",
        manifest=b"m",
        state_digest="d1",
        total_size=1,
        trained=ids,
        rejected=[],
        metrics={},
    )  # the re-sent report of v1
    assert store.job("j").current_version == 1
    assert {r.rollout_id for r in store.trained_rollouts("j")} == set(ids)
    # Sent once more (the ack was lost): a no-op, still booked once.
    store.publish_version(
        "j",
        1,
        kind="patch",
        manifest=b"m",
        state_digest="d1",
        total_size=1,
        trained=ids,
        rejected=[],
        metrics={},
    )
    assert len(store.trained_rollouts("j")) == 3


def test_a_report_naming_unknown_or_trained_groups_is_booked_without_them(tmp_path) -> None:
    store, ids = _store_with_groups(tmp_path / "c.db", 2)
    store.take_batch("j", 2, 0)
    store.publish_version(
        "j",
        1,
        kind="patch",
        manifest=b"m",
        state_digest="d1",
        total_size=1,
        trained=ids[:1],
        rejected=[],
        metrics={},
    )
    store.take_batch("j", 2, 0)
    # ids[0] was trained in v1 and "ghost" never existed: the weights hold what they hold, so
    # the version is booked (refusing it would wedge the job) and only ids[1] is credited.
    store.publish_version(
        "j",
        2,
        kind="patch",
        manifest=b"m",
        state_digest="d2",
        total_size=1,
        trained=[ids[0], ids[1], "ghost"],
        rejected=[],
        metrics={},
    )
    rows = {r.rollout_id: r.trained_version for r in store.trained_rollouts("j")}
    assert rows == {ids[0]: 1, ids[1]: 2}
    assert store.job("j").current_version == 2


def test_a_checkpoint_is_durable_before_it_is_visible(tmp_path, monkeypatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "checkpoints"
    checkpoint.save(
        root,
        checkpoint.Checkpoint(
            version=7,
            anchor_version=0,
            model_state={"w": torch.ones(3)},
            optim_state={},
            report=b"signed",
        ),
    )
    names = {os.path.basename(p) for p in synced}
    assert {"model.safetensors", "optim.pt", "report.bin", "meta.json"} <= names
    assert str(root) in synced  # the rename itself is made durable too
    assert checkpoint.versions(root) == [7]


@pytest.mark.parametrize(
    ("ledger", "own", "pending", "want"),
    [
        (-1, 0, None, "publish_base"),  # a new job: publish v0
        (-1, 0, b"r", "resend"),  # crashed between the checkpoint of v0 and its report
        (4, 5, b"r", "resend"),  # crashed between checkpoint and report
        (5, 5, b"r", "train"),  # in step
        (0, 0, b"r", "train"),
    ],
)
def test_resume_action(ledger, own, pending, want) -> None:
    assert resume_action(ledger, own, pending) == want


def test_a_learner_behind_the_ledger_stops_with_the_reason() -> None:
    with pytest.raises(LedgerAhead, match="v6 .* v5"):
        resume_action(6, 5, b"r")
