"""Lease terms by record (issue 26, "Done means"): stale-version hoarders with a thin record.

Three identities that bought a lease quota of 2 each with a few honest groups held 6 of a quick
job's window of 8 until just before each 30 s deadline, then sent one stale-version group; the
honest nodes doing the work were answered "buffer full" (benchmarks/attack.py, ``--attackers
stale``: honest ratio 0.18). Now a node's lease term is sized to its own measured delivery time,
and nodes short of ``proven_groups`` share a small part of the window while a proven node is
active. Against the real coordinator service, over real libp2p streams.
"""

from __future__ import annotations

import time

import pytest

from echo.coordinator.scheduling.lease_terms import LeaseTerms
from echo.coordinator.store import Store
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job


async def _deliver(coord, node, job_id: str, groups: int) -> None:
    for _ in range(groups):  # one lease at a time: each group is a delivery of its own
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        assert (await node.submit(node.seal(group_for(lease)))).accepted


def test_a_node_that_delivers_fast_gets_a_short_term_a_stranger_the_full_one(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client, batch_groups=4)
        fast, stranger = await client(), await client()
        await fast.register()
        await stranger.register()
        await _deliver(coord, fast, job_id, 3)
        [lease] = [open_lease(coord, x) for x in (await stranger.leases(job_id, 0, 8)).leases]
        assert lease.deadline - lease.issued_at == pytest.approx(30.0)  # no record: full term
        took = coord.store.delivery_times(str(fast.host.peer_id), 8)
        assert len(took) == 3 and max(took) < 2.0
        held = [open_lease(coord, x) for x in (await fast.leases(job_id, 0, 8)).leases]
        assert held
        for lease in held:  # 4 x its slowest delivery, at least min_lease_s
            assert lease.deadline - lease.issued_at == pytest.approx(max(5.0, 4.0 * max(took)))

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        exclude_after_failures=100,
        lease_timeout_s=30,
        min_lease_s=5,
    )


def test_unproven_identities_share_a_small_part_of_the_window_beside_a_proven_node(
    tmp_path,
) -> None:
    async def body(coord, client) -> None:
        # A window of 36: the 30 groups below leave 6 of it, what three quotas of 2 can take.
        job_id, _ = await start_job(coord, client, batch_groups=4)
        honest = await client()
        await honest.register()
        await _deliver(coord, honest, job_id, 21)  # proven, and a full quota of 8
        hoarders = [await client() for _ in range(3)]
        for h in hoarders:
            await h.register()
            await _deliver(coord, h, job_id, 3)  # a quota of 2 each (ramp 3), not proven
        held = sum([len((await h.leases(job_id, 0, 8)).leases) for h in hoarders], 0)
        assert held == 1, f"unproven identities hold {held} leases (share: 1 of 36)"
        got = (await honest.leases(job_id, 0, 8)).leases
        assert len(got) == 5, "the proven node was refused the window the hoarders held"

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        exclude_after_failures=100,
        buffer_groups=36,
        fresh_lease_share=0.05,
        proven_groups=21,
    )


def test_without_a_proven_node_the_unproven_share_the_window(tmp_path) -> None:
    """A swarm just started: nobody is proven yet, and nobody is held back for it."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client, batch_groups=4)
        nodes = [await client() for _ in range(3)]
        for n in nodes:
            await n.register()
            await _deliver(coord, n, job_id, 3)
        held = [len((await n.leases(job_id, 0, 8)).leases) for n in nodes]
        assert held == [2, 2, 2]  # each its quota, as before

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        exclude_after_failures=100,
        buffer_groups=19,
        fresh_lease_share=0.05,
        proven_groups=21,
    )


def test_delivery_times_skip_groups_the_learner_rejected(tmp_path) -> None:
    from tests.coordinator.hardening.test_hardening_hoarding import _accept, _lease

    store = Store.open(tmp_path / "db.sqlite")
    store.create_job("j", "t", {})
    store.upsert_node("n", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    now = time.time()
    _lease(store, "slow", "n", now - 100 + 30)  # issued 100 s ago
    _accept(store, "slow", "n")
    assert store.delivery_times("n", 8)[0] >= 100
    store._db.execute("UPDATE rollouts SET status='rejected' WHERE rollout_id='slow'")
    assert store.delivery_times("n", 8) == []
    from echo.coordinator.config import VerificationSection

    assert LeaseTerms(store, VerificationSection()).term_s("n") == 30.0
    store.close()
