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

The agent and its command protocol are :mod:`echo.tools.relay_agent`, the swarm of agents (network,
start, connections, stop) :mod:`echo.tools.relay_swarm`, the CPU figures
:mod:`echo.tools.cpu_meter`; this file holds the links, the run matrix, one run (plan, bound,
timing, check) and the report.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

import echo.tools.netem as netem
from echo.coordinator.dissemination.planner.best import best_plan, chain_plan, route_for, star_plan
from echo.coordinator.dissemination.planner.plan import TreePlan, lower_bound_s
from echo.p2p.chunkstore import chunk_size_for
from echo.p2p.relay import RelayConfig
from echo.protocol import broadcast as b
from echo.tools.bench import emit, parse_args, say
from echo.tools.cpu_meter import CpuMeter
from echo.tools.relay_agent import COMMAND_TIMEOUT_S, JOB, AgentProc, agent_entry
from echo.tools.relay_swarm import RelaySwarm

MB = 1e6
SOURCE = "src"
# Upload (MB/s) of node i: heterogeneous, and every prefix of the list is mixed.
UPLOADS_MBPS = [8, 2, 5, 1, 10, 3, 6, 1.5, 4, 2.5, 7, 1, 3.5, 9, 2, 5.5,
                3, 6, 2, 8, 1, 4, 5, 2.5, 3, 7, 1.2, 2, 6, 3.3, 4.4, 9]
SOURCE_UP_MBPS = 10.0
DOWN_MBPS = 25.0


def host_specs(n: int, scale: float) -> list[netem.HostSpec]:
    """The source and ``n`` nodes with their links (bytes/s), every rate times ``scale``."""
    specs = [netem.HostSpec(SOURCE, SOURCE_UP_MBPS * MB * scale, DOWN_MBPS * MB * scale)]
    for i in range(n):
        up = UPLOADS_MBPS[i % len(UPLOADS_MBPS)]
        specs.append(netem.HostSpec(f"n{i:02d}", up * MB * scale, DOWN_MBPS * MB * scale))
    return specs


class Bench:
    """The runs over one swarm: each publishes a fresh version and times it along one plan."""

    def __init__(self, args: argparse.Namespace, shaping: str,
                 swarm_type: type[RelaySwarm] = RelaySwarm, **swarm_kwargs: Any) -> None:
        """``swarm_type`` and ``swarm_kwargs``: another network under the same runs
        (benchmarks/nat.py: an internet with NAT routers)."""
        self.args = args
        self.shaping = shaping
        self.swarm = swarm_type(
            [sys.executable, str(Path(__file__).resolve()), "--agent"], shaping=shaping,
            source=SOURCE, prefix=args.prefix, nice=args.nice, keep_logs=args.keep_logs,
            netem_opts={"sysctls": args.sysctl, "shaper": args.shaper,
                        "queue_s": args.queue_ms / 1000, "gso_max": args.gso_kb * 1024},
            **swarm_kwargs)
        self.agents = self.swarm.agents
        self.ups = self.swarm.ups
        self.downs = self.swarm.downs
        self.version = 0

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
        """The source publishes a fresh version of ``size`` bytes and pushes it to nodes
        n00..n{n-1} along a ``kind`` plan; time until the last node holds it, against the bound
        and the planner's estimate, with every node's bytes checked (one row of the JSON)."""
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
        await self._configure(kind, names)
        max_sources = 32 if kind == "tree" else 0  # star and chain fall back on the source only
        await src.send(cmd="publish", version=v, size=size, chunk=chunk)
        pub = await src.expect("published", COMMAND_TIMEOUT_S)
        addrs = self.swarm.plan_addrs()
        await self.swarm.connect_plan(plan, [src, *nodes], addrs)
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
        ok = await self._verify(v, src, nodes) == {pub["sha"]}
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

    async def _configure(self, kind: str, names: list[str]) -> None:
        """Restart every relay of this run with its config for ``kind``."""
        # The relay's own stall timeout unless --stall-timeout says otherwise (on a machine shared
        # with busy jobs a starved, not dead, process can go quiet for many seconds). Star and
        # chain never cut a lagging child, and their nodes may only fall back on the source, so
        # they stay what they claim to be.
        cfg: dict[str, Any] = {"stall_timeout_s": self.args.stall_timeout,
                               "max_lag_chunks": 64 if kind == "tree" else 0}
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

    async def _verify(self, v: int, src: AgentProc, nodes: list[AgentProc]) -> set[str]:
        """The sha256 of version ``v`` as each node holds it ("" where incomplete); the source's
        store is pruned too."""
        shas = set()
        for a in nodes:
            await a.send(cmd="verify", version=v)
        for a in nodes:
            shas.add((await a.expect("verified", COMMAND_TIMEOUT_S))["sha"])
        await src.send(cmd="verify", version=v)
        await src.expect("verified", COMMAND_TIMEOUT_S)
        return shas

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
    specs = host_specs(max(args.nodes), args.scale)
    rows: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            try:
                t = time.monotonic()
                await bench.swarm.start(nursery, specs)
                say(f"{len(specs)} agents up in {time.monotonic() - t:.1f} s ({shaping} shaping)")
                for n, size, kinds in matrix(args):
                    for kind in kinds:
                        rows.append(await bench.one_run(kind, n, size))
            finally:
                with trio.CancelScope(shield=True):
                    await bench.swarm.shutdown()
                nursery.cancel_scope.cancel()
    finally:
        bench.swarm.remove()
        if args.keep_logs:
            say(f"agent logs and stores kept in {bench.swarm.workdir}")
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
