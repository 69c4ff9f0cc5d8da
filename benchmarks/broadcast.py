"""Benchmark weight dissemination: time until every node holds a version, star vs chain vs tree.

Every host is a real process -- one EchoHost (TCP + Noise + yamux) and one Relay
(``echo.p2p.relay``) -- in its own network namespace from ``tools/netem.py``, its upload
and download shaped by tc: by default htb with ACK priority and one FIFO per peer served
round-robin, as a router with per-flow fair queueing (fq_codel, cake) does (``--shaper htb``:
one shared drop-tail FIFO; ``--shaper tbf``: a plain token bucket). For each node count N and
payload size M the source publishes a fresh signed version (chunked as the learner does,
``chunk_size_for``: 128 KiB up to 64 MB, 512 KiB at 256 MB; ``--chunk-kb`` fixes it) and pushes it
along three plans from ``echo.coordinator.dissemination.planner.best``:

- ``star``: the source sends to every node itself (time grows linearly with N);
- ``chain``: source -> fastest -> ... -> slowest;
- ``tree``: ``best_plan`` (striped trees sized by upload bandwidth).

Links (``--scale`` 0.2 of a base of source 10 MB/s, node uplinks 1-10 MB/s, downlinks 25 MB/s):
source 2 MB/s, nodes 0.2-2 MB/s, downlinks 5 MB/s. py-libp2p costs tens of ms of CPU per MB
moved here (Noise + yamux + trio, both ends), so faster links would make the two CPU cores, not
the links, the bottleneck. Payloads above 16 MB run the tree only (a star of 64 MB to 16 nodes
at 2 MB/s takes ~9 minutes), and above 100 MB only at the largest N.

Each run prints time, the lower bound ``max(M/B_s, M/min D_i, N*M/(B_s+sum B_i))`` and the ratio,
the planner's analytic estimate, chunks pulled (the stall/lie fallback), and CPU: the agents'
share of the machine, the machine's utilisation (includes other jobs), and the agents' run-queue
wait per CPU-second (near 0 on an idle machine; well above 1 means they waited for a core longer
than they ran, and the timings measure that contention as much as the links). Every node's bytes
are checked against the source's. The bound uses nominal link rates; TCP/IP, Noise and yamux
headers take ~4-5% of a shaped link, so ~1.05 is the practical floor. ``--per-node`` adds each
node's finish time and push rate against its uplink, when each stripe's first and last chunk
reached it, and when each of the source's children last acknowledged; ``--pace F`` has every
relay cap its pushes at F times its uplink (what ``--max-upload-mbps`` does for a volunteer),
which keeps a drop-tail queue (``--shaper htb``) from overflowing.

Without root or network namespaces it falls back to in-process shaping (every relay's push
upload throttled by a token bucket, no download shaping, loopback) and says so in every line and
in the JSON. This kernel has no sch_netem, so no latency is emulated (bandwidth only).

Run: ``python benchmarks/broadcast.py [--quick]`` (as root). The last line printed is one JSON
object with ``tree_vs_bound``, ``star_vs_bound`` and ``chain_vs_bound`` at the largest N (the
largest payload all three ran), ``tree_vs_bound_largest_payload``, and every run under ``runs``.
Internally the script also serves as the per-host agent (``--agent``; do not call directly).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio

import echo.tools.netem as netem
from echo.coordinator.dissemination.planner.best import best_plan, chain_plan, route_for, star_plan
from echo.coordinator.dissemination.planner.plan import TreePlan, lower_bound_s
from echo.p2p.chunkstore import ChunkStore, chunk_size_for, split_chunks
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.relay import Relay, RelayConfig
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tools.bench import emit, parse_args, say

HERE = Path(__file__).resolve().parent

JOB = "bench"
MB = 1e6
EVENT = "@@ "  # agent -> orchestrator lines start with this; anything else is library noise
PORT = 4001
SOURCE = "src"
# Upload (MB/s) of node i: heterogeneous, and every prefix of the list is mixed.
UPLOADS_MBPS = [8, 2, 5, 1, 10, 3, 6, 1.5, 4, 2.5, 7, 1, 3.5, 9, 2, 5.5,
                3, 6, 2, 8, 1, 4, 5, 2.5, 3, 7, 1.2, 2, 6, 3.3, 4.4, 9]
SOURCE_UP_MBPS = 10.0
DOWN_MBPS = 25.0
STARTUP_TIMEOUT_S = 120.0
COMMAND_TIMEOUT_S = 120.0


# ================================================================================= agent side


def _say_event(**obj: Any) -> None:
    sys.stdout.write(EVENT + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _lines(stream: trio.abc.ReceiveStream):
    buf = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


class _Agent:
    """One host: an EchoHost, a relay (restarted per run with that run's config), a store."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.learner_pub = bytes.fromhex(args.learner_pub)
        self.ident = (Identity.from_seed(bytes.fromhex(args.seed)) if args.seed
                      else Identity.generate())
        self.store = ChunkStore(Path(args.store), keep_versions=2)
        self.relay: Relay | None = None
        self.relay_scope: trio.CancelScope | None = None
        self.relay_stopped = trio.Event()
        self.envelopes: dict[int, bytes] = {}

    async def _run_relay(self, host, config: RelayConfig, stopped: trio.Event, *,
                         task_status) -> None:
        try:
            with trio.CancelScope() as scope:
                relay = Relay(host, self.store, learner_keys={JOB: self.learner_pub},
                              config=config,
                              on_bad_peer=lambda r: _say_event(event="bad_peer", peer=r.peer_id,
                                                               reason=r.reason))
                self.relay_scope = scope
                await relay.run(task_status=task_status)
        finally:
            stopped.set()

    async def _restart_relay(self, nursery, host, config: RelayConfig) -> None:
        """Stop the running relay (and wait until its handlers are gone), start a new one."""
        if self.relay_scope is not None:
            self.relay_scope.cancel()
            with trio.fail_after(COMMAND_TIMEOUT_S):
                await self.relay_stopped.wait()
        self.relay_stopped = trio.Event()
        self.relay = await nursery.start(self._run_relay, host, config, self.relay_stopped)

    def _publish(self, version: int, size: int, chunk: int) -> None:
        import numpy as np

        payload = np.random.default_rng(version).bytes(size)
        refs = [m.ChunkRef(sha256=self.store.put(version, c), size=len(c))
                for c in split_chunks(payload, chunk)]
        man = m.Manifest(job_id=JOB, version=version, base_version=-1, kind="anchor",
                         total_size=size, chunks=refs, tensor_digests={}, state_digest="bench",
                         anchor_version=version, created_at=time.time())
        env = signing.seal_record(self.ident.private_key, man)
        self.envelopes[version] = env
        _say_event(event="published", version=version, envelope=env.hex(),
                   sha=hashlib.sha256(payload).hexdigest(), chunks=len(refs))

    async def _watch(self, version: int, timeout: float) -> None:
        assert self.relay is not None
        try:
            t = await self.relay.wait(JOB, version, timeout)
        except TimeoutError as exc:
            t = self.relay.transfer(JOB, version)
            state = {} if t is None else {
                "have": t.n_have, "chunks": t.n, "want": len(t.want),
                "feeds": [(f.peer[-8:], f.stripe, f.state) for f in t.feeds],
                "peer_have": len(t.peer_have), "stats": vars(t.stats)}
            _say_event(event="timeout", version=version, detail=str(exc), state=state)
            return
        st = t.stats
        _say_event(event="complete", version=version, done_at=t.done_at, **_timeline(t),
                   pulled=st.chunks_pulled, bad=st.bad_chunks,
                   pushed_out=st.pushed_out_bytes, push_rate=st.push_rate_bps(),
                   lagging=sum(1 for s in t.child_state.values() if s == "lagging"))

    async def main(self) -> None:
        async with open_host(self.ident, [self.args.listen], pubsub=False) as host:
            _say_event(event="ready", peer_id=self.ident.peer_id_str, addrs=host.listen_multiaddrs)
            stdin = trio.lowlevel.FdStream(os.dup(0))
            async with trio.open_nursery() as nursery:
                await self._restart_relay(nursery, host, RelayConfig())
                async for line in _lines(stdin):
                    cmd = json.loads(line)
                    op = cmd["cmd"]
                    if op == "quit":
                        break
                    if op == "publish":
                        self._publish(cmd["version"], cmd["size"], cmd["chunk"])
                    elif op == "config":
                        await self._restart_relay(nursery, host, RelayConfig(**cmd["config"]))
                        _say_event(event="configured")
                    elif op == "connect":
                        async with trio.open_nursery() as dials:
                            for addr in cmd["addrs"]:
                                dials.start_soon(host.connect, addr)
                        _say_event(event="connected")
                    elif op == "route":
                        route = b.decode(b.Route, bytes.fromhex(cmd["route"]))
                        env = bytes.fromhex(cmd["envelope"]) if cmd.get("envelope") else (
                            self.envelopes[route.version])
                        t0 = time.monotonic()
                        assert self.relay is not None
                        await self.relay.start(env, route)
                        _say_event(event="routed", version=route.version, t0=t0)
                        if cmd.get("watch", True):
                            nursery.start_soon(self._watch, route.version, cmd["timeout"])
                    elif op == "timeline":
                        assert self.relay is not None
                        t = self.relay.transfer(JOB, cmd["version"])
                        _say_event(event="timeline", **({} if t is None else _timeline(t)))
                    elif op == "verify":
                        assert self.relay is not None
                        t = self.relay.transfer(JOB, cmd["version"])
                        sha = (hashlib.sha256(t.payload(self.store)).hexdigest()
                               if t is not None and t.complete else "")
                        self.store.prune()
                        _say_event(event="verified", version=cmd["version"], sha=sha)
                nursery.cancel_scope.cancel()


def _timeline(t) -> dict[str, Any]:
    """When each stripe's first and last chunk arrived here, and when each child last
    acknowledged (time.monotonic(), for --per-node)."""
    stripes: dict[int, list[float]] = {}
    for i, at in zip(t.order, t.arrived_at, strict=True):
        first_last = stripes.setdefault(t.stripe_of(i), [at, at])
        first_last[1] = at
    return {"stripe_times": {str(s): v for s, v in sorted(stripes.items())},
            "acked_at": [[s, c, at] for (s, c), at in t.acked_at.items()]}


def agent_entry(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", action="store_true")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--learner-pub", required=True)
    parser.add_argument("--seed", default="")
    parser.add_argument("--store", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{os.path.basename(args.store)}] %(name)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if os.environ.get("ECHO_BENCH_AGENT_LOG"):
        logging.getLogger("echo").setLevel(os.environ["ECHO_BENCH_AGENT_LOG"])
    profile_to = os.environ.get("ECHO_BENCH_PROFILE_DIR")
    if profile_to:  # developer aid: a cProfile dump per agent
        import cProfile

        cProfile.runctx("trio.run(_Agent(args).main)", globals(), {"args": args, "trio": trio},
                        filename=os.path.join(profile_to, os.path.basename(args.store) + ".prof"))
    else:
        trio.run(_Agent(args).main)


# ============================================================================ orchestrator side


class AgentProc:
    """The orchestrator's handle on one agent process (JSON lines over its stdin/stdout)."""

    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.send_ch, self.recv_ch = trio.open_memory_channel[dict](1000)
        self.peer_id = ""
        self.addrs: list[str] = []
        self.log_path: Path | None = None

    async def pump(self) -> None:
        assert self.proc.stdout is not None
        async for line in _lines(self.proc.stdout):
            if line.startswith(EVENT):
                await self.send_ch.send(json.loads(line[len(EVENT):]))
        await self.send_ch.aclose()

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all((json.dumps(cmd) + "\n").encode())

    async def expect(self, event: str, timeout: float) -> dict:
        with trio.fail_after(timeout):
            async for msg in self.recv_ch:
                if msg.get("event") == event:
                    return msg
                if msg.get("event") == "bad_peer":
                    say(f"    {self.name}: reported {msg['peer'][-8:]} ({msg['reason']})")
                if msg.get("event") == "timeout":
                    raise RuntimeError(f"agent {self.name} gave up: {msg}")
        tail = ""
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"agent {self.name} exited while waiting for {event}:\n{tail}")


