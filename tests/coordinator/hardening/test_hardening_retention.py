"""Unbounded growth (issue 13, item 6): churning identities, leases, rejections and trained
envelopes level off under the retention rules of ``[retention]``.

Each round is an hour of churn compressed: 100 fresh identities that register, let a lease
expire and get rejected once; 10 groups accepted, batched and trained by an honest node. Time
is the store's (``now``), advanced by two hours a round; the coordinator prunes once a round.
"""

from __future__ import annotations

import hashlib
import time

from echo.coordinator.config import RetentionSection, VerificationSection
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import Store
from echo.coordinator.store.rows import LeaseRow
from echo.coordinator.submissions.penalties import MAX_TRACKED_NODES, Penalties
from tests.conftest import STORED_GROUP, store_with_anchor

ROUNDS = 8
CHURN = 100


def counts(store: Store) -> dict[str, int]:
    db = store._db
    out = {
        t: int(db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])
        for t in ("nodes", "leases", "rejections", "node_versions")
    }
    out["envelope_bytes"] = int(
        db.execute("SELECT COALESCE(SUM(LENGTH(envelope)), 0) FROM rollouts").fetchone()[0]
    )
    out["pages"] = int(db.execute("PRAGMA page_count").fetchone()[0])
    return out


def lease(lease_id: str, job_id: str, node_id: str, prompt_id: int, at: float) -> LeaseRow:
    return LeaseRow(lease_id, job_id, node_id, prompt_id, 4, 8, 1, 0, at, at + 30, "open")


def churn_round(store: Store, job_id: str, r: int, now: float, churn: int = CHURN) -> None:
    for i in range(churn):
        node_id = f"sybil-{r}-{i}"
        store.upsert_node(node_id, b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
        store._db.execute(
            "UPDATE nodes SET last_seen=?, first_seen=? WHERE node_id=?", (now, now, node_id)
        )
        store.add_leases([lease(f"l-{r}-{i}", job_id, node_id, r * 1000 + i, now)])
        store.record_rejection(job_id, node_id, "", "malformed", "junk", counts_against=True)
        store._db.execute("UPDATE rejections SET at=? WHERE node_id=?", (now, node_id))
    store.expire_leases(now + 31)
    ids = []
    for i in range(10):
        lid = f"h-{r}-{i}"
        store.add_leases([lease(lid, job_id, "honest", 10**6 + r * 100 + i, now)])
        store.accept_rollout(
            lease_id=lid,
            job_id=job_id,
            node_id="honest",
            version=r,
            prompt_id=i,
            engine="torch",
            group=STORED_GROUP,
            rewards=[1.0] * 4,
            tokens=12,
            content_hash=hashlib.sha256(lid.encode()).digest(),
            envelope=b"E" * 4096,
        )
        ids.append(lid)
    store._db.execute("UPDATE rollouts SET created_at=? WHERE rollout_id LIKE ?", (now, f"h-{r}-%"))
    store.take_batch(job_id, 10, 0)
    store.publish_version(
        job_id,
        r + 1,
        kind="patch",
        manifest=b"m",
        state_digest=f"d{r + 1}",
        total_size=1,
        trained=ids,
        rejected=[],
        metrics={},
    )


def run_rounds(path, churn: int) -> list[dict[str, int]]:
    store = store_with_anchor(path)
    store.upsert_node("honest", b"h" * 32, "torch", {}, 0.0, 0.0, 0.0)
    retention = RetentionSection(
        closed_leases_s=3600, trained_envelopes_s=3600, rejections_s=3600, idle_nodes_s=3600
    )
    t0 = time.time() - ROUNDS * 7200 - 7200
    seen = []
    for r in range(ROUNDS):
        now = t0 + r * 7200
        churn_round(store, "j", r, now, churn)
        store.prune(now + 3600 + 60, retention, lease_window_s=600)
        seen.append(counts(store))
    store.close()
    return seen


def test_rows_and_envelopes_level_off_under_churn(tmp_path) -> None:
    seen = run_rounds(tmp_path / "churn.sqlite", CHURN)
    first, last = seen[2], seen[-1]
    for key in ("nodes", "leases", "rejections", "node_versions", "envelope_bytes"):
        assert last[key] <= first[key], (key, [s[key] for s in seen])
    assert last["nodes"] <= CHURN + 1  # the honest node and at most one round of churn
    # Freed pages are reused: the file grows only by the training record kept (the trained
    # groups' completions and the versions), exactly as fast as with no churn at all.
    quiet = run_rounds(tmp_path / "quiet.sqlite", 0)
    extra = [c["pages"] - q["pages"] for c, q in zip(seen, quiet, strict=True)]
    assert extra[-1] <= extra[2] + 2, extra


def test_excluded_nodes_and_nodes_with_work_are_kept(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    for n in ("excluded", "worker", "idle"):
        store.upsert_node(n, b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    store.set_excluded("excluded", True)
    store._db.execute("UPDATE nodes SET accepted=1 WHERE node_id='worker'")
    store._db.execute("UPDATE nodes SET last_seen=0")
    store.prune(time.time(), RetentionSection(), lease_window_s=600)
    assert [n.node_id for n in store.nodes()] == ["excluded", "worker"]
    store.close()


def test_per_node_rate_windows_are_bounded(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    penalties = Penalties(store, Metrics(), VerificationSection())
    for i in range(MAX_TRACKED_NODES + 5000):
        assert penalties.rate_ok(f"node-{i}")
    assert len(penalties._submit_times) == MAX_TRACKED_NODES
    store.close()
