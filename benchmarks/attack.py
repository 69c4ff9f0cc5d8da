"""Attacks against a live swarm (issues 13 and 26, "Measure it"): honest work with and without.

A local swarm (tools/local_swarm.py: coordinator, learner and honest nodes, each its own
process on loopback) trains a small job. Three phases: nobody attacks; every attacker below
runs beside the swarm at once, each a real process (tools/attackers/); nobody attacks
again:

- ``hoard``: 16 fresh identities hoarding leases;
- ``junk``: 8 streams of junk submissions from unregistered peers;
- ``leech``: a chunk leecher (on the learner and every honest node); ``leech24``: 8 of them
  behind one address, one network;
- ``liar``: a relay that lies about its uplink (a real node claiming 100 GB/s at registration
  and in every status report, relaying at 20 kB/s);
- ``gossip``: a gossip spammer on the versions topic (to every honest node);
- ``churn``: new identities at 5/s, each registering, taking a lease it lets expire and sending
  one junk submission;
- ``bomb``: scorer bombs: registered identities that take leases and submit well-formed,
  correctly signed groups of hostile completions (code for ``eval`` and sympy's
  ``parse_expr``, power towers, deep nesting, the longest text a lease admits), encoded in the
  job's tokenizer so that the coordinator's scorers read exactly that text;
- ``stale``: stale-version hoarders, real nodes that earn a lease quota with honest groups and
  then answer each grant with one stale-version submission, holding the rest;
- ``demote``: registered identities filing bad-chunk reports against the honest relays.

The job (tools/attackers/job.py): by default ``gym:binary_matrix`` at 3x3, a reasoning-gym
task whose scorer ``eval()``\\ s the answer, with math-verify (sympy) as a second reward term,
so that every bomb goes through both kinds of hostile-input parser; ``--task addition`` is
issue 13's job. What is measured is the swarm's throughput in versions per minute.

Printed per phase: versions per minute (the honest swarm's throughput), every swarm part's CPU
(below), and the honest nodes' lease and submit round trips, p50/p99, timed inside the real
node around the coordinator's reply (tools/timed_node.py: the node's own pacing before a call
is not counted; a submit's round trip includes its verification and scoring). The JSON line
(the last printed) carries ``honest_ratio_under_attack``: versions/min under attack over the
mean of the two unattacked phases (goal >= 0.8), and ``rpc_p99_under_attack_vs_unattacked``:
the larger of the honest nodes' lease p99 and submit p99 under attack over the same p99 of both
unattacked phases together (goal <= 2). The swarm's pace drifts between phases with the
machine's other work; the phase after the attack brackets that, ``recovery_after_attack``
(after over before) shows damage that outlasts the attackers, and
``honest_ratio_per_free_core`` is the same ratio per core that other work left the swarm
(``versions_per_min_per_free_core``: the swarm's own work under attack stays in). Also in it:
``bomb_traces``, files the bombs' code payloads managed to write (anything but 0 is code run
outside the scoring sandbox), ``relays_demoted``, the coordinator's log lines demoting a relay,
and each attacker's own counters (what it sent, what it was answered).

Where the attackers stand (tools/attackers/launch.py says why): each kind dials from a 127.0.0.x
address of its own, which the coordinator counts as a network of its own; the churner from a new
address per identity (127.1.0.0/16); ``--attacker-ip ''`` puts every attacker on 127.0.0.1 with
the honest nodes, uncapped. The attackers get cores of their own (``--attacker-cores``, default
1 of this machine's: the swarm -- coordinator, learner, honest nodes -- is pinned to the others
in every phase) and run under SCHED_IDLE (``--attacker-sched``) besides: on the internet they
have machines of their own, so they cost the work they make the swarm do (in full), never CPU
taken from it; the attack phase's ``attackers_placement`` checks it (processes, SCHED_IDLE ones,
cores). Sharing the cores (``--attacker-cores 0``), 5 spinning processes slowed the swarm ~30%.
On one core the ten attackers slow each other too: their counters say what each managed
(``identities_per_s`` for the churner's reached rate). Each phase has every part's CPU in % of
a core (tools/swarm_probe.py): the coordinator's own, the learner's, the scoring sandbox's (its
zygote and its children), the honest nodes', the attackers', and ``others_on_swarm_cores_pct``,
what other work took of the swarm's cores; ``--profile``: py-spy on the swarm under attack.

The stale hoarders must earn their quota before they can hoard: they start first, alone, and
the other attackers once they all have turned (at most ``STALE_WAIT_S`` later; their counter
``turned`` says how many did). Until then they are honest nodes, beside the swarm's. The phase
after the attack starts once the leases that hoarders held have expired (``LEASE_TIMEOUT_S``).

``--quick``: 2 nodes and 20 s phases, about 4 minutes in all (start-up, the stale hoarders'
warm-up, the held leases' expiry included); else 3 nodes and 180 s phases. Only the first run of
a job spends the learner's format warm-up (about a minute; tools/attackers/job.py keeps it).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil

from echo.p2p.identity import Identity
from echo.tools import swarm_probe
from echo.tools.attackers.job import attack_job, keep_warmup, restore_warmup
from echo.tools.attackers.launch import ATTACKER_IP, ATTACKER_SCHED, Fleet
from echo.tools.attackers.window import window_held
from echo.tools.bench import emit, parse_args, say
from echo.tools.processes import exit_on_sigterm, new_run_dir
from echo.tools.swarm import Swarm
from echo.tools.timed_node import RPC_TIMES_ENV, TIMED_RPCS, grants, rpc_times

ATTACKERS = (
    "hoard",
    "junk",
    "leech",
    "leech24",
    "liar",
    "gossip",
    "churn",
    "bomb",
    "stale",
    "demote",
)
# Between phases: the attackers start up (identities, the real nodes' engines) or wind down.
SETTLE_S = {True: 8.0, False: 10.0}
# The longest the attack phase waits for the stale hoarders to earn their quota (a few honest
# groups each on the attackers' shared core), by --quick.
STALE_WAIT_S = {True: 60.0, False: 240.0}
# The longest the attack phase waits for every attacker process to begin its attack (its
# counters file appears): on the attackers' one core, behind other work on this machine, one
# quick run stopped its attackers while most were still importing libp2p.
ATTACKER_START_S = {True: 60.0, False: 120.0}
# The coordinator's ``[verification] lease_timeout_s`` (its default): leases that a stopped
# hoarder held stay out of the window until then, so the phase after the attack starts once
# they have expired (else it measures the attack's tail, not the swarm on its own).
LEASE_TIMEOUT_S = 30.0
# A relay demoted for bad-chunk reports (coordinator/dissemination/relays.py logs it).
DEMOTED_LINE = re.compile(r"relay \S+ reported .*planned as a leaf")


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
        task: str,
        verbose_nodes: bool = False,
        attacker_sched: str = "idle",
        attacker_ip: str | None = ATTACKER_IP,
        attacker_cpus: set[int] | None = None,
        config_extra: str = "",
        node_nice: int | None = None,
    ) -> None:
        self.out, self.swarm = out, Swarm(out)
        # The swarm's processes inherit this process's cores; the attackers get theirs at start.
        if attacker_cpus:
            os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - attacker_cpus)
        self.swarm_cores = os.sched_getaffinity(0)
        self.times_dir = out / "rpc_times"
        self.times_dir.mkdir(parents=True, exist_ok=True)
        self.swarm.env[RPC_TIMES_ENV] = str(self.times_dir)
        self.marker_dir = out / "bomb-traces"
        self.marker_dir.mkdir(exist_ok=True)
        # Attackers dial from other loopback addresses, which the coordinator counts as
        # networks of their own (the honest nodes and the learner stay on 127.0.0.1).
        admission = "\n[admission]\nloopback_is_network = true\n" if attacker_ip else ""
        self.cache = out / "coordinator" / "cache"
        restore_warmup(self.cache)
        self.swarm.start_coordinator(config_extra=admission + config_extra)
        self.coord = psutil.Process(self.swarm.procs[0].pid)
        try:
            self.job_id = self.swarm.submit(attack_job(task))
        except Exception as exc:  # the API's 400 names what it refused (say, a gym dataset)
            body = getattr(getattr(exc, "response", None), "text", "")
            self.swarm.stop()
            raise SystemExit(f"the coordinator refused the job: {exc} {body}") from None
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
                    *(["--nice", str(node_nice)] if node_nice is not None else []),
                ],
                module=["echo.tools.timed_node", "join"],
            )
        self.attackers = Fleet(
            out,
            self.swarm.maddr,
            self.job_id,
            self.node_addrs,
            self.marker_dir,
            attacker_sched,
            attacker_ip,
            attacker_cpus,
        )

    def version(self) -> int:
        return int(self.swarm.status(self.job_id)[0]["current_version"])

    def phase(self, name: str, seconds: float) -> dict:
        """Measure ``seconds`` of the swarm as it is now."""
        s0, t0, v0 = self.cpu(), time.time(), self.version()
        time.sleep(seconds)
        s1, t1, v1 = self.cpu(), time.time(), self.version()
        res: dict = {
            "window": [t0, t1],
            "versions_per_min": (v1 - v0) * 60.0 / (t1 - t0),
            **swarm_probe.cpu_pct(s0, s1),
        }
        # Per core that this machine's other work left the swarm (the swarm's own work, the
        # coordinator's answers to attackers included, stays in): the phases' drift with load.
        free = len(self.swarm_cores) - res["others_on_swarm_cores_pct"] / 100.0
        res["versions_per_min_per_free_core"] = res["versions_per_min"] / max(free, 0.01)
        res["leases_granted"], res["empty_lease_replies"] = grants(self.times_dir, (t0, t1))
        for rpc in TIMED_RPCS.values():
            lat = rpc_times(self.times_dir, rpc, [(t0, t1)])
            res[f"{rpc}_p50_ms"] = None if not lat else 1000 * _pct(lat, 0.5)
            res[f"{rpc}_p99_ms"] = None if not lat else 1000 * _pct(lat, 0.99)
            res[f"{rpc}_calls"] = len(lat)
        say(
            f"{name}: v{v0} -> v{v1} in {t1 - t0:.0f} s = {res['versions_per_min']:.1f} "
            f"versions/min; coordinator CPU {res['coordinator_cpu_pct']:.0f}% (waited for a "
            f"core {res['coordinator_runq_wait_pct']:.0f}%), learner "
            f"{res['learner_cpu_pct']:.0f}%, scoring {res['scoring_cpu_pct']:.0f}%, honest nodes "
            f"{res['honest_nodes_cpu_pct']:.0f}%, attackers {res['attackers_cpu_pct']:.0f}%, "
            f"others on the swarm's cores {res['others_on_swarm_cores_pct']:.0f}%; lease p50 "
            f"{_ms(res['lease_p50_ms'])}, p99 {_ms(res['lease_p99_ms'])} "
            f"({res['lease_calls']} calls); submit p50 {_ms(res['submit_p50_ms'])}, p99 "
            f"{_ms(res['submit_p99_ms'])} ({res['submit_calls']} calls); leases granted "
            f"{res['leases_granted']}, empty replies {res['empty_lease_replies']}"
        )
        return res

    def cpu(self) -> dict:
        nodes = [p.pid for p in self.swarm.procs[1:]]
        attackers = [p.pid for p in self.attackers.procs if p.poll() is None]
        return swarm_probe.cpu_snapshot(self.coord, nodes, attackers, self.swarm_cores)

    def profile(self, folder: Path) -> list:
        """py-spy on the coordinator, the learner and the honest nodes until
        :func:`swarm_probe.stop_profiles`, on the attackers' cores (see :mod:`.swarm_probe`)."""
        procs = [psutil.Process(p.pid) for p in self.swarm.procs if p.poll() is None]
        learner = swarm_probe.learner(self.coord)
        if learner is not None:
            procs.append(learner)
        return swarm_probe.start_profiles(procs, folder, self.attackers.cpus)

    def demotions(self) -> int:
        try:
            return len(DEMOTED_LINE.findall((self.out / "coordinator.log").read_text()))
        except OSError:
            return 0

    def stop(self) -> None:
        self.attackers.stop()
        self.swarm.stop()


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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
            p.add_argument(
                "--task",
                default="gym:binary_matrix",
                help="the attacked job's task: a gym:<dataset> (with an eval-ing scorer for the "
                "bombs: binary_matrix, spiral_matrix, string_insertion, n_queens) or addition",
            ),
            p.add_argument(
                "--config-extra",
                type=Path,
                default=None,
                help="lines appended to the coordinator's config (say, a table that allows "
                "the gym dataset)",
            ),
            p.add_argument("--out", type=Path, default=None),
            p.add_argument(
                "--profile",
                type=Path,
                default=None,
                help="folder: py-spy samples (idle included, raw stacks) of every swarm "
                "process during the attack phase, one file per process",
            ),
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
                "--node-nice",
                type=int,
                default=None,
                help="the honest nodes' --nice (default 0, as every swarm tools/swarm.py starts: "
                "their RPC times are then the coordinator's latency, not their own wait for "
                "a core)",
            ),
            p.add_argument(
                "--verbose-nodes",
                action="store_true",
                help="the honest nodes log at INFO (their waits for pushes, fetches, refusals)",
            ),
        ),
    )
    exit_on_sigterm()  # a SIGTERM stops the swarm and the attackers too (the finally below)
    kinds = [k for k in args.attackers.split(",") if k]
    unknown = sorted(set(kinds) - set(ATTACKERS))
    if unknown:
        raise SystemExit(f"--attackers: unknown {unknown}; choose from {list(ATTACKERS)}")
    nodes = args.nodes or (2 if args.quick else 3)
    phase_s = args.phase_s or (20.0 if args.quick else 180.0)
    out = new_run_dir(args.out) if args.out else Path(tempfile.mkdtemp(prefix="echo-attack-"))
    say(
        f"attack benchmark: job {args.task}, {nodes} honest nodes, {phase_s:.0f} s per phase, "
        f"logs in {out}"
    )
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
        out,
        nodes,
        args.task,
        args.verbose_nodes,
        args.attacker_sched,
        args.attacker_ip or None,
        attacker_cpus,
        args.config_extra.read_text() if args.config_extra else "",
        args.node_nice,
    )
    t_start = time.time()
    try:
        deadline = time.time() + 180
        while bench.version() < 3:  # start-up and the warm-up steps are not measured
            if time.time() > deadline:
                raise SystemExit(f"the swarm did not reach v3 in 180 s; see {out}")
            time.sleep(1.0)
        say(f"the swarm reached v3 in {time.time() - t_start:.0f} s")
        keep_warmup(bench.cache)
        calm = bench.phase("unattacked", phase_s)
        if "stale" in kinds:
            # First, and alone: until they turn they are honest nodes earning their quota,
            # which the other attackers would keep them from (one run: none of the three had
            # a group accepted in 60 s beside them).
            bench.attackers.start(["stale"])
            bench.attackers.wait_for_stale(STALE_WAIT_S[args.quick])
        bench.attackers.start([k for k in kinds if k != "stale"])
        bench.attackers.wait_for_start(ATTACKER_START_S[args.quick])
        time.sleep(SETTLE_S[args.quick])  # the attackers start up (identities, engines)
        demoted_before = bench.demotions()
        spies = bench.profile(args.profile) if args.profile else []
        hit = bench.phase("under attack", phase_s)
        # Where the attackers ran: SCHED_IDLE, off the swarm's cores (checked, not assumed).
        hit["attackers_placement"] = swarm_probe.placement(
            [p.pid for p in bench.attackers.procs if p.poll() is None]
        )
        say(
            f"attackers ran as {hit['attackers_placement']}, the swarm on cores "
            f"{sorted(bench.swarm_cores)}"
        )
        swarm_probe.stop_profiles(spies)
        demoted = bench.demotions() - demoted_before
        dead = bench.attackers.dead()
        bench.attackers.stop()
        stats = bench.attackers.stats()
        held = {"stale", "hoard", "bomb"} & set(kinds)
        time.sleep(LEASE_TIMEOUT_S + 2.0 if held else SETTLE_S[args.quick])
        after = bench.phase("unattacked again", phase_s)
    finally:
        bench.stop()
    honest_ids = {addr.rsplit("/p2p/", 1)[1] for addr in bench.node_addrs}
    for name, res in (("unattacked", calm), ("under attack", hit), ("unattacked again", after)):
        # Who held the job's lease window (stale hoarders, hoarders, churned identities).
        res.update(
            window_held(out / "coordinator" / "coordinator.sqlite", honest_ids, res["window"])
        )
        say(
            f"{name}: leases held on average, honest {res['leases_held_honest']:.2f}, other "
            f"nodes with accepted groups {res['leases_held_others']:.2f}, strangers "
            f"{res['leases_held_strangers']:.2f}"
        )
    for kind, st in stats.items():
        say(f"  {kind}: {json.dumps(st)}")
    if dead:
        say(f"attackers that exited early (see attack-*.log): {dead}")
    traces = sorted(p.name for p in bench.marker_dir.iterdir())
    if traces:
        say(f"[!] the bombs' code ran outside the sandbox: {traces} in {bench.marker_dir}")
    stopped = after["versions_per_min"] == 0
    if stopped:
        # Not a ratio: the honest swarm stopped and did not come back (one run: every honest
        # node excluded for false verification failures). The logs in ``out`` say why. A swarm
        # stopped only under attack is a ratio of 0, below.
        say(f"the honest swarm stopped training (see {out}); no ratio")
    base = (calm["versions_per_min"] + after["versions_per_min"]) / 2
    ratio = None if stopped else hit["versions_per_min"] / base if base else 0.0
    per_free = [r["versions_per_min_per_free_core"] for r in (calm, hit, after)]
    ratio_free = per_free[1] / ((per_free[0] + per_free[2]) / 2) if per_free[0] + per_free[2] else 0
    recovery = (
        after["versions_per_min"] / calm["versions_per_min"] if calm["versions_per_min"] else 0
    )
    # The unattacked p99 from both calm phases' calls together: one 20 s phase holds a few
    # dozen calls per node, so its p99 is nearly its maximum.
    calm_windows = [tuple(calm["window"]), tuple(after["window"])]
    rpc = {}
    for name in TIMED_RPCS.values():
        p99 = _pct(rpc_times(bench.times_dir, name, calm_windows), 0.99)
        rpc[f"{name}_p99_ms_unattacked"] = None if p99 is None else 1000 * p99
        rpc[f"{name}_p99_under_attack_vs_unattacked"] = _ratio(
            hit[f"{name}_p99_ms"], rpc[f"{name}_p99_ms_unattacked"]
        )
    # The worse of the two. A call the honest nodes never made under attack (no lease granted:
    # no submit) has no p99 and is left out; its count in the phase says so, and the throughput
    # ratio carries that damage.
    ratios = {
        name: rpc[f"{name}_p99_under_attack_vs_unattacked"]
        for name in TIMED_RPCS.values()
        if rpc[f"{name}_p99_under_attack_vs_unattacked"] is not None
    }
    rpc_ratio = max(ratios.values()) if ratios else None
    if ratio is not None:
        say(
            f"honest ratio under attack: {ratio:.2f} of the unattacked phases' mean (goal >= "
            f"0.8); after the attack the swarm ran at {recovery:.2f} of its first phase; per "
            f"core the machine's other work left the swarm: {ratio_free:.2f}"
        )
    shown = ", ".join(
        f"{k} {ratios[k]:.2f}" if k in ratios else f"{k} -" for k in TIMED_RPCS.values()
    )
    say(
        f"honest p99 under attack over unattacked: {shown} (goal <= 2); "
        f"bomb traces outside the sandbox: {len(traces)}; relays demoted: {demoted}; "
        f"{time.time() - t_start:.0f} s in all"
    )
    emit(
        {
            "benchmark": "attack",
            "task": args.task,
            "attacker_kinds": kinds,
            "attacker_sched": args.attacker_sched,
            "attacker_ip": args.attacker_ip or "127.0.0.1",
            "attacker_cores": args.attacker_cores,
            "quick": args.quick,
            "nodes": nodes,
            "phase_s": phase_s,
            "out": str(out),
            "unattacked": calm,
            "under_attack": hit,
            "unattacked_after": after,
            "attackers": stats,
            "attackers_died": dead,
            "bomb_traces": len(traces),
            "relays_demoted": demoted,
            **rpc,
            "honest_ratio_under_attack": ratio,
            "honest_ratio_per_free_core": ratio_free,
            "rpc_p99_under_attack_vs_unattacked": rpc_ratio,
            "rpc_p99_from": sorted(ratios),
            "recovery_after_attack": recovery,
            "swarm_stopped": stopped,
        }
    )
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
