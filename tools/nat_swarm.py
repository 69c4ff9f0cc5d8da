#!/usr/bin/env python3
"""The whole Echo swarm across an emulated internet: coordinator and learner on a public host,
volunteer nodes on public hosts and behind home routers of both NAT kinds.

Builds the internet with :mod:`netem_nat` (prefix ``--prefix``): a public host ``coord``, public
hosts ``p0..``, and behind NAT ``e0, e1`` (two nodes behind one endpoint-independent router),
then alternately a node behind a symmetric router and one behind another eim router. Half the
nodes (rounded down) are behind NAT, or ``--nat`` of them (4 gives e0, e1, s2 and e3: a pair on
one LAN, a symmetric NAT, and two eim routers that a hole punch can cross). Then it runs itself
again inside ``coord``'s namespace (``--inside``: the coordinator's HTTP API listens on that
namespace's loopback), which drives the swarm as :mod:`local_swarm` does: coordinator, the tiny
demo job, nodes started with
``ip netns exec <host> echo-node join --listen /ip4/<its address>/tcp/4001``; polls until the job
is done and every node holds the final version, and writes ``OUT/summary.json``:
local_swarm's summary plus ``hosts`` (each node's NAT kind, router, address, peer id, groups
accepted, version), ``verdicts`` (the coordinator's dial-back verdict per node, from its log),
``punches`` (each pair the coordinator asked to connect directly, and whether both ends did)
and ``direct_chunks`` (per receiving node and sender behind NAT: the versions and chunks pushed
to it over such a punched or LAN path, from the node's log), ``reservations`` (per node, what
it said of the coordinator's circuit relay: a reservation held there, refused, or not needed
because the coordinator dials it directly; from its log) and ``relay`` (the coordinator's relay
figures: most reservations held at once, circuits, bytes relayed; from its log).

Needs root, iproute2 and iptables (``netem_nat.available()``). Exit status 0 when the job
finished and every node reached its final version. Owns the internet it builds (removed on the
way out, also after a failure) and the processes it starts.

Run: ``sudo .venv/bin/python -m echo.tools.nat_swarm --out /tmp/nat-swarm [--nodes 6 --steps 30]``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import echo.tools.netem_nat as netem_nat
from echo.node.relay_slots import SETTLE_S
from echo.tools.processes import exit_on_sigterm
from echo.tools.slow_dial import slow_first_dials
from echo.tools.swarm import HEADS, Swarm, job_toml
from echo.tools.swarm_report import summarize

PORT = 4001
COORD = "coord"
# How long after the job the nodes behind NAT get to take a volunteer's reservation: a node
# picks SETTLE_S after the first plan naming one, then reserves in well under a second.
VOLUNTEER_WAIT_S = SETTLE_S + 10.0
MAX_NODES = 40  # the public /24 and one LAN per router hold far more; the machine does not


def layout(
    n_nodes: int, n_nat: int | None = None
) -> tuple[list[netem_nat.RouterSpec], list[netem_nat.NatHostSpec]]:
    """Routers and hosts for ``n_nodes`` nodes, ``n_nat`` of them (default: half, rounded down)
    behind NAT: the first two behind one eim router, the rest alternately behind a sym and an
    eim router of their own.

    :raises ValueError: fewer than 2 or more than :data:`MAX_NODES` nodes, or ``n_nat`` not
        within 0..n_nodes.
    """
    if not 2 <= n_nodes <= MAX_NODES:
        raise ValueError(f"nodes must be 2..{MAX_NODES}, not {n_nodes}")
    n_nat = n_nodes // 2 if n_nat is None else n_nat
    if not 0 <= n_nat <= n_nodes:
        raise ValueError(f"nat must be 0..{n_nodes}, not {n_nat}")
    routers = [netem_nat.RouterSpec("r0", "eim")] if n_nat else []
    hosts = [netem_nat.NatHostSpec(COORD)]
    hosts += [netem_nat.NatHostSpec(f"p{i}") for i in range(n_nodes - n_nat)]
    for j in range(n_nat):
        if j < 2:
            hosts.append(netem_nat.NatHostSpec(f"e{j}", "r0"))
            continue
        kind = "sym" if j % 2 == 0 else "eim"
        routers.append(netem_nat.RouterSpec(f"r{j - 1}", kind))
        hosts.append(netem_nat.NatHostSpec(f"{kind[0]}{j}", f"r{j - 1}"))
    return routers, hosts


def coordinator_verdicts(log_text: str) -> dict[str, str]:
    """The coordinator's dial-back verdict per node (the last 8 characters of its peer id), as
    coordinator/dissemination/dialbacks.py logs it: ``node XXXXXXXX can be dialled (public,
    ...)``."""
    out: dict[str, str] = {}
    for m in re.finditer(r"node (\S{8}) (?:can|cannot) be dialled[^(]*\((\w+)", log_text):
        out[m.group(1)] = m.group(2)
    return out


def coordinator_punches(log_text: str) -> list[dict]:
    """Each pair the coordinator asked to connect, as coordinator/dissemination/punching.py logs it:
    ``punched XXXXXXXX <-> YYYYYYYY (punch): ok via dial/dial in 0.05/0.06 s`` or ``: failed``."""
    out = []
    pat = r"punched (\S{8}) <-> (\S{8}) \((\w+)\): (ok|failed)(?: via (\S+) in (\S+) s)?"
    for m in re.finditer(pat, log_text):
        out.append(
            {"a": m.group(1), "b": m.group(2), "method": m.group(3), "ok": m.group(4) == "ok",
             "via": m.group(5) or "", "elapsed_s": m.group(6) or ""}
        )
    return out


def direct_chunks(log_text: str) -> dict[str, dict[str, int]]:
    """Per sender (last 8 characters of its peer id): how many versions and chunks it pushed to
    this node over a direct path, as node/policy.py tells the volunteer:
    ``v12: 40 chunks pushed by XXXXXXXX over a direct path (dial)``."""
    out: dict[str, dict[str, int]] = {}
    pat = r"v(\d+): (\d+) chunks pushed by (\S{8}) over a direct path \((\w+)\)"
    for m in re.finditer(pat, log_text):
        got = out.setdefault(m.group(3), {"versions": 0, "chunks": 0})
        got["versions"] += 1
        got["chunks"] += int(m.group(2))
    return out


def node_reservation(log_text: str) -> dict | None:
    """What a node said of the coordinator's relay (node/session.py ``keep_relay_slot``; the
    volunteer's console wraps long lines, hence ``\\s+``): ``{"held": True, "relay": <last 8 of
    the relay's id>, "reserved_in_s": s}``, ``{"held": False, "refused": <status>}``, ``{"held":
    False, "direct": <verdict>}``; None when it said nothing of it."""
    held = re.search(
        r"relay\s+reservation\s+held\s+on\s+the\s+coordinator\s+\((\S{8}),\s+in\s+([\d.]+)\s+s\)",
        log_text,
    )
    if held:
        return {"held": True, "relay": held.group(1), "reserved_in_s": float(held.group(2))}
    refused = re.search(
        r"relay\s+reservation\s+refused\s+by\s+the\s+coordinator:\s+(\w+)", log_text
    )
    if refused:
        return {"held": False, "refused": refused.group(1)}
    direct = re.search(r"reachable\s+directly\s+\((\w+)", log_text)
    if direct:
        return {"held": False, "direct": direct.group(1)}
    return None


def coordinator_relay(log_text: str) -> dict:
    """The coordinator's relay figures, as coordinator/service.py logs them when they change:
    ``relay: 4 reservations held, 0 circuits opened (0 cut at a limit), 0 bytes relayed, ...``
    -- the most reservations held at once, and the last line's counters."""
    pat = (
        r"relay: (\d+) reservations held, (\d+) circuits opened \((\d+) cut at a limit\), "
        r"(\d+) bytes relayed, refused (.*)"
    )
    out = {"max_reservations": 0, "circuits_opened": 0, "circuits_limited": 0,
           "bytes_relayed": 0, "refused": "none"}
    for m in re.finditer(pat, log_text):
        out["max_reservations"] = max(out["max_reservations"], int(m.group(1)))
        out.update(circuits_opened=int(m.group(2)), circuits_limited=int(m.group(3)),
                   bytes_relayed=int(m.group(4)), refused=m.group(5).strip())
    return out


