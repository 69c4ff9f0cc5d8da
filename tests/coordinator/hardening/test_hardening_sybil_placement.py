"""Fresh identities cannot bench the nodes that work, nor relay in broadcast trees (found by
benchmarks/attack.py).

The scheduler counted a node that had measured nothing at the typical rate of the job's nodes,
so 16 fresh identities (free to make) "met" a job's need ten times over and the scheduler sent
the honest nodes with a record of accepted work to standby, where they did nothing. Now a node
without an accepted group counts for a thousandth of that towards a job's need.
"""

from __future__ import annotations

from echo.coordinator.scheduling.assign import SchedulerParams
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job

SYBILS = 16


def test_sixteen_fresh_identities_do_not_send_working_nodes_to_standby(tmp_path) -> None:
    async def body(coord, client) -> None:
        coord.placement.params = SchedulerParams(min_stay_s=0.0, min_gain=0.15, headroom=1.1)
        job_id, _ = await start_job(coord, client)
        honest = [await client() for _ in range(2)]
        for h in honest:  # each earns a record: one valid group, accepted
            await h.register()
            lease = open_lease(coord, (await h.leases(job_id, 0, 1)).leases[0])
            assert (await h.submit(h.seal(group_for(lease)))).accepted
        for v in range(1, 6):  # the learner's pace is measured: the job has a finite need
            coord.store.publish_version(
                job_id,
                v,
                kind="patch",
                manifest=b"m",
                state_digest=f"d{v}",
                total_size=1,
                trained=[],
                rejected=[],
                metrics={"step_s": 1.0},
            )
        need = coord.placement.refresh().jobs[job_id].need_rps
        assert need is not None and need > 0
        tpr = coord.store.mean_tokens_per_rollout(job_id)
        # Together they meet the need, neither alone; one is slower than the other (a fresh
        # identity was assumed to deliver the median, which made it the better buy).
        for h, share in zip(honest, (0.45, 0.8), strict=True):
            coord.placement.observed(str(h.host.peer_id), job_id, share * need * tpr, 5)
        ids = {str(h.host.peer_id) for h in honest}
        assert ids <= set(coord.placement.refresh().jobs[job_id].nodes)
        for _ in range(SYBILS):
            await (await client()).register()
        for _ in range(3):
            decision = coord.placement.refresh()
        assert ids <= set(decision.jobs[job_id].nodes), decision.moves

    run_with_coordinator(tmp_path, body, lease_quota_ramp=0, exclude_after_failures=100)


def test_only_nodes_with_accepted_work_relay(tmp_path) -> None:
    """A fresh identity placed on the job, holding a version, is planned as a leaf (it receives,
    relays to nobody) until one of its groups is accepted: hoarders, no relay at all, once sat
    in anchors' trees as relays and stalled their subtrees (benchmarks/attack.py)."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        nid = str(node.host.peer_id)
        coord.placement.observed(nid, job_id, 0.0, 0)  # it says it holds v0
        coord.placement.refresh()
        assert coord.placement.plannable(nid, job_id, anchor=False)
        assert not coord.placement.proven(nid)
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        assert (await node.submit(node.seal(group_for(lease)))).accepted
        coord.placement.refresh()
        assert coord.placement.proven(nid)

    run_with_coordinator(tmp_path, body, lease_quota_ramp=0, exclude_after_failures=100)


def test_a_thin_record_does_not_make_a_relay(tmp_path) -> None:
    """Stale-version hoarders bought a lease quota with 3 accepted groups each and sat at the
    roots of the broadcast's stripes; when they stopped, every honest node waited out its push
    stall for each version (benchmarks/attack.py, recovery 0.40). With a lease quota ramp, a
    relay needs ``proven_groups`` accepted groups, the record the lease window asks of the
    proven."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        nid = str(node.host.peer_id)
        coord.placement.observed(nid, job_id, 0.0, 0)
        for _ in range(3):
            lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
            assert (await node.submit(node.seal(group_for(lease)))).accepted
        coord.placement.refresh()
        assert coord.placement.plannable(nid, job_id, anchor=False)
        assert not coord.placement.proven(nid), "3 groups made a relay"
        for _ in range(2):
            lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
            assert (await node.submit(node.seal(group_for(lease)))).accepted
        coord.placement.refresh()
        assert coord.placement.proven(nid)

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        proven_groups=5,
        buffer_groups=16,
        exclude_after_failures=100,
    )
