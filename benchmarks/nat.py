"""Benchmark the swarm across NATs: direct connections per NAT kind, time-to-all with half the
nodes behind NAT against the same swarm all public, and the bytes relays carried.

The internet is :mod:`netem_nat`'s (network namespaces, iptables MASQUERADE routers). Half the N
nodes (the odd ones, so both halves mix fast and slow uplinks) sit behind home routers: two
behind one endpoint-independent (eim) router, two behind one symmetric (sym) router, the rest
alone behind routers of their own, eim and sym in turn.

1. **Direct connections.** A probe host (a real EchoHost: TCP + Noise + yamux; each host its
   own port, ``4002 + i``) in every namespace dials every other at the address it advertises
   (its own listen address: a LAN address behind NAT), 5 s per dial: a node behind NAT can dial
   out, nothing dials in, so a plain dial connects a pair when one side is public or both are
   behind one router. Then every pair whose two dials both failed punches a hole
   (:func:`echo.p2p.nat.holepunch.punch`: both sides, at one start time, dial each other's router
   WAN address and listen port from their own listen port; 10 s timeout; all pairs at once).
   A pair has a direct connection when either plain dial succeeded or both ends of its punch
   came up. Shares per pair kind (``public-public``, ``eim-public``, ``eim-eim``, ...), and
   ``direct_share_endpoint_independent``: pairs with both nodes behind eim routers;
   ``direct_share_symmetric``: both behind NAT, at least one sym; each also as ``..._no_punch``
   (plain dials only). ``punch_ok_by_pair`` counts the punches that worked per pair kind: a
   symmetric router (port-randomising) defeats every punch, as expected -- those pairs need a
   relay. With ``--quick`` (N = 8) the only eim-eim pair is the two nodes behind one router, so
   the eim share there says nothing about punching; N = 16 has five eim-eim pairs across
   routers. ``--direct-only`` stops after this part.
2. **Time-to-all.** :mod:`broadcast`'s agents and tree runs (``Bench``) at N nodes (16), with
   the planner's view of reachability (``echo.coordinator.dissemination.planner.reach.Reach``, as
   ``Dissemination`` plans): a node behind NAT is announced without addresses, dials its parents
   itself so they push over that connection, and relays only to public nodes, dialling them (no
   punched paths here: the agents do not punch). The same swarm with every host public is the
   baseline. Links are shaped by ``tc`` htb (one drop-tail FIFO per link, as netem_nat shapes);
   relays pace at ``--pace`` (0.92) of their uplink, which keeps that FIFO from overflowing.
   ``time_to_all_nat_vs_public`` = median NAT time / median public time.
3. **Bytes relays carried.** Circuit relays carry nothing (none is integrated), so
   ``relay_circuit_bytes`` is 0; the bytes nodes forwarded down the tree are split into public
   and NAT'd nodes.

Run (root): ``python benchmarks/nat.py [--quick] [--direct-only] [--swarm]``; ``--swarm`` also
runs ``tools/nat_swarm.py`` (6 nodes, 30 versions, ~1.5 min) and reports ``swarm_trained``,
``relayed_control_share`` (NAT'd nodes a stranger reached through a volunteer's relay alone) and
``swarm_circuits`` (circuits the coordinator's and the volunteers' relays opened).
4. **DCUtR with js-libp2p** (``--no-dcutr-js`` skips): ``dcutr_interop`` and
   ``dcutr_interop_one_router`` (:func:`echo.tools.dcutr_js.figures`, one trial each).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from broadcast import SOURCE, Bench, _setup, host_specs

import echo.tools.netem_nat as netem_nat
from echo.coordinator.dissemination.planner.best import best_plan
from echo.coordinator.dissemination.planner.plan import TreePlan
from echo.coordinator.dissemination.planner.reach import Reach
from echo.tools.bench import emit, parse_args, say
from echo.tools.relay_agent import AgentProc
from echo.tools.relay_swarm import RelaySwarm

HERE = Path(__file__).resolve().parent

PROBE_PORT = 4002
DIAL_TIMEOUT_S = 5.0
# holepunch's default: both sides' SYNs cross within a second; a failing (symmetric) pair costs
# the whole timeout, so all punches run at once.
PUNCH_TIMEOUT_S = 10.0
# The punch start time is sent to probes already waiting on stdin: 2 s covers writing to all.
PUNCH_LEAD_S = 2.0
PUBLIC_SUBNET = "10.71.0.0/24"

# ============================================================================== the internet


def nat_layout(n: int) -> tuple[list[netem_nat.RouterSpec], dict[str, str]]:
    """Routers, and the router of each node behind NAT (``n01``, ``n03``, ...): two behind one
    eim router, two behind one sym router, then one each behind eim and sym routers in turn."""
    routers: list[netem_nat.RouterSpec] = []
    router_of: dict[str, str] = {}
    for j, name in enumerate(f"n{i:02d}" for i in range(1, n, 2)):
        if j in (0, 2):
            routers.append(netem_nat.RouterSpec(f"r{len(routers)}", "eim" if j == 0 else "sym"))
        elif j >= 4:
            routers.append(netem_nat.RouterSpec(f"r{len(routers)}", "eim" if j % 2 == 0 else "sym"))
        router_of[name] = routers[-1].name
    return routers, router_of


# ======================================================================= direct connections

PROBE = """
import json, sys, time, trio
from echo.p2p.nat.holepunch import HolePunchFailed, punch
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
async def main():
    async with open_host(Identity.generate(), [sys.argv[1]], pubsub=False) as h:
        print(json.dumps({"peer": str(h.peer_id), "addrs": h.listen_multiaddrs}), flush=True)
        targets = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        ok = {}
        async def one(name, addr):
            try:
                with trio.fail_after(float(sys.argv[2]) + 1):
                    await h.connect(addr, timeout=float(sys.argv[2]))
                ok[name] = True
            except Exception:
                ok[name] = False
        async with trio.open_nursery() as n:
            for name, addr in targets.items():
                n.start_soon(one, name, addr)
        print(json.dumps(ok), flush=True)
        # Part 2: punches, all at one start time: {name: [peer id, public addr, start_at]}.
        jobs = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        punched = {}
        async def hole(name, peer, addr, start_at):
            try:
                got = await punch(h, peer, addr, start_at=start_at, timeout=float(sys.argv[3]))
                punched[name] = {"ok": True, "s": round(got.elapsed_s, 3), "via": got.via}
            except HolePunchFailed as exc:
                punched[name] = {"ok": False, "error": str(exc)[:200]}
        async with trio.open_nursery() as n:
            for name, job in jobs.items():
                n.start_soon(hole, name, *job)
        print(json.dumps(punched), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # stay dialable until told
trio.run(main)
"""


def pair_kind(a: str, b: str) -> str:
    return "-".join(sorted((a, b)))


def _send(proc: subprocess.Popen, obj: Any) -> None:
    proc.stdin.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]


def _read(proc: subprocess.Popen, what: str) -> Any:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"a probe died before reporting {what}")
    return json.loads(line)


def probe_direct(prefix: str, inet: netem_nat.Internet, names: list[str]) -> dict[str, Any]:
    """Every host dials every other at its advertised address; then the pairs where both dials
    failed punch (both sides at once, to each other's public address); the direct share per
    pair kind, with and without punching."""
    # Each host its own port: two hosts behind one router with the same listen port could not
    # both punch to one peer (their public address would be the same ip:port).
    port = {x: PROBE_PORT + i for i, x in enumerate(names)}
    procs = {
        x: subprocess.Popen(
            netem_nat.exec_argv(
                x,
                [
                    sys.executable,
                    "-c",
                    PROBE,
                    f"/ip4/{inet.hosts[x].ip}/tcp/{port[x]}",
                    str(DIAL_TIMEOUT_S),
                    str(PUNCH_TIMEOUT_S),
                ],
                prefix,
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for x in names
    }
    try:
        ready = {x: _read(p, "its address") for x, p in procs.items()}
        for x, p in procs.items():
            _send(p, {y: r["addrs"][0] for y, r in ready.items() if y != x})
        dialled = {x: _read(p, "its dials") for x, p in procs.items()}
        to_punch = [
            (a, b)
            for a, b in itertools.combinations(names, 2)
            if not (dialled[a][b] or dialled[b][a])
        ]
        # Every child is already waiting on stdin: a short lead covers sending to all of them.
        start_at = time.time() + PUNCH_LEAD_S
        jobs: dict[str, dict[str, list[Any]]] = {x: {} for x in names}
        for a, b in to_punch:
            for x, y in ((a, b), (b, a)):
                public = f"/ip4/{inet.hosts[y].public_ip}/tcp/{port[y]}"
                jobs[x][y] = [ready[y]["peer"], public, start_at]
        for x, p in procs.items():
            _send(p, jobs[x])
        punched = {x: _read(p, "its punches") for x, p in procs.items()}
    finally:
        for p in procs.values():
            with contextlib.suppress(OSError):
                _send(p, "quit")
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    kind = {x: inet.hosts[x].nat for x in names}

    def share(xs: list[bool]) -> float | None:
        return round(sum(xs) / len(xs), 3) if xs else None

    result: dict[str, Any] = {}
    punch_s: list[float] = []
    for with_punch in (True, False):
        by_kind: dict[str, list[bool]] = {}
        eim_pairs: list[bool] = []
        sym_pairs: list[bool] = []
        same_router: list[bool] = []
        for a, b in itertools.combinations(names, 2):
            direct = dialled[a][b] or dialled[b][a]
            if with_punch and not direct:
                # A punched connection counts when both ends have it upgraded.
                pa, pb = punched[a][b], punched[b][a]
                direct = pa["ok"] and pb["ok"]
                if direct:
                    punch_s.append(max(pa["s"], pb["s"]))
            by_kind.setdefault(pair_kind(kind[a], kind[b]), []).append(direct)
            if kind[a] == kind[b] == "eim":
                eim_pairs.append(direct)
            if "public" not in (kind[a], kind[b]) and "sym" in (kind[a], kind[b]):
                sym_pairs.append(direct)
            if inet.hosts[a].router and inet.hosts[a].router == inet.hosts[b].router:
                same_router.append(direct)
        tail = "" if with_punch else "_no_punch"
        result.update(
            {
                f"direct_share_by_pair{tail}": {k: share(v) for k, v in sorted(by_kind.items())},
                f"direct_share_endpoint_independent{tail}": share(eim_pairs),
                f"direct_share_symmetric{tail}": share(sym_pairs),
                f"direct_share_same_router{tail}": share(same_router),
                f"direct_share_all{tail}": share([d for v in by_kind.values() for d in v]),
            }
        )
        if with_punch:
            result["pairs_by_kind"] = {k: len(v) for k, v in sorted(by_kind.items())}
    one_sided = sum(punched[a][b]["ok"] != punched[b][a]["ok"] for a, b in to_punch)
    result.update(
        {
            "punch_pairs": len(to_punch),
            "punch_ok_by_pair": {
                k: f"{sum(v)}/{len(v)}"
                for k, v in sorted(
                    _group(
                        (pair_kind(kind[a], kind[b]), punched[a][b]["ok"] and punched[b][a]["ok"])
                        for a, b in to_punch
                    ).items()
                )
            },
            "punch_one_sided": one_sided,
            "punch_time_s_median": round(statistics.median(punch_s), 3) if punch_s else None,
            "punch_timeout_s": PUNCH_TIMEOUT_S,
        }
    )
    return result


def _group(items: Any) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {}
    for k, v in items:
        out.setdefault(k, []).append(v)
    return out


# ============================================================================ time-to-all


class NatSwarm(RelaySwarm):
    """:class:`~echo.tools.relay_swarm.RelaySwarm` in netem_nat's internet: hosts in
    ``router_of`` sit behind those routers, have no address in the routes and dial their
    parents; public hosts are dialled by their parents."""

    def __init__(
        self,
        *args: Any,
        routers: list[netem_nat.RouterSpec],
        router_of: dict[str, str],
        **kwargs: Any,
    ) -> None:
        kwargs.pop("netem_opts", None)  # netem_nat shapes its own links
        super().__init__(*args, **kwargs)
        self.routers = routers
        self.router_of = router_of
        self.inet: netem_nat.Internet | None = None

    def build_network(self, specs: list[Any]) -> dict[str, str]:
        hosts = [
            netem_nat.NatHostSpec(s.name, self.router_of.get(s.name, ""), s.up_bps, s.down_bps)
            for s in specs
        ]
        self.inet = netem_nat.up(
            self.routers, hosts, prefix=self.prefix, public_subnet=PUBLIC_SUBNET, quiet=True
        )
        return {h.name: h.ip for h in self.inet.hosts.values()}

    def in_host(self, name: str, argv: list[str]) -> list[str]:
        return netem_nat.exec_argv(name, argv, self.prefix)

    def behind(self) -> set[str]:
        """The peer ids of the agents behind NAT."""
        return {self.agents[x].peer_id for x in self.router_of if x in self.agents}

    def plan_addrs(self) -> dict[str, list[str]]:
        behind = self.behind()
        return {a.peer_id: [] if a.peer_id in behind else a.addrs for a in self.agents.values()}

    async def connect_plan(
        self, plan: TreePlan, agents: list[AgentProc], addrs: dict[str, list[str]]
    ) -> None:
        """Parents dial children they can reach; a node behind NAT dials its parents (as
        ``Peers.reach_out`` does when it joins a plan)."""
        every = {a.peer_id: a.addrs for a in self.agents.values()}
        dials: dict[str, set[str]] = {a.peer_id: set() for a in agents}
        for a in agents:
            for stripe in plan.children_of(a.peer_id):
                for c in stripe:
                    if addrs[c]:
                        dials[a.peer_id].add(every[c][0])
                    else:
                        dials[c].add(every[a.peer_id][0])
        for a in agents:
            await a.send(cmd="connect", addrs=sorted(dials[a.peer_id]))
        for a in agents:
            await a.expect("connected", 120.0)

    def remove(self) -> None:
        netem_nat.down(self.prefix, quiet=True)
        super().remove()


class NatBench(Bench):
    """:class:`broadcast.Bench` over a :class:`NatSwarm`: nodes behind NAT are planned as
    leaves that relay only to public nodes (the planner's :class:`Reach`, as
    ``Dissemination`` plans)."""

    def __init__(
        self,
        args: argparse.Namespace,
        routers: list[netem_nat.RouterSpec],
        router_of: dict[str, str],
    ) -> None:
        super().__init__(args, "netns", NatSwarm, routers=routers, router_of=router_of)

    def plan(self, kind: str, n: int, size: int) -> TreePlan:
        names = [f"n{i:02d}" for i in range(n)]
        ups = {self.agents[x].peer_id: self.ups[x] for x in names}
        downs = {self.agents[x].peer_id: self.downs[x] for x in names}
        return best_plan(
            self.agents[SOURCE].peer_id,
            self.ups[SOURCE],
            ups,
            total_bytes=size,
            chunk_bytes=self.chunk_bytes(size),
            downs=downs,
            reach=Reach(frozenset(self.swarm.behind())),
        )


async def time_to_all(
    args: argparse.Namespace, routers: list, router_of: dict[str, str]
) -> list[dict[str, Any]]:
    """``args.repeats`` tree runs at N = ``args.n``, ``args.size_mb`` MB, in one internet."""
    bench = NatBench(args, routers, router_of)
    rows: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            try:
                await bench.swarm.start(nursery, host_specs(args.n, args.scale))
                for _ in range(args.repeats):
                    row = await bench.one_run("tree", args.n, int(args.size_mb * 1e6))
                    pushed = row.pop("pushed_out_bytes")
                    row["relayed_bytes_public"] = sum(
                        v for k, v in pushed.items() if k not in router_of
                    )
                    row["relayed_bytes_nat"] = sum(v for k, v in pushed.items() if k in router_of)
                    rows.append(row)
            finally:
                with trio.CancelScope(shield=True):
                    await bench.swarm.shutdown()
                nursery.cancel_scope.cancel()
    finally:
        bench.swarm.remove()
    return rows


# ============================================================================== the driver


def run_swarm() -> dict[str, Any]:
    """tools/nat_swarm.py at its defaults; whether it trained, and its figures."""
    out = Path(tempfile.mkdtemp(prefix="echo-natswarm-"))
    proc = subprocess.run(
        [sys.executable, "-m", "echo.tools.nat_swarm", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    say(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:])
    summary_path = out / "summary.json"
    if not summary_path.exists():
        return {"swarm_trained": False}
    s = json.loads(summary_path.read_text())
    return {
        "swarm_trained": proc.returncode == 0,
        "swarm_versions": s["versions"],
        "swarm_wall_s": round(s["wall_s"], 1),
        "swarm_accepted_by_nat": {
            k: sum(h["accepted"] for h in s["hosts"].values() if h["nat"] == k)
            for k in ("public", "eim", "sym")
        },
        "swarm_time_to_all_s_median": s["time_to_all_s_median"],
        # Issue 32: the share of NAT'd nodes a stranger reached through a volunteer's relay
        # alone (never the coordinator's), and the circuits the relays opened during the run.
        "relayed_control_share": s.get("relayed_control_share"),
        "swarm_circuits": s.get("circuits"),
    }


def _extra(parser: argparse.ArgumentParser) -> None:
    _setup(parser)
    parser.add_argument("--n", type=int, default=None, help="nodes (default 16; --quick 8)")
    parser.add_argument("--size-mb", type=float, default=None, help="payload (16; --quick 4)")
    parser.add_argument("--repeats", type=int, default=3, help="tree runs per configuration")
    parser.add_argument("--swarm", action="store_true", help="also run tools/nat_swarm.py")
    parser.add_argument(
        "--no-dcutr-js", action="store_true", help="leave out the js-libp2p DCUtR interop runs"
    )
    parser.add_argument(
        "--direct-only", action="store_true", help="only part 1 (direct connections, punching)"
    )
    parser.add_argument(
        "--time-only", action="store_true", help="only part 2 (time-to-all), a smoke run"
    )
    parser.set_defaults(prefix="ecb", pace=0.92)


def direct_connections(
    args: argparse.Namespace, routers: list, router_of: dict[str, str], names: list[str]
) -> dict[str, Any]:
    """Part 1 (direct connections, punching) and the js-libp2p interop runs."""
    t0 = time.monotonic()
    inet = netem_nat.up(
        routers,
        [netem_nat.NatHostSpec(x, router_of.get(x, "")) for x in names],
        prefix=args.prefix,
        public_subnet=PUBLIC_SUBNET,
        quiet=True,
    )
    try:
        result: dict[str, Any] = probe_direct(args.prefix, inet, names)
    finally:
        netem_nat.down(args.prefix, quiet=True)
    say(
        f"direct connections ({time.monotonic() - t0:.0f} s): {result['direct_share_by_pair']}"
        f" (without punching: {result['direct_share_by_pair_no_punch']}); punches that worked"
        f" per pair kind: {result['punch_ok_by_pair']}"
    )
    if not args.no_dcutr_js:
        from echo.tools import dcutr_js

        result.update(dcutr_js.figures(trials=1))
        say(f"DCUtR with js-libp2p: {dcutr_js.summary(result)}")
    return result


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], setup=_extra)
    args.n = args.n or (8 if args.quick else 16)
    args.size_mb = args.size_mb or (4.0 if args.quick else 16.0)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    ok, why = netem_nat.available()
    if not ok:
        raise SystemExit(f"the emulated internet is unavailable here: {why}")
    routers, router_of = nat_layout(args.n)
    names = [SOURCE] + [f"n{i:02d}" for i in range(args.n)]
    say(
        f"N={args.n}, {len(router_of)} behind NAT, {args.size_mb:g} MB, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    result: dict[str, Any] = {}
    if not args.time_only:
        result.update(direct_connections(args, routers, router_of, names))
    if args.direct_only:
        result.update({"n": args.n, "behind_nat": len(router_of)})
        emit(result)
        return
    public_rows = trio.run(time_to_all, args, [], {})
    nat_rows = trio.run(time_to_all, args, routers, router_of)
    t_pub = statistics.median(r["time_s"] for r in public_rows)
    t_nat = statistics.median(r["time_s"] for r in nat_rows)
    result.update(
        {
            "n": args.n,
            "size_mb": args.size_mb,
            "behind_nat": len(router_of),
            "shaper": "htb",
            "pace": args.pace,
            "time_to_all_public_s": round(t_pub, 3),
            "time_to_all_nat_s": round(t_nat, 3),
            "time_to_all_nat_vs_public": round(t_nat / t_pub, 3),
            "relay_circuit_bytes": 0,
            "relayed_bytes_public_nodes": statistics.median(
                r["relayed_bytes_public"] for r in nat_rows
            ),
            "relayed_bytes_nat_nodes": statistics.median(r["relayed_bytes_nat"] for r in nat_rows),
            "runs": {"public": public_rows, "nat": nat_rows},
        }
    )
    say(f"time-to-all: public {t_pub:.2f} s, half behind NAT {t_nat:.2f} s (x{t_nat / t_pub:.2f})")
    if args.swarm:
        result.update(run_swarm())
    emit(result)


if __name__ == "__main__":
    main()