def volunteer_reservation(log_text: str) -> str | None:
    """The volunteer a node behind NAT held a reservation on (the last 8 characters of its peer
    id), as node/relay_slots.py says it: ``relay reservation held on volunteer XXXXXXXX``."""
    held = re.search(r"relay\s+reservation\s+held\s+on\s+volunteer\s+(\S{8})", log_text)
    return held.group(1) if held else None


def wait_for_volunteer_reservations(out: Path, behind: list[str]) -> None:
    """Until every node in ``behind`` says it holds a volunteer's reservation (its log in
    ``out``), at most :data:`VOLUNTEER_WAIT_S`; whoever has none by then is reported as such."""
    deadline = time.monotonic() + VOLUNTEER_WAIT_S
    while time.monotonic() < deadline and not all(
        volunteer_reservation((out / f"{n}.log").read_text(errors="replace")) for n in behind
    ):
        time.sleep(0.5)


def volunteer_relay(log_text: str) -> dict | None:
    """A public node's relay figures, as node/relay_slots.py says them when they change
    (``volunteer relay: 2 reservations held, 1 circuits opened (0 cut at a limit), ...``): the
    most reservations held at once and the last counters; None when it offered no relay."""
    if not re.search(r"offering\s+a\s+circuit\s+relay", log_text):
        return None
    pat = (
        r"volunteer\s+relay:\s+(\d+)\s+reservations\s+held,\s+(\d+)\s+circuits\s+opened\s+"
        r"\((\d+)\s+cut\s+at\s+a\s+limit\),\s+(\d+)\s+bytes\s+relayed,\s+refused\s+.*?;\s+"
        r"(\d+)\s+peers\s+behind\s+NAT"
    )
    out = {"max_reservations": 0, "circuits_opened": 0, "circuits_limited": 0, "bytes_relayed": 0,
           "dcutr": 0}
    for m in re.finditer(pat, log_text):
        out["max_reservations"] = max(out["max_reservations"], int(m.group(1)))
        out.update(circuits_opened=int(m.group(2)), circuits_limited=int(m.group(3)),
                   bytes_relayed=int(m.group(4)), dcutr=int(m.group(5)))
    return out


