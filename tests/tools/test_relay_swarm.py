"""The broadcast benchmark's relay agents as real processes on loopback (tools/relay_swarm.py,
tools/relay_agent.py): a version published by the source reaches every node along a chain with
the source's bytes, and an agent that has gone away is reported, not waited on forever."""

from __future__ import annotations

import sys

import pytest
import trio

import echo.tools.netem as netem
from echo.coordinator.dissemination.planner.best import chain_plan, route_for
from echo.protocol import broadcast as b
from echo.tools.relay_agent import JOB
from echo.tools.relay_swarm import RelaySwarm

TIMEOUT_S = 60.0


async def _chain_and_gone(swarm: RelaySwarm) -> tuple[str, list[str], str]:
    specs = [netem.HostSpec("src", 2e6, 5e6), netem.HostSpec("a", 1e6, 5e6),
             netem.HostSpec("b", 1e6, 5e6)]
    async with trio.open_nursery() as nursery:
        try:
            await swarm.start(nursery, specs)
            src, nodes = swarm.agents["src"], [swarm.agents["a"], swarm.agents["b"]]
            plan = chain_plan(src.peer_id, 2e6, {n.peer_id: 1e6 for n in nodes})
            await src.send(cmd="publish", version=1, size=300_000, chunk=64 * 1024)
            pub = await src.expect("published", TIMEOUT_S)
            addrs = swarm.plan_addrs()
            await swarm.connect_plan(plan, [src, *nodes], addrs)
            for n in nodes:
                route = route_for(plan, n.peer_id, addrs, JOB, 1)
                await n.send(cmd="route", route=b.encode(route).hex(), envelope=pub["envelope"],
                             timeout=TIMEOUT_S)
                await n.expect("routed", TIMEOUT_S)
            await src.send(cmd="route", route=b.encode(route_for(plan, src.peer_id, addrs, JOB,
                                                                  1)).hex(),
                           watch=False, timeout=TIMEOUT_S)
            await src.expect("routed", TIMEOUT_S)
            shas = []
            for n in nodes:
                await n.expect("complete", TIMEOUT_S)
                await n.send(cmd="verify", version=1)
                shas.append((await n.expect("verified", TIMEOUT_S))["sha"])
            gone = nodes[1]
            await gone.send(cmd="quit")
            with pytest.raises(RuntimeError, match="exited while waiting for configured") as err:
                await gone.expect("configured", TIMEOUT_S)
            return pub["sha"], shas, str(err.value)
        finally:
            with trio.CancelScope(shield=True):
                await swarm.shutdown()
            nursery.cancel_scope.cancel()


def test_a_version_reaches_every_node_of_a_chain_and_a_gone_agent_is_reported() -> None:
    swarm = RelaySwarm([sys.executable, "-m", "echo.tools.relay_agent"], shaping="inproc",
                       source="src", prefix="unused")
    try:
        want, shas, _ = trio.run(_chain_and_gone, swarm)
    finally:
        swarm.remove()
    assert len(want) == 64
    assert shas == [want, want]
    assert all(a.proc.returncode is not None for a in swarm.agents.values())
    assert not swarm.workdir.exists()