class CpuMeter:
    """CPU over a window: the agents' own share of the machine (100% = every core busy with
    them), and the whole machine's utilisation (average, and peak of 0.5 s samples; it includes
    anything else running on the machine)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.samples: list[float] = []
        self.start = psutil.cpu_times()
        self.t0 = time.monotonic()
        self.procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                self.procs.append((proc, proc.cpu_times()))
            except psutil.Error:
                continue

    @staticmethod
    def _schedstat(pids: Sequence[int]) -> tuple[float, float]:
        """(seconds on CPU, seconds runnable but waiting for a CPU) of the agents' main threads
        (the event loops; worker threads come and go and would take their counts with them)."""
        run = wait = 0.0
        for pid in pids:
            try:
                on, delay, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            run += int(on) / 1e9
            wait += int(delay) / 1e9
        return run, wait

    def start_sched(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.sched0 = self._schedstat(self.pids)

    def sched_wait_ratio(self) -> float:
        """Run-queue wait per second of CPU our agents got: ~0 on an idle machine; above 1 means
        they spent longer waiting for a core than running (the machine, not the links, limits)."""
        run, wait = self._schedstat(self.pids)
        d_run, d_wait = run - self.sched0[0], wait - self.sched0[1]
        return d_wait / d_run if d_run > 0 else 0.0

    def agents_pct(self) -> float:
        used = 0.0
        for proc, before in self.procs:
            try:
                now = proc.cpu_times()
            except psutil.Error:
                continue
            used += (now.user - before.user) + (now.system - before.system)
        wall = time.monotonic() - self.t0
        return 100.0 * used / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0

    async def sample(self) -> None:
        psutil.cpu_percent(interval=None)
        while True:
            await trio.sleep(0.5)
            self.samples.append(psutil.cpu_percent(interval=None))

    def result(self) -> tuple[float, float]:
        end = psutil.cpu_times()
        busy = sum(getattr(end, f) - getattr(self.start, f) for f in end._fields
                   if f not in ("idle", "iowait", "guest", "guest_nice"))
        total = busy + (end.idle - self.start.idle) + (
            getattr(end, "iowait", 0.0) - getattr(self.start, "iowait", 0.0))
        avg = 100.0 * busy / total if total > 0 else 0.0
        return avg, max(self.samples, default=avg)


class Bench:
    def __init__(self, args: argparse.Namespace, shaping: str) -> None:
        self.args = args
        self.shaping = shaping
        self.agents: dict[str, AgentProc] = {}
        self.ups: dict[str, float] = {}
        self.downs: dict[str, float] = {}
        self.version = 0
        self.learner = Identity.generate()
        self.workdir = Path(tempfile.mkdtemp(prefix="echo-bcast-"))

    def host_specs(self, n: int) -> list[netem.HostSpec]:
        s = self.args.scale
        specs = [netem.HostSpec(SOURCE, SOURCE_UP_MBPS * MB * s, DOWN_MBPS * MB * s)]
        for i in range(n):
            up = UPLOADS_MBPS[i % len(UPLOADS_MBPS)]
            specs.append(netem.HostSpec(f"n{i:02d}", up * MB * s, DOWN_MBPS * MB * s))
        return specs

    def build_network(self, specs: list[netem.HostSpec]) -> dict[str, str]:
        """Build one namespace per host (tools/netem.py); each host's address by name.
        benchmarks/nat.py builds an internet with NAT routers instead."""
        return {i.name: i.ip for i in netem.up(specs, prefix=self.args.prefix, quiet=True,
                                               sysctls=self.args.sysctl,
                                               shaper=self.args.shaper,
                                               queue_s=self.args.queue_ms / 1000,
                                               gso_max=self.args.gso_kb * 1024)}

    def in_host(self, name: str, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` inside host ``name``'s namespace."""
        return netem.exec_argv(name, argv, prefix=self.args.prefix)

    def plan_addrs(self) -> dict[str, list[str]]:
        """Where each agent can be dialled, as the routes carry it (by peer id)."""
        return {a.peer_id: a.addrs for a in self.agents.values()}

    async def connect_plan(self, plan: TreePlan, agents: list[AgentProc],
                           addrs: dict[str, list[str]]) -> None:
        """Everyone dials its children first: steady-state swarms keep these connections."""
        for a in agents:
            kids = {c for stripe in plan.children_of(a.peer_id) for c in stripe}
            await a.send(cmd="connect", addrs=[addrs[c][0] for c in kids])
        for a in agents:
            await a.expect("connected", COMMAND_TIMEOUT_S)

    async def start_agents(self, nursery: trio.Nursery, specs: list[netem.HostSpec]) -> None:
        infos = self.build_network(specs) if self.shaping == "netns" else {}
        for spec in specs:
            self.ups[spec.name], self.downs[spec.name] = spec.up_bps, spec.down_bps
            argv = [sys.executable, str(Path(__file__).resolve()), "--agent",
                    "--learner-pub", self.learner.public_key_bytes.hex(),
                    "--store", str(self.workdir / spec.name)]
            if spec.name == SOURCE:
                argv += ["--seed", self.learner.private_key.private_bytes_raw().hex()]
            if self.shaping == "netns":
                argv += ["--listen", f"/ip4/{infos[spec.name]}/tcp/{PORT}"]
                argv = self.in_host(spec.name, argv)
            else:
                argv += ["--listen", "/ip4/127.0.0.1/tcp/0"]
            if self.args.nice:
                argv = ["nice", "-n", str(self.args.nice), *argv]
            log = open(self.workdir / f"{spec.name}.log", "wb")  # noqa: SIM115 (closed at exit)
            env = {**os.environ, **({"ECHO_BENCH_AGENT_LOG": "INFO"} if self.args.keep_logs
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

    def plan(self, kind: str, n: int, size: int) -> TreePlan:
        src = self.agents[SOURCE].peer_id
        nodes = [f"n{i:02d}" for i in range(n)]
        ups = {self.agents[x].peer_id: self.ups[x] for x in nodes}
        downs = {self.agents[x].peer_id: self.downs[x] for x in nodes}
        if kind == "star":
            return star_plan(src, self.ups[SOURCE], ups, downs=downs)
        if kind == "chain":
            return chain_plan(src, self.ups[SOURCE], ups, downs=downs)
        return best_plan(src, self.ups[SOURCE], ups, total_bytes=size,
                         chunk_bytes=self.chunk_bytes(size), downs=downs)

    def chunk_bytes(self, size: int) -> int:
        return self.args.chunk_kb * 1024 or chunk_size_for(size)

    async def one_run(self, kind: str, n: int, size: int) -> dict[str, Any]:
        self.version += 1
        v = self.version
        chunk = self.chunk_bytes(size)
        src = self.agents[SOURCE]
        names = [f"n{i:02d}" for i in range(n)]
        nodes = [self.agents[x] for x in names]
        plan = self.plan(kind, n, size)
        bound = lower_bound_s(size, self.ups[SOURCE], [self.downs[x] for x in names],
                              [self.ups[x] for x in names])
        estimate = plan.estimate_s(size, chunk)
        timeout = max(60.0, 4 * max(bound, estimate) + 30)
        # The relay's own stall timeout unless --stall-timeout says otherwise (on a machine shared
        # with busy jobs a starved, not dead, process can go quiet for many seconds). Star and
        # chain never cut a lagging child, and their nodes may only fall back on the source, so
        # they stay what they claim to be.
        cfg: dict[str, Any] = {"stall_timeout_s": self.args.stall_timeout,
                               "max_lag_chunks": 64 if kind == "tree" else 0}
        max_sources = 32 if kind == "tree" else 0
        if self.shaping == "inproc":
            cfg_by = {x: {**cfg, "upload_limit_bps": self.ups[x]} for x in [SOURCE, *names]}
        elif self.args.pace:
            cfg_by = {x: {**cfg, "upload_limit_bps": self.args.pace * self.ups[x]}
                      for x in [SOURCE, *names]}
        else:
            cfg_by = {x: cfg for x in [SOURCE, *names]}
        for x in [SOURCE, *names]:
            await self.agents[x].send(cmd="config", config=cfg_by[x])
            await self.agents[x].expect("configured", COMMAND_TIMEOUT_S)
        await src.send(cmd="publish", version=v, size=size, chunk=chunk)
        pub = await src.expect("published", COMMAND_TIMEOUT_S)
        addrs = self.plan_addrs()
        by_peer = {a.peer_id: a for a in [src, *nodes]}
        await self.connect_plan(plan, [src, *nodes], addrs)
        for a in nodes:
            route = route_for(plan, a.peer_id, addrs, JOB, v, max_sources=max_sources)
            await a.send(cmd="route", route=b.encode(route).hex(), envelope=pub["envelope"],
                         timeout=timeout)
        for a in nodes:
            await a.expect("routed", COMMAND_TIMEOUT_S)
        meter = CpuMeter([a.proc.pid for a in self.agents.values()])
        meter.start_sched([a.proc.pid for a in self.agents.values()])
        async with trio.open_nursery() as sampler:
            sampler.start_soon(meter.sample)
            await src.send(cmd="route", route=b.encode(route_for(plan, src.peer_id, addrs, JOB,
                                                                  v)).hex(),
                           watch=False, timeout=timeout)
            t0 = (await src.expect("routed", COMMAND_TIMEOUT_S))["t0"]
            done = []
            for a in nodes:
                msg = await a.expect("complete", timeout + 30)
                done.append(msg)
            sampler.cancel_scope.cancel()
        cpu_agents = meter.agents_pct()
        sched_wait = meter.sched_wait_ratio()
        cpu_avg, cpu_peak = meter.result()
        elapsed = max(d["done_at"] for d in done) - t0
        shas = set()
        for a in nodes:
            await a.send(cmd="verify", version=v)
        for a in nodes:
            shas.add((await a.expect("verified", COMMAND_TIMEOUT_S))["sha"])
        await src.send(cmd="verify", version=v)
        await src.expect("verified", COMMAND_TIMEOUT_S)
        ok = shas == {pub["sha"]}
        del by_peer
        row = {
            "topology": kind, "plan": plan.kind, "n": n, "size_mb": size / MB,
            "chunk_kib": chunk // 1024,
            "time_s": round(elapsed, 3), "bound_s": round(bound, 3),
            "vs_bound": round(elapsed / bound, 3), "estimate_s": round(estimate, 3),
            "depth": plan.depth(), "stripes": len(plan.stripes),
            "pulled_chunks": sum(d["pulled"] for d in done),
            "lagging_cuts": sum(d["lagging"] for d in done),
            "cpu_agents_pct": round(cpu_agents, 1), "sched_wait_per_cpu_s": round(sched_wait, 2),
            "cpu_machine_avg_pct": round(cpu_avg, 1), "cpu_machine_peak_pct": round(cpu_peak, 1),
            "bytes_ok": ok,
            "pushed_out_bytes": {x: d["pushed_out"] for x, d in zip(names, done, strict=True)},
        }
        say(f"  {kind:>5} N={n:<3} M={size / MB:>5.0f} MB  {elapsed:7.2f} s  bound "
            f"{bound:7.2f} s  x{elapsed / bound:5.2f}  est {estimate:7.2f} s  "
            f"({plan.kind}, depth {plan.depth()})  pulled {row['pulled_chunks']:>4}  "
            f"cpu ours {cpu_agents:3.0f}% machine {cpu_avg:3.0f}% (peak {cpu_peak:3.0f}%) "
            f"runq-wait/cpu {sched_wait:4.1f}  "
            f"{'ok' if ok else 'BYTES DIFFER'}"
            f"{'  [in-process shaping]' if self.shaping == 'inproc' else ''}")
        if self.args.per_node:
            await src.send(cmd="timeline", version=v)
            src_line = await src.expect("timeline", COMMAND_TIMEOUT_S)
            self._say_per_node(plan, names, nodes, done, t0, src_line)
        if not ok:
            raise RuntimeError(f"{kind} N={n}: a node's bytes differ from the source's")
        return row

    def _say_per_node(self, plan: TreePlan, names: list[str], nodes: list[AgentProc],
                      done: list[dict], t0: float, src_line: dict) -> None:
        """One line per node, last finisher last: where a run lost time to the bound; then
        when each stripe's last chunk reached each node and each child's last acknowledgement
        to the source."""
        short = {a.peer_id: name for name, a in zip(names, nodes, strict=True)}
        src_acks = sorted((at - t0, s, short.get(c, c[-6:]))
                          for s, c, at in src_line.get("acked_at", []))
        say("      source's children, last ack: " + "  ".join(
            f"{c}/s{s} {at:5.1f}" for at, s, c in src_acks))
        for name, d in zip(names, done, strict=True):
            say(f"      {name} stripes (first-last chunk): " + "  ".join(
                f"s{s} {a - t0:4.1f}-{z - t0:4.1f}" for s, (a, z) in d["stripe_times"].items()))
        rows = []
        for name, a, d in zip(names, nodes, done, strict=True):
            rows.append((d["done_at"] - t0, name, self.ups[name], plan.fanout(a.peer_id),
                         d["pushed_out"], d["push_rate"], d["pulled"]))
        for at, name, up, fan, pushed, rate, pulled in sorted(rows):
            say(f"      {name} up {up / MB:4.2f} MB/s  children {fan:2d}  done {at:6.2f} s  "
                f"pushed {pushed / MB:6.2f} MB at {rate / MB:4.2f} MB/s "
                f"({rate / up if up else 0:4.0%} of uplink)  pulled {pulled}")

    async def shutdown(self) -> None:
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


def matrix(args: argparse.Namespace) -> list[tuple[int, int, list[str]]]:
    """(N, size in bytes, topologies) in run order."""
    out = []
    for n in args.nodes:
        for size_mb in args.sizes:
            kinds = list(args.topologies)
            if size_mb > args.big_tree_only_mb:
                kinds = [k for k in kinds if k == "tree"]
            if size_mb > args.largest_n_only_mb and n != max(args.nodes):
                continue
            if kinds:
                out.append((n, int(size_mb * MB), kinds))
    return out


async def orchestrate(args: argparse.Namespace, shaping: str) -> dict[str, Any]:
    bench = Bench(args, shaping)
    n_max = max(args.nodes)
    specs = bench.host_specs(n_max)
    rows: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            try:
                t = time.monotonic()
                await bench.start_agents(nursery, specs)
                say(f"{len(specs)} agents up in {time.monotonic() - t:.1f} s ({shaping} shaping)")
                for n, size, kinds in matrix(args):
                    for kind in kinds:
                        rows.append(await bench.one_run(kind, n, size))
            finally:
                with trio.CancelScope(shield=True):
                    await bench.shutdown()
                nursery.cancel_scope.cancel()
    finally:
        if shaping == "netns":
            netem.down(args.prefix, quiet=True)
        if args.keep_logs:
            say(f"agent logs and stores kept in {bench.workdir}")
        else:
            shutil.rmtree(bench.workdir, ignore_errors=True)
    return summarize(args, rows, shaping)


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]], shaping: str) -> dict:
    n_max = max(r["n"] for r in rows)
    top = [r for r in rows if r["n"] == n_max]

    def at(kind: str) -> dict | None:
        cands = [r for r in top if r["topology"] == kind]
        # The largest payload that star, chain and tree all ran at this N.
        common = {r["size_mb"] for r in top if r["topology"] == "star"} or {
            r["size_mb"] for r in cands}
        cands = [r for r in cands if r["size_mb"] in common] or cands
        return max(cands, key=lambda r: r["size_mb"]) if cands else None

    result: dict[str, Any] = {"shaping": shaping, "shaper": args.shaper,
                              "latency_emulated": False, "n": n_max}
    for kind in ("tree", "star", "chain"):
        r = at(kind)
        if r is not None:
            result[f"{kind}_vs_bound"] = r["vs_bound"]
            result[f"{kind}_size_mb"] = r["size_mb"]
    star = sorted((r["n"], r["time_s"]) for r in rows if r["topology"] == "star"
                  and r["size_mb"] == result.get("star_size_mb"))
    if len(star) >= 2:
        result["star_time_by_n"] = {str(n): t for n, t in star}
    big_tree = [r for r in top if r["topology"] == "tree"]
    if big_tree:
        biggest = max(big_tree, key=lambda r: r["size_mb"])
        result["tree_vs_bound_largest_payload"] = biggest["vs_bound"]
        result["tree_largest_payload_mb"] = biggest["size_mb"]
    result["cpu_agents_pct_max"] = max(r["cpu_agents_pct"] for r in rows)
    result["sched_wait_per_cpu_s_max"] = max(r["sched_wait_per_cpu_s"] for r in rows)
    result["loadavg_1m_at_end"] = os.getloadavg()[0]
    result["cpu_machine_peak_pct"] = max(r["cpu_machine_peak_pct"] for r in rows)
    result["runs"] = rows
    return result