def probe_volunteer_circuits(
    targets: dict[str, tuple[str, str]], timeout: float = 20.0
) -> dict[str, str]:
    """From a fresh host (a stranger to everyone), reach each node behind NAT through the
    volunteer it reserved on -- never through the coordinator's relay -- and ask it who it is
    (libp2p identify: a control message every host answers). ``targets``: name -> (the
    volunteer's address, the node's peer id). Returns name -> "ok" or why not."""
    import trio
    from libp2p.identity.identify.identify import ID as IDENTIFY

    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.p2p.nat.circuit import circuit_addr, dial_circuit

    out: dict[str, str] = {}

    async def one(host, name: str, relay: str, node: str) -> None:
        try:
            with trio.fail_after(timeout):
                pid = await dial_circuit(host, circuit_addr(relay, node), timeout=timeout)
                # identify: every host answers it, job or not (a node whose job ended no
                # longer serves have-maps).
                stream = await host.libp2p.new_stream(pid, [IDENTIFY])
                got = await stream.read(4096)
                await stream.close()
            out[name] = "ok" if got else "empty identify reply"
        except Exception as exc:  # noqa: BLE001 (reported per node)
            out[name] = f"{type(exc).__name__}: {exc}"[:200]

    async def main() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as host,
            trio.open_nursery() as nursery,
        ):
            for name, (relay, node) in targets.items():
                nursery.start_soon(one, host, name, relay, node)

    trio.run(main)
    return out


def _job_toml(steps: int) -> str:
    # job_toml fills in what this leaves out, so a key the template gains does not break it.
    return job_toml(
        "nat",
        steps=steps,
        group_size=8,
        batch_groups=8,
        staleness=2,
        anchor_every=10,
        dtype="float32",
        task="addition",
        max_operand=5,
        lr=1e-3,
        warmup=10,
        heads=HEADS,
        seed=0,
        eval_every=0,
    )


