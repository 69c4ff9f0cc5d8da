"""A swarm of relay agents (:mod:`echo.tools.relay_agent`), one process per emulated host.

This module owns the swarm's life: building the network (one namespace per host from
:mod:`echo.tools.netem`, or plain loopback for in-process shaping), starting each agent with its
listen address, the learner's key and a store of its own, waiting until every agent is up,
having agents dial the children a plan gives them, and stopping the agents, the namespaces and
the working folder. What runs over the swarm (plans, versions, timings) is the benchmark's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

import echo.tools.netem as netem
from echo.coordinator.dissemination.planner.plan import TreePlan
from echo.p2p.identity import Identity
from echo.tools.relay_agent import COMMAND_TIMEOUT_S, AgentProc

PORT = 4001
STARTUP_TIMEOUT_S = 120.0


class RelaySwarm:
    """Relay agents by host name, with each host's link rates; ``source`` holds the learner's
    signing key (its agent publishes versions), the others only verify against it.

    ``agent_cmd`` is the command line that starts one agent (its flags are appended);
    ``shaping`` is ``"netns"`` (namespaces shaped by tc, ``netem_opts`` passed to
    :func:`echo.tools.netem.up`) or ``"inproc"`` (loopback, no namespaces)."""

    def __init__(self, agent_cmd: Sequence[str], *, shaping: str, source: str, prefix: str,
                 netem_opts: dict[str, Any] | None = None, nice: int = 0,
                 keep_logs: bool = False) -> None:
        self.agent_cmd = list(agent_cmd)
        self.shaping = shaping
        self.source = source
        self.prefix = prefix
        self.netem_opts = netem_opts or {}
        self.nice = nice
        self.keep_logs = keep_logs
        self.agents: dict[str, AgentProc] = {}
        self.ups: dict[str, float] = {}
        self.downs: dict[str, float] = {}
        self.learner = Identity.generate()
        self.workdir = Path(tempfile.mkdtemp(prefix="echo-bcast-"))

    def build_network(self, specs: list[netem.HostSpec]) -> dict[str, str]:
        """Build one namespace per host (tools/netem.py); each host's address by name.
        benchmarks/nat.py builds an internet with NAT routers instead."""
        return {i.name: i.ip for i in netem.up(specs, prefix=self.prefix, quiet=True,
                                               **self.netem_opts)}

    def in_host(self, name: str, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` inside host ``name``'s namespace."""
        return netem.exec_argv(name, argv, prefix=self.prefix)

    def plan_addrs(self) -> dict[str, list[str]]:
        """Where each agent can be dialled, as the routes carry it (by peer id)."""
        return {a.peer_id: a.addrs for a in self.agents.values()}

    async def start(self, nursery: trio.Nursery, specs: list[netem.HostSpec]) -> None:
        """Start one agent per spec (their event pumps in ``nursery``); return once all are up."""
        infos = self.build_network(specs) if self.shaping == "netns" else {}
        for spec in specs:
            self.ups[spec.name], self.downs[spec.name] = spec.up_bps, spec.down_bps
            argv = [*self.agent_cmd,
                    "--learner-pub", self.learner.public_key_bytes.hex(),
                    "--store", str(self.workdir / spec.name)]
            if spec.name == self.source:
                argv += ["--seed", self.learner.private_key.private_bytes_raw().hex()]
            if self.shaping == "netns":
                argv += ["--listen", f"/ip4/{infos[spec.name]}/tcp/{PORT}"]
                argv = self.in_host(spec.name, argv)
            else:
                argv += ["--listen", "/ip4/127.0.0.1/tcp/0"]
            if self.nice:
                argv = ["nice", "-n", str(self.nice), *argv]
            log = open(self.workdir / f"{spec.name}.log", "wb")  # noqa: SIM115 (closed at exit)
            env = {**os.environ, **({"ECHO_BENCH_AGENT_LOG": "INFO"} if self.keep_logs
                                    else {})}
            proc = await trio.lowlevel.open_process(argv, stdin=-1, stdout=-1, stderr=log,
                                                    env=env)
            agent = AgentProc(spec.name, proc)
            agent.log_path = self.workdir / f"{spec.name}.log"
            self.agents[spec.name] = agent
            nursery.start_soon(agent.pump)
        for agent in self.agents.values():
            ready = await agent.expect("ready", STARTUP_TIMEOUT_S)
            agent.peer_id, agent.addrs = ready["peer_id"], ready["addrs"]

    async def connect_plan(self, plan: TreePlan, agents: list[AgentProc],
                           addrs: dict[str, list[str]]) -> None:
        """Everyone dials its children first: steady-state swarms keep these connections."""
        for a in agents:
            kids = {c for stripe in plan.children_of(a.peer_id) for c in stripe}
            await a.send(cmd="connect", addrs=[addrs[c][0] for c in kids])
        for a in agents:
            await a.expect("connected", COMMAND_TIMEOUT_S)

    async def shutdown(self) -> None:
        """Ask every agent to quit; kill those still running 15 s later."""
        for a in self.agents.values():
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await a.send(cmd="quit")
        with trio.move_on_after(15):
            for a in self.agents.values():
                await a.proc.wait()
        for a in self.agents.values():
            if a.proc.returncode is None:
                a.proc.kill()
                with trio.move_on_after(5):
                    await a.proc.wait()

    def remove(self) -> None:
        """Take the namespaces down and, unless ``keep_logs``, delete the agents' logs and
        stores (call after :meth:`shutdown`)."""
        if self.shaping == "netns":
            netem.down(self.prefix, quiet=True)
        if not self.keep_logs:
            shutil.rmtree(self.workdir, ignore_errors=True)
