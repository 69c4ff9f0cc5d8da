"""Exclusion needs failures that are a real share of a node's results, not just a count.

A long benchmarks/attack.py run excluded all three honest nodes, each after ~1,100 accepted
groups and 5 false rejections (a checker's tail, since fixed): with a bare count, any nonzero
false-rejection rate excludes every honest node in time and stalls the job.
"""

from __future__ import annotations

from echo.coordinator.config import VerificationSection
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import Store
from echo.coordinator.submissions.penalties import Penalties
from echo.protocol import reasons as R


def _node(store: Store, node_id: str, accepted: int, failures: int) -> None:
    store.upsert_node(node_id, b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    store._db.execute("UPDATE nodes SET accepted=? WHERE node_id=?", (accepted, node_id))
    for _ in range(failures):
        store.record_rejection("j", node_id, "", R.SAMPLING_SHAPE, "{}", counts_against=True)


def test_failures_must_be_a_share_of_the_results(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    penalties = Penalties(store, Metrics(), VerificationSection())  # 5 failures, 5% share
    _node(store, "honest", accepted=1100, failures=5)  # 0.45%: a checker's tail
    _node(store, "liar", accepted=60, failures=5)  # 7.7%
    _node(store, "junk", accepted=0, failures=5)
    _node(store, "new", accepted=0, failures=4)  # under the count
    for n in ("honest", "liar", "junk", "new"):
        penalties.maybe_exclude(n)
    assert {n: bool(store.node(n).excluded) for n in ("honest", "liar", "junk", "new")} == {
        "honest": False,
        "liar": True,
        "junk": True,
        "new": False,
    }
    # The honest node is excluded once its failures do become a share of its work.
    for _ in range(55):
        store.record_rejection("j", "honest", "", R.SAMPLING_SHAPE, "{}", counts_against=True)
    penalties.maybe_exclude("honest")
    assert store.node("honest").excluded
    store.close()
