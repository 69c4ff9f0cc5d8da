"""Attacks against a live swarm (issue 13, "Measure it"): honest throughput with and without.

A local swarm (scripts/local_swarm.py: coordinator, learner and honest nodes, each its own
process on loopback) trains a small job. Three phases: nobody attacks; these attackers run
beside the swarm, each a real process (scripts/attackers.py); nobody attacks again:

- 16 fresh identities hoarding leases;
- 8 streams of junk submissions from unregistered peers;
- a chunk leecher (on the learner and every honest node);
- a relay that lies about its upload (a real node claiming 100 GB/s, relaying at 20 kB/s);
- a gossip spammer on the versions topic (to every honest node).

Printed per phase: versions per minute (the honest swarm's throughput), the coordinator's and
the learner's CPU (psutil, % of one core), and the honest nodes' lease round trip p50/p99
(timed inside the real node: benchmarks/_timed_node.py). The JSON line carries
``honest_ratio_under_attack``: versions/min under attack over the mean of the two unattacked
phases (the goal is >= 0.8). The swarm's own pace drifts and wanders between phases (a run with
no attackers at all measured 0.87 against the first phase alone); the phase after the attack
brackets that, and ``recovery_after_attack`` (after over before) shows any damage that outlasts
the attackers.

Where the attackers stand: they dial from 127.0.0.2, which the coordinator counts as a network
of its own (``[admission] loopback_is_network``: budgets, a connection cap and a handshake rate
per address, as for a stranger's public /24), while the honest nodes and the learner stay on
127.0.0.1 (``--attacker-ip ''``: the attackers share 127.0.0.1, as if every identity had a
network of its own). On the internet they use their own machines; here they get cores of their
own (``--attacker-cores``, default 1 of this machine's: the swarm -- coordinator, learner, honest
nodes -- is pinned to the others in every phase), and run under SCHED_IDLE
(``--attacker-sched``) besides. Sharing the cores instead (``--attacker-cores 0``), five
processes that only spin slowed this 2-core swarm by ~30%: CPU taken, not damage done through the
protocol. ``--quick``: 2 nodes and 30 s phases; the default is 3 nodes and 180 s phases.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import emit, parse_args, say  # noqa: E402
from local_swarm import Swarm, job_toml, new_run_dir  # noqa: E402

from echo.p2p.identity import Identity  # noqa: E402

ATTACKERS = ("hoard", "junk", "leech", "liar", "gossip")
# Where the attackers dial from: one address, another network than the honest nodes' (an
# attacker with many identities but one machine, the case budgets per network prefix are for).
# ``--attacker-ip ""``: from 127.0.0.1 with the honest nodes, whose loopback is uncapped -- the
# case of an attacker with a network of its own for every identity.
ATTACKER_IP = "127.0.0.2"
LEECH_IP = "127.0.0.3"
# Between phases: the attackers start up (identities, the liar's engine) or wind down.
SETTLE_S = 10.0
# How the attacker processes share this machine's cores with the swarm. On the internet they run
# on their own machines, so what they should cost here is the work they make the coordinator and
# the nodes do, not CPU time taken from them. "idle" (SCHED_IDLE) runs an attacker only when no
# swarm process wants a core. Measured with all five (--quick, 2 cores): nice 19, ratio 0.35 and
# lease p50 14 -> 108 ms; SCHED_IDLE, 0.52 and 12 -> 59 ms. Neither removes the cost of sharing
# the cores: spinning SCHED_IDLE processes alone slow this swarm by ~30% (see the README).
ATTACKER_SCHED = {"idle": ["chrt", "--idle", "0"], "nice": ["nice", "-n", "19"], "none": []}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Bench:
    """The swarm under test and what is measured of it."""

    def __init__(
        self,
        out: Path,
        nodes: int,
        verbose_nodes: bool = False,
        attacker_sched: str = "idle",
        attacker_ip: str | None = ATTACKER_IP,
        attacker_cpus: set[int] | None = None,
    ) -> None:
        self.out, self.swarm = out, Swarm(out)
        # The swarm's processes inherit this process's cores; the attackers get theirs at start.
        self.attacker_cpus = attacker_cpus
        if attacker_cpus:
            os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - attacker_cpus)
        self.times_dir = out / "lease_times"
        self.times_dir.mkdir(parents=True, exist_ok=True)
        self.swarm.env["ECHO_LEASE_TIMES_DIR"] = str(self.times_dir)
        # Attackers dial from another loopback address, which the coordinator counts as a
        # network of its own (the honest nodes and the learner stay on 127.0.0.1).
        self.attacker_ip = attacker_ip
        self.swarm.start_coordinator(
            config_extra="\n[admission]\nloopback_is_network = true\n" if attacker_ip else ""
        )
        self.coord = psutil.Process(self.swarm.procs[0].pid)
        self.job_id = self.swarm.submit(
            # lr 1e-6: the policy stays where the warm-up left it, so the work per version (the
            # completions' lengths, what re-scoring and verification cost) does not drift
            # between phases as the model learns (at lr 1e-3 one run went 153 -> 220 versions/min
            # from its first unattacked phase to its last).
            job_toml(
                "attack",
                steps=100000,
                group_size=8,
                batch_groups=4,
                warmup=5,
                eval_every=0,
                lr=1e-6,
            )
        )
        self.node_addrs = []
        for i in range(nodes):
            data_dir, port = out / f"node-{i}", _free_port()
            data_dir.mkdir(parents=True, exist_ok=True)
            ident = Identity.load_or_create(data_dir / "identity.key")
            self.node_addrs.append(f"/ip4/127.0.0.1/tcp/{port}/p2p/{ident.peer_id_str}")
            self.swarm.start_node(
                f"node-{i}",
                [
                    "--threads",
                    "1",
                    "--leases-at-once",
                    "2",
                    "--engine",
                    "torch",
                    "--listen",
                    f"/ip4/127.0.0.1/tcp/{port}",
                    *(["--verbose"] if verbose_nodes else []),
                ],
                module=["benchmarks._timed_node", "join"],
            )
        self.attackers: list[subprocess.Popen] = []
        self.attacker_prefix = ATTACKER_SCHED[attacker_sched]

    def version(self) -> int:
        return int(self.swarm.status(self.job_id)[0]["current_version"])

    def learner(self) -> psutil.Process | None:
        for child in self.coord.children(recursive=True):
            if "echo.learner" in " ".join(child.cmdline()):
                return child
        return None

    def lease_times(self, since: float, until: float) -> list[float]:
        out = []
        for f in self.times_dir.glob("*.txt"):
            for line in f.read_text().splitlines():
                at, dt = line.split()
                if since <= float(at) <= until:
                    out.append(float(dt))
        return out

    def phase(self, name: str, seconds: float) -> dict:
        """Measure ``seconds`` of the swarm as it is now."""
        learner = self.learner()
        t0, v0 = time.time(), self.version()
        c0 = sum(self.coord.cpu_times()[:2])
        l0 = sum(learner.cpu_times()[:2]) if learner else 0.0
        time.sleep(seconds)
        t1, v1 = time.time(), self.version()
        c1 = sum(self.coord.cpu_times()[:2])
        l1 = sum(learner.cpu_times()[:2]) if learner and learner.is_running() else l0
        lat = self.lease_times(t0, t1)
        res = {
            "versions_per_min": (v1 - v0) * 60.0 / (t1 - t0),
            "coordinator_cpu_pct": 100.0 * (c1 - c0) / (t1 - t0),
            "learner_cpu_pct": 100.0 * (l1 - l0) / (t1 - t0),
            "lease_p50_ms": None if not lat else 1000 * _pct(lat, 0.5),
            "lease_p99_ms": None if not lat else 1000 * _pct(lat, 0.99),
            "lease_calls": len(lat),
        }
        say(
            f"{name}: v{v0} -> v{v1} in {t1 - t0:.0f} s = {res['versions_per_min']:.1f} "
            f"versions/min; coordinator CPU {res['coordinator_cpu_pct']:.0f}%, learner "
            f"{res['learner_cpu_pct']:.0f}%; lease p50 {res['lease_p50_ms'] or 0:.1f} ms, "
            f"p99 {res['lease_p99_ms'] or 0:.1f} ms ({len(lat)} calls)"
        )
        return res

    def start_attackers(self, kinds: list[str]) -> None:
        cpus = self.attacker_cpus
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
        for kind in kinds:
            cmd = [
                *pin,
                *self.attacker_prefix,
                sys.executable,
                str(ROOT / "scripts" / "attackers.py"),
                kind,
                "--coordinator",
                self.swarm.maddr,
                "--job",
                self.job_id,
                "--stats",
                str(self.out / f"attack-{kind}.json"),
            ]
            if self.attacker_ip:
                # The leecher from a network of its own: behind the same address as the junk
                # streams and hoarders it was refused by the coordinator's per-network handshake
                # rate for whole phases (82 refusals in one), which measured no leeching at all.
                ip = LEECH_IP if kind == "leech" and self.attacker_ip == ATTACKER_IP else None
                cmd += ["--source-ip", ip or self.attacker_ip]
            if kind == "liar":
                cmd += ["--data-dir", str(self.out / "liar")]
            if kind in ("leech", "gossip"):
                for addr in self.node_addrs:
                    cmd += ["--peer", addr]
            with open(self.out / f"attack-{kind}.log", "wb") as log:  # the child keeps it
                self.attackers.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )

    def attacker_stats(self) -> dict:
        out = {}
        for path in sorted(self.out.glob("attack-*.json")):
            out[path.stem.removeprefix("attack-")] = json.loads(path.read_text())
        return out

    def stop_attackers(self) -> None:
        from local_swarm import stop

        stop(self.attackers)

    def stop(self) -> None:
        self.stop_attackers()
        self.swarm.stop()


def main() -> int:
    args = parse_args(
        __doc__.splitlines()[0],
        setup=lambda p: (
            p.add_argument("--nodes", type=int, default=None),
            p.add_argument("--phase-s", type=float, default=None),
            p.add_argument(
                "--attackers",
                default=",".join(ATTACKERS),
                help="which attackers run (comma-separated; default: all)",
            ),
            p.add_argument("--out", type=Path, default=None),
            p.add_argument(
                "--attacker-sched",
                choices=sorted(ATTACKER_SCHED),
                default="idle",
                help="how the attackers share this machine's cores (default: idle, SCHED_IDLE)",
            ),
            p.add_argument(
                "--attacker-ip",
                default=ATTACKER_IP,
                help="the address attackers dial from ('' for 127.0.0.1, beside the honest nodes)",
            ),
            p.add_argument(
                "--attacker-cores",
                type=int,
                default=1 if len(os.sched_getaffinity(0)) >= 2 else 0,
                help="cores of this machine for the attackers alone, the swarm pinned to the "
                "rest (default 1 where there are 2 or more; 0: everyone shares every core)",
            ),
            p.add_argument(
                "--verbose-nodes",
                action="store_true",
                help="the honest nodes log at INFO (their waits for pushes, fetches, refusals)",
            ),
        ),
    )
    nodes = args.nodes or (2 if args.quick else 3)
    phase_s = args.phase_s or (30.0 if args.quick else 180.0)
    out = new_run_dir(args.out) if args.out else Path(tempfile.mkdtemp(prefix="echo-attack-"))
    say(f"attack benchmark: {nodes} honest nodes, {phase_s:.0f} s per phase, logs in {out}")
    cores = sorted(os.sched_getaffinity(0))
    if not 0 <= args.attacker_cores < len(cores):
        raise SystemExit(f"--attacker-cores: 0 to {len(cores) - 1} on this machine")
    attacker_cpus = set(cores[len(cores) - args.attacker_cores :]) if args.attacker_cores else None
    say(
        f"attackers on cores {sorted(attacker_cpus)}, the swarm on the others"
        if attacker_cpus
        else "attackers and swarm share every core"
    )
    bench = Bench(
        out, nodes, args.verbose_nodes, args.attacker_sched, args.attacker_ip or None, attacker_cpus
    )
    try:
        deadline = time.time() + 180
        while bench.version() < 3:  # start-up and the warm-up steps are not measured
            if time.time() > deadline:
                raise SystemExit(f"the swarm did not reach v3 in 180 s; see {out}")
            time.sleep(1.0)
        kinds = [k for k in args.attackers.split(",") if k]
        unknown = sorted(set(kinds) - set(ATTACKERS))
        if unknown:
            raise SystemExit(f"--attackers: unknown {unknown}; choose from {list(ATTACKERS)}")
        calm = bench.phase("unattacked", phase_s)
        bench.start_attackers(kinds)
        time.sleep(SETTLE_S)  # the attackers start up (identities, the liar's engine)
        hit = bench.phase("under attack", phase_s)
        dead = [k for k, p in zip(kinds, bench.attackers, strict=True) if p.poll() is not None]
        bench.stop_attackers()
        stats = bench.attacker_stats()
        time.sleep(SETTLE_S)
        after = bench.phase("unattacked again", phase_s)
    finally:
        bench.stop()
    for kind, st in stats.items():
        say(f"  {kind}: {json.dumps(st)}")
    if dead:
        say(f"attackers that exited early (see attack-*.log): {dead}")
    if after["versions_per_min"] == 0:
        # Not a ratio: the honest swarm stopped and did not come back (one run: every honest
        # node excluded for false verification failures). The logs in ``out`` say why. A swarm
        # stopped only under attack is a ratio of 0, below.
        say(f"the honest swarm stopped training (see {out}); no ratio")
        return 1
    base = (calm["versions_per_min"] + after["versions_per_min"]) / 2
    ratio = hit["versions_per_min"] / base if base else 0.0
    recovery = (
        after["versions_per_min"] / calm["versions_per_min"] if calm["versions_per_min"] else 0
    )
    say(
        f"honest ratio under attack: {ratio:.2f} of the unattacked phases' mean (goal >= 0.8); "
        f"after the attack the swarm ran at {recovery:.2f} of its first phase"
    )
    emit(
        {
            "benchmark": "attack",
            "attacker_kinds": kinds,
            "attacker_sched": args.attacker_sched,
            "attacker_ip": args.attacker_ip or "127.0.0.1",
            "attacker_cores": args.attacker_cores,
            "quick": args.quick,
            "nodes": nodes,
            "phase_s": phase_s,
            "unattacked": calm,
            "under_attack": hit,
            "unattacked_after": after,
            "attackers": stats,
            "attackers_died": dead,
            "honest_ratio_under_attack": ratio,
            "recovery_after_attack": recovery,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