def _setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, nargs="+", default=None, help="node counts")
    parser.add_argument("--sizes", type=float, nargs="+", default=None, help="payloads in MB")
    parser.add_argument("--topologies", nargs="+", default=["star", "chain", "tree"],
                        choices=["star", "chain", "tree"])
    parser.add_argument("--big-tree-only-mb", type=float, default=16.0,
                        help="payloads above this run only the tree (star would take minutes)")
    parser.add_argument("--largest-n-only-mb", type=float, default=100.0,
                        help="payloads above this run only at the largest node count")
    parser.add_argument("--chunk-kb", type=int, default=0,
                        help="chunk size (default: the learner's, chunk_size_for(payload))")
    parser.add_argument("--scale", type=float, default=0.2,
                        help="multiply every link rate (base: source 10 MB/s, nodes 1-10 MB/s, "
                             "downlinks 25 MB/s); 0.2 keeps py-libp2p's CPU cost (~15-30 ms per "
                             "MB moved, both ends) well inside 2 shared cores")
    parser.add_argument("--shaping", choices=["auto", "netns", "inproc"], default="auto")
    parser.add_argument("--prefix", default="echb", help="netem name prefix")
    parser.add_argument("--sysctl", nargs="*", default=[], help="key=value set in every netns")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the agents at this nice level (negative needs root): on a "
                             "machine shared with busy jobs, the agents otherwise wait for a "
                             "core far longer than they run (see runq-wait/cpu)")
    parser.add_argument("--shaper", choices=netem.SHAPERS, default="htb-fq",
                        help="htb-fq: rate + ACK priority + a FIFO per peer, served round-robin "
                             "(a router with per-flow fair queueing); htb: one shared bulk "
                             "FIFO (drop-tail); tbf: plain token bucket")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="relays cap their own push upload at this fraction of their link's "
                             "uplink (RelayConfig.upload_limit_bps; 0: no cap)")
    parser.add_argument("--stall-timeout", type=float, default=RelayConfig.stall_timeout_s,
                        help="seconds without data before a child pulls around its parent "
                             "(raise it on a machine shared with busy jobs)")
    parser.add_argument("--per-node", action="store_true",
                        help="print each node's finish time, children and push rate")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the agents' logs (INFO level) and stores")
    parser.add_argument("--queue-ms", type=float, default=100.0, help="htb bulk queue length")
    parser.add_argument("--gso-kb", type=int, default=16, help="veth GSO packet cap")


