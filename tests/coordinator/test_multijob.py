"""One coordinator, several jobs: the scheduler's placement as nodes see it over real libp2p
(registration and lease replies), the operator's view, and pruning a finished job's chunks."""

from __future__ import annotations

import os
import time
from pathlib import Path

from echo.coordinator.api.app import job_status
from echo.coordinator.scheduling.assign import SchedulerParams
from echo.p2p.chunkstore import ChunkStore, prune_job_stores
from echo.protocol import messages as m
from tests.conftest import run_with_coordinator, submit_job
from tests.coordinator.test_coordinator import start_job


def test_nodes_are_spread_over_jobs_moved_and_replaced_when_a_job_ends(tmp_path) -> None:
    async def body(coord, client) -> None:
        coord.placement.params = SchedulerParams(min_stay_s=0.0, min_gain=0.15, headroom=1.1)
        job_a, _ = await start_job(coord, client)
        job_b, _ = await start_job(coord, client)
        nodes = [await client() for _ in range(2)]
        assigned = []
        for n in nodes:
            reply = await n.register()
            assert {j.job_id for j in reply.jobs} == {job_a, job_b}
            assigned.append(reply.assigned_job)
        # Both jobs are new (need not measured): one node each, not both on the first job.
        assert sorted(assigned) == sorted([job_a, job_b])
        on_a = nodes[assigned.index(job_a)]
        on_b = nodes[assigned.index(job_b)]
        # A node asking for leases of a job it is not placed on is told where it belongs.
        reply = await on_a.leases(job_b, have=0)
        assert reply.leases == [] and reply.assigned_job == job_a
        reply = await on_a.leases(job_a, have=0)
        assert reply.leases and reply.assigned_job is None
        # The operator sees each job's node.
        assert coord.job_schedule(job_a)["nodes"] == [str(on_a.host.peer_id)]
        st = job_status(coord, job_b)
        assert st is not None and st["schedule"]["nodes"] == [str(on_b.host.peer_id)]
        assert st["schedule"]["learner"] == "unmeasured" and st["schedule"]["priority"] == 0
        # Job A ends: its node hears it from its lease reply, registers again and is placed on B.
        coord.store.set_job_status(job_a, "done")
        reply = await on_a.leases(job_a, have=0)
        assert reply.leases == [] and reply.message == "job is done"
        reply = await on_a.register()
        assert reply.assigned_job == job_b and [j.job_id for j in reply.jobs] == [job_b]
        assert set(coord.job_schedule(job_b)["nodes"]) == {str(n.host.peer_id) for n in nodes}
        # B ends too: nothing runs, the node is told why it is idle.
        coord.store.set_job_status(job_b, "done")
        reply = await on_b.register()
        assert reply.assigned_job == "" and reply.message == "no running job"
        # A job whose learner has not published version 0 yet: the node is told one is
        # starting (it asks again sooner than when nothing runs).
        submit_job(coord)
        reply = await on_b.register()
        assert reply.assigned_job == "" and reply.message == m.JOB_STARTING

    run_with_coordinator(tmp_path, body)


def test_a_high_priority_job_gets_its_nodes_back_and_a_node_moves_by_lease_reply(
    tmp_path,
) -> None:
    async def body(coord, client) -> None:
        coord.placement.params = SchedulerParams(min_stay_s=0.0, min_gain=0.15, headroom=1.1)
        job_a, _ = await start_job(coord, client)
        nodes = [await client() for _ in range(3)]
        for n in nodes:
            assert (await n.register()).assigned_job == job_a
        # A job of higher priority arrives: the next pass moves nodes to it (one each at
        # least, and as an unmeasured job it wants every node it can get), and the moved
        # nodes learn it from their next lease reply.

        job_b, _ = await start_job(coord, client)
        coord.job_control.jobs[job_b].spec.schedule.priority = 5
        coord.placement.refresh()
        on_b = set(coord.job_schedule(job_b)["nodes"])
        assert len(on_b) == 2 and len(coord.job_schedule(job_a)["nodes"]) == 1
        for n in nodes:
            reply = await n.leases(job_a, have=0)
            moved = str(n.host.peer_id) in on_b
            assert (reply.assigned_job == job_b) if moved else reply.assigned_job is None

    run_with_coordinator(tmp_path, body)


def test_finished_jobs_chunks_are_pruned_within_the_disk_allowance(tmp_path: Path) -> None:
    root = tmp_path / "chunks"
    for i, job in enumerate(["old", "mid", "current"]):
        store = ChunkStore(root / job)
        store.put(0, bytes([i]) * 1000)
        t = time.time() - 100 * (3 - i)  # "old" written first
        os.utime(root / job, (t, t))
    # 1500 bytes allowed for jobs not being served: the oldest goes, "mid" stays.
    assert prune_job_stores(root, {"current"}, 1500) == ["old"]
    assert sorted(p.name for p in root.iterdir()) == ["current", "mid"]
    # 0 allowed: only the job being served keeps its chunks.
    assert prune_job_stores(root, {"current"}, 0) == ["mid"]
    assert [p.name for p in root.iterdir()] == ["current"]
    assert prune_job_stores(tmp_path / "none", set(), 0) == []
