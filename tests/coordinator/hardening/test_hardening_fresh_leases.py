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
