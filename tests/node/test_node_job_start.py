"""A node on standby while a job starts joins it when the coordinator gossips the job's first
plan, not at its next poll (echo.node.session). Polling alone, nodes found a new job up to a
poll period (6 s) late, while the first nodes' groups already moved it on: in the NAT swarm a
30-step job was over before one node had joined it (tests/e2e/test_nat_swarm.py)."""

from __future__ import annotations

import trio
from rich.console import Console

import echo.node.session as session_mod
from echo.node.display import Display
from echo.node.session import CoordinatorSession
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.protocol import messages as m
from echo.tools.peer_kit import register_record
from tests.conftest import run_with_coordinator, submit_job
from tests.coordinator.test_coordinator import attach_learner


def test_a_standby_node_joins_a_starting_job_at_its_first_plan(tmp_path, monkeypatch) -> None:
    # Far longer than the test's wait: only the plan can bring the node in in time.
    monkeypatch.setattr(session_mod, "IDLE_POLL_S", 120.0)

    async def body(coord, client) -> None:
        job_id = submit_job(coord)
        node = Identity.generate()
        async with open_host(node) as host:
            session = CoordinatorSession(node, Display(Console(quiet=True)), lambda: None)
            session.describe = lambda: register_record(host.listen_multiaddrs)
            await session.connect(host, coord.multiaddrs[0])
            got: list[m.JobInfo] = []
            async with trio.open_nursery() as nursery:

                async def wait() -> None:
                    got.append(await session.wait_for_job(first=True))

                nursery.start_soon(wait)
                with trio.fail_after(20):
                    while session.display.state != f"idle: {m.JOB_STARTING}":
                        await trio.sleep(0.05)
                    # The coordinator has seen the node's subscription: the plan will reach it.
                    await coord.host.wait_for_subscribers(ids.TOPIC_VERSIONS, 1, timeout=20)
                assert not got
                # The job's learner attaches and publishes version 0.
                _, ack = await attach_learner(coord, client, job_id)
                assert ack.plan, "the coordinator planned no broadcast of v0"
                with trio.fail_after(15):
                    while not got:
                        await trio.sleep(0.05)
            assert got[0].job_id == job_id and got[0].current_version == 0

    run_with_coordinator(tmp_path, body)