def main() -> None:
    if "--agent" in sys.argv[1:]:
        agent_entry(sys.argv[1:])
        return
    args = parse_args(__doc__.splitlines()[0], setup=_setup)
    if args.nodes is None:
        args.nodes = [4, 8] if args.quick else [4, 8, 16]
    if args.sizes is None:
        args.sizes = [3] if args.quick else [16, 64, 256]
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    shaping = args.shaping
    if shaping in ("auto", "netns"):
        ok, why = netem.available()
        if ok:
            shaping = "netns"
        elif shaping == "netns":
            raise SystemExit(f"network namespaces unavailable: {why}")
        else:
            shaping = "inproc"
            say(f"*** network namespaces unavailable ({why}): FALLING BACK TO IN-PROCESS "
                "SHAPING (push upload token buckets on loopback; downloads and pulls unshaped)")
    if shaping == "netns":
        say(f"shaping: one network namespace per host, {args.shaper} on both veth ends "
            f"(source up {SOURCE_UP_MBPS * args.scale:g} MB/s, node uplinks "
            f"{min(UPLOADS_MBPS) * args.scale:g}-{max(UPLOADS_MBPS) * args.scale:g} MB/s, "
            f"downlinks {DOWN_MBPS * args.scale:g} MB/s); "
            + ("no added latency (this kernel lacks sch_netem)" if not netem.netem_supported()
               else "no added latency"))
    chunks = f"{args.chunk_kb} KiB" if args.chunk_kb else "as the learner cuts them"
    say(f"chunks {chunks}; nodes {args.nodes}; sizes {args.sizes} MB; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before we start")
    result = trio.run(orchestrate, args, shaping)
    emit(result)


if __name__ == "__main__":
    main()
