"""Attacks against a live swarm (issue 13, "Measure it"): honest throughput with and without.

A local swarm (scripts/local_swarm.py: coordinator, learner and honest nodes, each its own
process on loopback) trains a small job. For one phase nobody attacks; for the next, these
attackers run beside it, each a real process (scripts/attackers.py):

- 16 fresh identities hoarding leases;
- 8 streams of junk submissions from unregistered peers;
- a chunk leecher (on the learner and every honest node);
- a relay that lies about its upload (a real node claiming 100 GB/s, relaying at 20 kB/s);
- a gossip spammer on the versions topic (to every honest node).

Printed per phase: versions per minute (the honest swarm's throughput), the coordinator's and
the learner's CPU (psutil, % of one core), and the honest nodes' lease round trip p50/p99
(timed inside the real node: benchmarks/_timed_node.py). The JSON line carries
``honest_ratio_under_attack`` (versions/min under attack over unattacked; the goal is >= 0.8).

The attackers run at ``nice 19``: on the internet they use their own machines, and here they
share this one's cores with the swarm; without it the figure would measure the CPU they take
from the learner rather than what they cost the coordinator. ``--quick``: 2 nodes and 40 s
phases; the default is 3 nodes and 180 s phases.
"""

from __future__ import annotations

import json
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

    def __init__(self, out: Path, nodes: int) -> None:
        self.out, self.swarm = out, Swarm(out)
        self.times_dir = out / "lease_times"
        self.times_dir.mkdir(parents=True, exist_ok=True)
        self.swarm.env["ECHO_LEASE_TIMES_DIR"] = str(self.times_dir)
        self.swarm.start_coordinator()
        self.coord = psutil.Process(self.swarm.procs[0].pid)
        self.job_id = self.swarm.submit(
            job_toml(
                "attack", steps=100000, group_size=8, batch_groups=4, warmup=5, eval_every=0
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
                ],
                module=["benchmarks._timed_node", "join"],
            )
        self.attackers: list[subprocess.Popen] = []

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
        for kind in kinds:
            cmd = [
                "nice",
                "-n",
                "19",
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
            if kind == "liar":
                cmd += ["--data-dir", str(self.out / "liar")]
            if kind in ("leech", "gossip"):
                for addr in self.node_addrs:
                    cmd += ["--peer", addr]
            with open(self.out / f"attack-{kind}.log", "wb") as log:  # the child keeps it
                self.attackers.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
                    )
                )

    def attacker_stats(self) -> dict:
        out = {}
        for path in sorted(self.out.glob("attack-*.json")):
            out[path.stem.removeprefix("attack-")] = json.loads(path.read_text())
        return out

    def stop(self) -> None:
        from local_swarm import stop

        stop(self.attackers)
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
        ),
    )
    nodes = args.nodes or (2 if args.quick else 3)
    phase_s = args.phase_s or (40.0 if args.quick else 180.0)
    out = new_run_dir(args.out) if args.out else Path(tempfile.mkdtemp(prefix="echo-attack-"))
    say(f"attack benchmark: {nodes} honest nodes, {phase_s:.0f} s per phase, logs in {out}")
    bench = Bench(out, nodes)
    try:
        deadline = time.time() + 180
        while bench.version() < 3:  # start-up and the warm-up steps are not measured
            if time.time() > deadline:
                raise SystemExit(f"the swarm did not reach v3 in 180 s; see {out}")
            time.sleep(1.0)
        calm = bench.phase("unattacked", phase_s)
        kinds = [k for k in args.attackers.split(",") if k]
        unknown = sorted(set(kinds) - set(ATTACKERS))
        if unknown:
            raise SystemExit(f"--attackers: unknown {unknown}; choose from {list(ATTACKERS)}")
        bench.start_attackers(kinds)
        time.sleep(10.0)  # the attackers start up (identities, the liar's engine)
        hit = bench.phase("under attack", phase_s)
        stats = bench.attacker_stats()
        dead = [k for k, p in zip(kinds, bench.attackers, strict=True) if p.poll() is not None]
    finally:
        bench.stop()
    for kind, st in stats.items():
        say(f"  {kind}: {json.dumps(st)}")
    if dead:
        say(f"attackers that exited early (see attack-*.log): {dead}")
    ratio = hit["versions_per_min"] / calm["versions_per_min"] if calm["versions_per_min"] else 0
    say(f"honest ratio under attack: {ratio:.2f} (goal >= 0.8)")
    emit(
        {
            "benchmark": "attack",
            "attacker_kinds": kinds,
            "quick": args.quick,
            "nodes": nodes,
            "phase_s": phase_s,
            "unattacked": calm,
            "under_attack": hit,
            "attackers": stats,
            "attackers_died": dead,
            "honest_ratio_under_attack": ratio,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
