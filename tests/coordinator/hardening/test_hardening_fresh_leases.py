"""Strangers' leases come on top of the window, not out of a worker's (issue 26: churn).

Identities that never had a group accepted share ``fresh_lease_share`` of a job's lease window.
That share used to be taken out of the window every node draws from: a churn of identities,
each taking a lease it lets expire, held a quarter of a quick job's window of 8 for 30 s at a
time, and the learner waited for groups while the honest nodes were told the buffer was full
(``benchmarks/attack.py --attackers churn``). Checked against the real coordinator.
"""

from __future__ import annotations

from tests.conftest import run_with_coordinator
from tests.coordinator.hardening.test_hardening_lease_terms import _deliver
from tests.coordinator.test_coordinator import start_job


def test_strangers_leases_do_not_shrink_a_workers_room(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        worker = await client()
        await worker.register()
        await _deliver(coord, worker, job_id, 3)  # buffered: 3 of the window of 8; quota 4
        strangers = [await client() for _ in range(3)]
        held = 0
        for s in strangers:
            await s.register()
            held += len((await s.leases(job_id, 0, 4)).leases)
        assert held == 2, f"strangers hold {held} leases (their share: 2 of 8)"
        got = (await worker.leases(job_id, 0, 8)).leases
        assert len(got) == 4, f"the worker got {len(got)} leases, its quota is 4"

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=1,
        buffer_groups=8,
        fresh_lease_share=0.25,
        proven_groups=3,
    )


def test_a_stranger_gets_its_share_while_workers_keep_the_window_full(tmp_path) -> None:
    """On top of the window means a newcomer's first lease does not wait for a gap in it.

    Workers keep a busy job's window full (buffered groups and open leases add up to the
    target), and their own room no longer counts strangers' leases. A stranger's room was still
    measured against that full window, so it was 0 whenever the workers had just asked: in the
    NAT swarm (tests/e2e/test_nat_swarm.py) a node behind a symmetric router followed every
    version within 1.5 s and was told "buffer full" for 25 s, and under load another was given no
    lease in the whole job."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        worker = await client()
        await worker.register()
        await _deliver(coord, worker, job_id, 3)  # buffered: 3 of the window of 8; quota 4
        held = len((await worker.leases(job_id, 0, 8)).leases)
        assert held == 4, held
        other = await client()
        await other.register()
        await _deliver(coord, other, job_id, 1)  # buffered 4, open 4: the window is full
        assert (await other.leases(job_id, 0, 8)).leases == []
        stranger = await client()
        await stranger.register()
        reply = await stranger.leases(job_id, 0, 4)
        assert len(reply.leases) == 1, reply.message  # its quota: 1 of the strangers' 2
        # ... and the strangers' share stays bounded: a second one gets the last, a third none.
        late = [await client() for _ in range(2)]
        got = []
        for s in late:
            await s.register()
            got.append(len((await s.leases(job_id, 0, 4)).leases))
        assert got == [1, 0], got
        # The workers' window is untouched by them.
        assert (await other.leases(job_id, 0, 8)).leases == []

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=1,
        buffer_groups=8,
        fresh_lease_share=0.25,
        proven_groups=3,
    )
