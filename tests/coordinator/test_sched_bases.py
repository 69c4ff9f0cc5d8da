"""Several LoRA jobs on one base model (issue 28): the coordinator learns each job's base from its
signed version 0, and the scheduler counts starting a node on a job whose base it holds as an
adapter switch (a tenth of a model load), not a model load."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo.coordinator.scheduling.assign import JobDemand, NodeSupply, SchedulerParams, schedule
from echo.coordinator.scheduling.bases import ADAPTER_SWITCH_SHARE, BaseBook, switch_share
from echo.coordinator.store import Store
from echo.protocol import messages as m
from echo.protocol import signing

P = SchedulerParams(min_stay_s=60.0, min_gain=0.15, headroom=1.1)
KEY = Ed25519PrivateKey.generate()


def publish_v0(store: Store, job_id: str, base: str | None) -> None:
    """Record job ``job_id`` with a learner-signed version 0: an adapter of ``base`` (None: a
    full-weight job)."""
    store.create_job(job_id, job_id, {})
    adapter = (
        m.AdapterRef(base_digest=base, rank=4, alpha=8.0, target_modules=["q_proj"],
                     carries_base=True)
        if base is not None else None
    )  # fmt: skip
    man = m.Manifest(
        job_id=job_id, version=0, base_version=-1, kind="anchor", total_size=0, chunks=[],
        tensor_digests={}, state_digest="d" * 64, anchor_version=0, created_at=time.time(),
        adapter=adapter,
    )  # fmt: skip
    store.publish_version(
        job_id, 0, kind="anchor", manifest=signing.seal_record(KEY, man), state_digest="d" * 64,
        total_size=0, trained=[], rejected=[], metrics={},
    )  # fmt: skip


def test_the_base_book_reads_each_jobs_base_from_its_signed_version_0(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    try:
        publish_v0(store, "a", "base-x")
        publish_v0(store, "b", "base-x")
        publish_v0(store, "c", "base-y")
        publish_v0(store, "full", None)
        store.create_job("new", "new", {})  # no version 0 yet
        book = BaseBook(store)
        assert [book.base_of(j) for j in ("a", "b", "c", "full", "new", "gone")] == [
            "base-x", "base-x", "base-y", "", "", ""
        ]
        assert book.same_base("a", "b") and not book.same_base("a", "c")
        assert not book.same_base("full", "full") and not book.same_base("a", None)
        live = ["a", "b", "c", "full", "new"]
        assert book.siblings("a", live) == ["b"] and book.siblings("c", live) == []
        assert book.siblings("full", live) == []
        # A node that holds a version of "a" starts on "b" with an adapter switch; "c" and a
        # full-weight job are model loads; a node holding nothing loads a model for any job.
        assert book.shares({"a": 3}, live) == {"a": ADAPTER_SWITCH_SHARE, "b": ADAPTER_SWITCH_SHARE}
        assert book.shares({"a": -1}, live) == {} and book.shares({}, live) == {}
        assert switch_share({"base-x"}, "base-x") == 0.1 and switch_share({"base-x"}, "") == 1.0
        book.forget(["a"])
        assert set(book._bases) == {"a"}
    finally:
        store.close()


def test_a_new_lora_job_takes_the_node_that_holds_its_base() -> None:
    # Two idle nodes, equal in rate and cost; one holds base x (it served job "a" before).
    nodes = [
        NodeSupply("n0", {"b": 1.0}),
        NodeSupply("n1", {"b": 1.0}, switch={"b": ADAPTER_SWITCH_SHARE}),
    ]
    d = schedule([JobDemand("b", 0.5)], nodes, now=0.0, params=P)
    assert d.assignment == {"n0": None, "n1": "b"}  # one node meets the need: the base's holder
    # Without the base, the tie breaks by id: it was the base that chose n1.
    plain = [NodeSupply("n0", {"b": 1.0}), NodeSupply("n1", {"b": 1.0})]
    assert schedule([JobDemand("b", 0.5)], plain, now=0.0, params=P).assignment["n0"] == "b"


def test_an_adapter_switch_waits_a_tenth_of_the_minimum_stay_a_model_load_all_of_it() -> None:
    # Two nodes on "a" (need met by one); "b" arrives needing one. n0 holds b's base, n1 not.
    jobs = [JobDemand("a", 5.0, created_at=1.0), JobDemand("b", 5.0, created_at=2.0)]

    def nodes(share: float) -> list[NodeSupply]:
        switch = {"b": share} if share < 1.0 else {}
        return [
            NodeSupply("n0", {"a": 6.0, "b": 6.0}, job="a", since=100.0, switch=switch),
            NodeSupply("n1", {"a": 6.0, "b": 6.0}, job="a", since=100.0, switch=switch),
        ]

    # 10 s after starting on "a": 1/6 of min_stay_s, past a tenth of it.
    switched = schedule(jobs, nodes(ADAPTER_SWITCH_SHARE), now=110.0, params=P)
    assert len(switched.moves) == 1 and switched.moves[0].dst == "b"
    assert "adapter switch" in switched.moves[0].why
    # The same move as a model load waits the whole minimum stay.
    assert schedule(jobs, nodes(1.0), now=110.0, params=P).moves == []
    assert len(schedule(jobs, nodes(1.0), now=161.0, params=P).moves) == 1
    # Too early even for an adapter switch: nothing moves.
    assert schedule(jobs, nodes(ADAPTER_SWITCH_SHARE), now=105.0, params=P).moves == []


def test_what_nodes_of_a_sibling_job_deliver_counts_towards_a_jobs_need(tmp_path: Path) -> None:
    from echo.coordinator.scheduling.bases import net_need
    from echo.coordinator.scheduling.inputs import NodeRecord

    store = Store.open(tmp_path / "db.sqlite")
    try:
        for job, base in (("a", "base-x"), ("b", "base-x"), ("c", "base-y")):
            publish_v0(store, job, base)
        book = BaseBook(store)
        now = 1000.0
        on_a, on_c = NodeRecord(job="a", since=900.0), NodeRecord(job="c", since=900.0)
        for node in (on_a, on_c):
            # Six groups of 4 completions over the last 50 s on every job: b's among them.
            for job in ("a", "b", "c"):
                node.accepted[job] = deque(
                    (now - 50 + 10 * i, 4) for i in range(6)
                )
        rates = book.shared_rates({"n0": on_a, "n1": on_c}, ["a", "b", "c"], now)
        # The node on "a" serves "b" too (same base): its 5 later groups over 50 s count for b.
        # Nothing counts for "a" (no node of b) or from the node on "c" (another base).
        assert rates == {"b": 20 / 50}
        assert net_need(1.0, rates["b"]) == 0.6 and net_need(0.3, rates["b"]) == 0.0
        assert net_need(None, 0.4) is None and net_need(float("inf"), 0.4) == float("inf")
        assert net_need(1.0, 0.0) == 1.0
    finally:
        store.close()