def inside(args: argparse.Namespace) -> int:
    """The driver, run in ``coord``'s namespace: the swarm from start to summary."""
    from echo.p2p.identity import Identity

    inet = netem_nat.load(args.prefix)
    if inet is None:
        print(f"nat_swarm: no internet with prefix {args.prefix!r}", file=sys.stderr)
        return 2
    out = args.out
    t0 = time.time()
    swarm = Swarm(out)
    nodes = [h for h in inet.hosts.values() if h.name != COORD]
    try:
        # The nodes are the operator's own, and the run is short: relays from their third
        # accepted group on. The default (24, sized against strangers: issue 26) would keep
        # most of them leaves for most of the run, and the learner would send to each.
        swarm.start_coordinator(
            listen=f"/ip4/{inet.hosts[COORD].ip}/tcp/{PORT}",
            config_extra="\n[verification]\nproven_groups = 3\n",
        )
        job_id = swarm.submit(_job_toml(args.steps))
        peer_of = {}
        for h in nodes:
            (out / h.name).mkdir(parents=True, exist_ok=True)
            # Made here so the summary can name each node's peer id (the node loads it).
            peer_of[h.name] = Identity.load_or_create(out / h.name / "identity.key").peer_id_str
            swarm.start_node(
                h.name,
                [
                    "--listen",
                    f"/ip4/{h.ip}/tcp/{PORT}",
                    "--threads",
                    "1",
                    "--keep-weights",
                    "--leases-at-once",
                    "4",
                    "--engine",
                    "torch",
                    *(["--verbose"] if args.verbose_nodes else []),
                ],
                wrap=netem_nat.exec_argv(h.name, [], args.prefix),
            )
        st: dict = {}
        listed: list[dict] = []
        while time.time() - t0 < args.timeout:
            st, listed = swarm.status(job_id)
            if st["status"] in ("done", "failed", "cancelled"):
                break
            dead = [p for p in swarm.procs if p.poll() is not None]
            if dead:
                print(f"nat_swarm: a process exited early ({dead[0].returncode})", file=sys.stderr)
                break
            time.sleep(1.0)
        if st.get("status") == "done":
            # Nodes learn the job is done on their next lease request and sync to the final
            # version (the learner serves it until nobody asks).
            deadline = time.time() + 90
            while time.time() < deadline:
                st, listed = swarm.status(job_id)
                if len(listed) == len(nodes) and all(
                    n["version"] >= st["current_version"] for n in listed
                ):
                    break
                time.sleep(0.5)
        summary = summarize(st, listed, time.time() - t0)
        by_id = {n["node_id"]: n for n in listed}
        summary["hosts"] = {
            h.name: {
                "nat": h.nat,
                "router": h.router,
                "ip": h.ip,
                "node_id": peer_of[h.name],
                "accepted": by_id.get(peer_of[h.name], {}).get("accepted", 0),
                "version": by_id.get(peer_of[h.name], {}).get("version"),
            }
            for h in nodes
        }
        coord_log = (out / "coordinator.log").read_text(errors="replace")
        verdicts = coordinator_verdicts(coord_log)
        summary["verdicts"] = {h.name: verdicts.get(peer_of[h.name][-8:]) for h in nodes}
        # Versions whose announced plan had NAT'd relays feed peers over punched or LAN paths
        # (the planner does so only where that shortens its estimate).
        summary["nat_relay_plans"] = len(
            re.findall(r"v\d+ plan: \d+ edge\(s\) from NAT'd relays", coord_log)
        )
        name_of = {pid[-8:]: name for name, pid in peer_of.items()}
        summary["punches"] = [
            {**p, "a": name_of.get(p["a"], p["a"]), "b": name_of.get(p["b"], p["b"])}
            for p in coordinator_punches((out / "coordinator.log").read_text(errors="replace"))
        ]
        summary["direct_chunks"] = {}
        for h in nodes:
            got = direct_chunks((out / f"{h.name}.log").read_text(errors="replace"))
            if got:
                summary["direct_chunks"][h.name] = {name_of.get(k, k): v for k, v in got.items()}
        coord_id = swarm.maddr.rsplit("/", 1)[-1]
        name_of[coord_id[-8:]] = COORD
        summary["reservations"] = {}
        for h in nodes:
            got = node_reservation((out / f"{h.name}.log").read_text(errors="replace"))
            if got is not None and "relay" in got:
                got["relay"] = name_of.get(got["relay"], got["relay"])
            summary["reservations"][h.name] = got
        summary["relay"] = coordinator_relay(
            (out / "coordinator.log").read_text(errors="replace")
        )
        # Relays among volunteers: who offered one, and where each node behind NAT reserved.
        # A node behind NAT picks its volunteer SETTLE_S after the first plan naming one: on a
        # quiet machine the job ended before that (30 versions in 29 s); the nodes run on.
        wait_for_volunteer_reservations(out, [h.name for h in nodes if h.router])
        summary["volunteer_relays"], summary["volunteer_reservations"] = {}, {}
        for h in nodes:
            text = (out / f"{h.name}.log").read_text(errors="replace")
            offered = volunteer_relay(text)
            if offered is not None:
                summary["volunteer_relays"][h.name] = offered
            held = volunteer_reservation(text)
            summary["volunteer_reservations"][h.name] = name_of.get(held, held) if held else None
        summary["circuits"] = summary["relay"]["circuits_opened"] + sum(
            v["circuits_opened"] for v in summary["volunteer_relays"].values()
        )
        summary["dcutr"] = sum(v["dcutr"] for v in summary["volunteer_relays"].values())
        # Reachable for control messages through a volunteer alone (the coordinator's relay
        # plays no part in these circuits), while the nodes still run.
        behind = [h for h in nodes if h.router]
        targets = {
            h.name: (f"/ip4/{inet.hosts[v].ip}/tcp/{PORT}/p2p/{peer_of[v]}", peer_of[h.name])
            for h in behind
            if (v := summary["volunteer_reservations"].get(h.name)) in inet.hosts
        }
        summary["volunteer_circuits"] = probe_volunteer_circuits(targets)
        summary["relayed_control_share"] = (
            sum(r == "ok" for r in summary["volunteer_circuits"].values()) / len(behind)
            if behind else None
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        final = summary["versions"]
        ok = summary["status"] == "done" and all(
            v["version"] == final for v in summary["hosts"].values()
        )
        print(
            f"nat_swarm: {summary['status']}, {final} versions, "
            f"{summary['rollouts_accepted']} groups accepted, {summary['wall_s']:.0f} s; "
            + ", ".join(
                f"{n} ({v['nat']}: {summary['verdicts'][n]}, v{v['version']}, {v['accepted']})"
                for n, v in summary["hosts"].items()
            )
            + "; punches: "
            + (", ".join(
                f"{p['a']}-{p['b']} {p['method']} {'ok' if p['ok'] else 'failed'}"
                for p in summary["punches"]
            ) or "none")
            + "; relay reservations: "
            + (", ".join(
                f"{n} on {r['relay']} ({r['reserved_in_s']:.2f} s)"
                for n, r in summary["reservations"].items() if r and r.get("held")
            ) or "none")
            + f" (coordinator's relay: at most {summary['relay']['max_reservations']} held, "
            + f"{summary['relay']['circuits_opened']} circuits, "
            + f"{summary['relay']['bytes_relayed']} bytes relayed)"
            + "; volunteer relays: "
            + (", ".join(
                f"{n} (at most {v['max_reservations']} held, {v['circuits_opened']} circuits)"
                for n, v in summary["volunteer_relays"].items()
            ) or "none")
            + "; reserved on volunteers: "
            + (", ".join(
                f"{n} on {r}" for n, r in summary["volunteer_reservations"].items() if r
            ) or "none")
            + f"; {summary['circuits']} circuits in all, {summary['dcutr']} DCUtR dial-backs"
            + f"; reached through a volunteer's relay alone: {summary['volunteer_circuits']}"
            + "; pushed over direct paths: "
            + (", ".join(
                f"{src}->{dst} {v['chunks']} chunks in {v['versions']} versions"
                for dst, by in summary["direct_chunks"].items()
                for src, v in by.items()
            ) or "none")
        )
        return 0 if ok else 1
    finally:
        swarm.stop()


def outside(args: argparse.Namespace) -> int:
    """Build the internet, run :func:`inside` in ``coord``'s namespace, tear everything down."""
    routers, hosts = layout(args.nodes, args.nat)
    args.out.mkdir(parents=True, exist_ok=True)
    netem_nat.up(routers, hosts, prefix=args.prefix, public_subnet=args.public_subnet, quiet=True)
    try:
        print(netem_nat.status(args.prefix), file=sys.stderr)
        if args.slow_first_dial:  # the circuit drill: see echo.tools.slow_dial
            inet = netem_nat.load(args.prefix)
            assert inet is not None
            public = [h.ip for h in inet.hosts.values() if not h.router and h.name != COORD]
            for name in inet.behind_nat():
                slow_first_dials(name, public, args.prefix)
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--inside",
            "--out",
            str(args.out),
            "--prefix",
            args.prefix,
            "--steps",
            str(args.steps),
            "--timeout",
            str(args.timeout),
            *(["--verbose-nodes"] if args.verbose_nodes else []),
        ]
        proc = subprocess.run(
            netem_nat.exec_argv(COORD, argv, args.prefix), timeout=args.timeout + 180
        )
        return proc.returncode
    finally:
        netem_nat.down(args.prefix, quiet=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--nat", type=int, default=None, help="nodes behind NAT (default: half)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=360.0, help="give up after this many s")
    ap.add_argument("--prefix", default="ecw", help="netem_nat name prefix")
    ap.add_argument("--public-subnet", default="10.72.0.0/24")
    ap.add_argument("--verbose-nodes", action="store_true", help="nodes log at DEBUG")
    ap.add_argument(
        "--slow-first-dial",
        action="store_true",
        help="nodes behind NAT dial each public node the first time 3-4 s late (circuit drill)",
    )
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    exit_on_sigterm()
    return inside(args) if args.inside else outside(args)


if __name__ == "__main__":
    sys.exit(main())
