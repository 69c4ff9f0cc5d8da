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

The job. Scorer bombs only reach an interpreter through a scorer that has one, so the swarm
trains a reasoning-gym task whose scorer ``eval()``\\ s the answer, with math-verify (sympy) as a
second reward term: every bomb goes through both kinds of hostile-input parser. The default,
``gym:binary_matrix`` at 3x3, is the eval-ing dataset with the shortest prompts (~320 tokens
without a system prompt; spiral_matrix ~800, string_insertion ~930): honest work per version
stays small enough that a 30 s phase holds a dozen versions. Completions may be 256 tokens, the
room a bomb gets (the tiny model's byte tokenizer: 255 bytes and EOS; a "1 MB string" does not
fit any lease: the protocol caps completions at 8192 tokens). The tiny model learns nothing
there (its rewards are all 0, and lr 1e-6 keeps the policy, and so the work per version, where
the warm-up left it), so what is measured is the swarm's throughput in versions per minute,
as for the addition job (``--task addition``, issue 13's job).

Printed per phase: versions per minute (the honest swarm's throughput), the coordinator's and
the learner's CPU (psutil, % of one core), and the honest nodes' lease and submit round trips,
p50/p99, timed inside the real node around the coordinator's reply (this module run as
``--timed-node``: the node's own pacing before a call is not counted; a submit's round trip
includes its verification and scoring). The JSON line (the last printed) carries
``honest_ratio_under_attack``: versions/min under attack over the mean of the two unattacked
phases (goal >= 0.8), and ``rpc_p99_under_attack_vs_unattacked``: the larger of the honest
nodes' lease p99 and submit p99 under attack over the same p99 of both unattacked phases
together (goal <= 2). The swarm's pace drifts between phases (a run with no attackers at all
measured 0.87 against the first phase alone); the phase after the attack brackets that, and
``recovery_after_attack`` (after over before) shows damage that outlasts the attackers. Also
in it: ``bomb_traces``, files the bombs' code payloads managed to write (anything but 0 is
code run outside the scoring sandbox), ``relays_demoted``, the coordinator's log lines
demoting a relay, and each attacker's own counters (what it sent, what it was answered).

Where the attackers stand: they dial from 127.0.0.x addresses other than the honest nodes'
127.0.0.1, which the coordinator counts as networks of their own (``[admission]
loopback_is_network``: budgets, a connection cap and a handshake rate per address, as for a
stranger's public /24). Each kind has an address of its own (:data:`KIND_NETWORKS`): behind
one, the kinds refused each other (the leecher was refused at the handshake for whole phases
behind the junk streams' address, and the hoarders' registrations alone spend a network's
96 a minute), which measures the budgets, not the attacks. The churner's identities come
from a new address each (127.1.0.0/16), a botnet's: from one network it could not register 5
a second (the budget admits 1.6). ``--attacker-ip ''`` puts every attacker on 127.0.0.1 with
the honest nodes, uncapped, as if each identity had a network of its own. On the internet the
attackers use their own machines; here they get cores of their own (``--attacker-cores``,
default 1 of this machine's: the swarm -- coordinator, learner, honest nodes -- is pinned to
the others in every phase), and run under SCHED_IDLE (``--attacker-sched``) besides. Sharing
the cores instead (``--attacker-cores 0``), five processes that only spin slowed this 2-core
swarm by ~30%: CPU taken, not damage done through the protocol. On one core the ten
attackers slow each other too: their counters say what each managed (``identities_per_s``
for the churner's reached rate). ``scoring_cpu_pct`` per phase is the job's scoring sandbox
(its zygote and the children it forked per group), which the coordinator's own CPU leaves out.

The stale hoarders must earn their quota before they can hoard: they start first, alone, and
the other attackers once they all have turned (at most ``STALE_WAIT_S`` later; their counter
``turned`` says how many did). Until then they are honest nodes, beside the swarm's. The phase
after the attack starts once the leases that hoarders held have expired (``LEASE_TIMEOUT_S``).

``--quick``: 2 nodes and 20 s phases, about 4 minutes in all on 2 busy cores (start-up, the
stale hoarders' warm-up and the wait for held leases to expire included); the default is 3
nodes and 180 s phases. The learner's format warm-up of the job is kept between runs
(:data:`WARMUP_CACHE`): only the first run of a job spends it (about a minute).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextvars import ContextVar
from pathlib import Path

import psutil

from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.tools.bench import emit, parse_args, say
from echo.tools.local_swarm import Swarm, job_toml
from echo.tools.processes import exit_on_sigterm, new_run_dir

ROOT = Path(__file__).resolve().parent.parent

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
# Where the attackers dial from: one address, another network than the honest nodes' (an
# attacker with many identities but one machine, the case budgets per network prefix are for).
# ``--attacker-ip ""``: from 127.0.0.1 with the honest nodes, whose loopback is uncapped -- the
# case of an attacker with a network of its own for every identity.
ATTACKER_IP = "127.0.0.2"
# Kinds with a network of their own (see the module doc); the rest share ATTACKER_IP.
KIND_NETWORKS = {
    "leech": "127.0.0.3",
    "leech24": "127.0.0.4",
    "bomb": "127.0.0.5",
    "stale": "127.0.0.6",
    "demote": "127.0.0.7",
    "churn": "127.1.0.0/16",
}
CHURN_RATE = 5.0
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
# How the attacker processes share this machine's cores with the swarm. On the internet they run
# on their own machines, so what they should cost here is the work they make the coordinator and
# the nodes do, not CPU time taken from them. "idle" (SCHED_IDLE) runs an attacker only when no
# swarm process wants a core. Measured with all five (--quick, 2 cores): nice 19, ratio 0.35 and
# lease p50 14 -> 108 ms; SCHED_IDLE, 0.52 and 12 -> 59 ms. Neither removes the cost of sharing
# the cores: spinning SCHED_IDLE processes alone slow this swarm by ~30% (see the README).
ATTACKER_SCHED = {"idle": ["chrt", "--idle", "0"], "nice": ["nice", "-n", "19"], "none": []}

# The attacked job: a gym task whose scorer eval()s (see the module doc), scored by the task and
# by math-verify. Parameters per dataset keep prompts and answers short.
GYM_PARAMS = {
    "binary_matrix": "min_n = 3, max_n = 3",
    "spiral_matrix": "max_n = 3",
    "string_insertion": "max_string_length = 8",
    "n_queens": "n = 4, max_remove = 2",
}
GYM_MAX_NEW_TOKENS = 256
GYM_JOB_TOML = """\
[job]
name = "attack"
steps = 100000
group_size = 8
batch_groups = 4
staleness = 2
anchor_every = 10
publish_dtype = "float32"

[job.model]
kind = "tiny"
hidden = 64
layers = 2
heads = 4

[job.task]
name = "{task}"
params = {{ system_prompt = "", max_new_tokens = {max_new_tokens}{params} }}

[[job.reward]]
kind = "task"

[[job.reward]]
kind = "math"

[job.grpo]
lr = 1e-6

[job.sampling]
max_new_tokens = {max_new_tokens}

[job.warmup]
steps = {warmup}

[job.eval]
every = 0
"""
# Format warm-up steps of the gym job: enough for the tiny model to close its answers with
# EOS (40 steps: 30 tokens per completion) rather than fill all 256 tokens (8x the work).
GYM_WARMUP = 40
# The learner caches its warm-up under ``<coordinator data dir>/cache`` (learner/trainer.py),
# keyed by everything that determines it; a run starts from the previous runs' copies and adds
# its own, so only the first run of a job spends the warm-up (about a minute on 2 busy cores).
WARMUP_CACHE = Path(tempfile.gettempdir()) / "echo-attack-warmup-cache"

# The honest nodes' round trips: ``python -m benchmarks.attack --timed-node join ...`` is the
# real node with these calls timed, one line ``wall_time seconds rpc`` each, appended to
# ``$ECHO_RPC_TIMES_DIR/<pid>.txt``.
TIMED_NODE = "--timed-node"
RPC_TIMES_ENV = "ECHO_RPC_TIMES_DIR"
TIMED_RPCS = {ids.PROTO_LEASE: "lease", ids.PROTO_SUBMIT: "submit"}
# A relay demoted for bad-chunk reports (coordinator/dissemination/relays.py logs it).
DEMOTED_LINE = re.compile(r"relay \S+ reported .*planned as a leaf")


def _run_timed_node(argv: list[str]) -> None:
    """The real ``echo-node`` with its lease and submit calls to the coordinator timed."""
    from echo.node import pacing, session
    from echo.node.cli import app

    out = Path(os.environ.get(RPC_TIMES_ENV, ".")) / f"{os.getpid()}.txt"
    # When the node's own pacer let the call go: the wait before it is the node's choice, not
    # the coordinator's latency. Set in the calling task's context (the pacer runs in it).
    ready: ContextVar[float] = ContextVar("ready", default=0.0)
    real_wait, real_call = pacing.Pacer.wait, session.CoordinatorSession.call

    async def wait(self, rpc: str) -> float:
        waited = await real_wait(self, rpc)
        ready.set(time.monotonic())
        return waited

    async def call(self, proto: str, payload: bytes, **kw) -> bytes:
        t0 = time.monotonic()
        try:
            reply = await real_call(self, proto, payload, **kw)
            if proto == ids.PROTO_LEASE:  # what was granted, and why nothing when nothing
                from echo.protocol import messages as m

                got = m.decode(m.LeaseReply, reply)
                why = got.message.split(" ")[0] or "-"
                with open(out.with_suffix(".grants"), "a") as f:
                    f.write(f"{time.time():.3f} {len(got.leases)} {why}\n")
            return reply
        finally:
            if proto in TIMED_RPCS:
                dt = time.monotonic() - max(t0, ready.get())
                with open(out, "a") as f:
                    f.write(f"{time.time():.3f} {dt:.6f} {TIMED_RPCS[proto]}\n")

    pacing.Pacer.wait = wait  # type: ignore[method-assign]
    session.CoordinatorSession.call = call  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *argv]
    app()


def _runq_wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent ready to run but waiting for a core
    (``/proc/<pid>/task/*/schedstat``; 0 where the kernel does not keep it)."""
    total = 0.0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def gym_job(task: str) -> str:
    """The attacked gym job's toml (see the module doc)."""
    dataset = task.removeprefix("gym:")
    params = GYM_PARAMS.get(dataset, "")
    return GYM_JOB_TOML.format(
        task=task,
        max_new_tokens=GYM_MAX_NEW_TOKENS,
        params=f", {params}" if params else "",
        warmup=GYM_WARMUP,
    )


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
    ) -> None:
        self.out, self.swarm = out, Swarm(out)
        # The swarm's processes inherit this process's cores; the attackers get theirs at start.
        self.attacker_cpus = attacker_cpus
        if attacker_cpus:
            os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - attacker_cpus)
        self.times_dir = out / "rpc_times"
        self.times_dir.mkdir(parents=True, exist_ok=True)
        self.swarm.env[RPC_TIMES_ENV] = str(self.times_dir)
        self.marker_dir = out / "bomb-traces"
        self.marker_dir.mkdir(exist_ok=True)
        # Attackers dial from other loopback addresses, which the coordinator counts as
        # networks of their own (the honest nodes and the learner stay on 127.0.0.1).
        self.attacker_ip = attacker_ip
        admission = "\n[admission]\nloopback_is_network = true\n" if attacker_ip else ""
        self.cache = out / "coordinator" / "cache"
        self.cache.mkdir(parents=True, exist_ok=True)
        for cached in WARMUP_CACHE.glob("warmup-*.safetensors"):
            shutil.copy2(cached, self.cache / cached.name)
        self.swarm.start_coordinator(config_extra=admission + config_extra)
        self.coord = psutil.Process(self.swarm.procs[0].pid)
        if task.startswith("gym"):
            spec = gym_job(task)
        else:
            # lr 1e-6: the policy stays where the warm-up left it, so the work per version (the
            # completions' lengths, what re-scoring and verification cost) does not drift
            # between phases as the model learns (at lr 1e-3 one run went 153 -> 220
            # versions/min from its first unattacked phase to its last).
            spec = job_toml(
                "attack",
                task=task,
                steps=100000,
                group_size=8,
                batch_groups=4,
                warmup=5,
                eval_every=0,
                lr=1e-6,
            )
        try:
            self.job_id = self.swarm.submit(spec)
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
                ],
                module=["benchmarks.attack", TIMED_NODE, "join"],
            )
        self.attackers: list[subprocess.Popen] = []
        self.kinds: list[str] = []
        self.attacker_prefix = ATTACKER_SCHED[attacker_sched]

    def version(self) -> int:
        return int(self.swarm.status(self.job_id)[0]["current_version"])

    def learner(self) -> psutil.Process | None:
        for child in self.coord.children(recursive=True):
            if "echo.learner" in " ".join(child.cmdline()):
                return child
        return None

    def sandbox_cpu(self) -> dict[int, float]:
        """CPU seconds of each scoring zygote, with the children it forked per group and reaped
        (psutil's children times): what scoring costs, which the coordinator's own CPU leaves
        out."""
        out = {}
        for child in self.coord.children(recursive=True):
            try:
                if "sandbox_zygote" in " ".join(child.cmdline()):
                    out[child.pid] = sum(child.cpu_times()[:4])
            except psutil.Error:
                continue
        return out

    def keep_warmup(self) -> None:
        """Keep this run's warm-up for the next runs (see :data:`WARMUP_CACHE`)."""
        WARMUP_CACHE.mkdir(exist_ok=True)
        for made in self.cache.glob("warmup-*.safetensors"):
            if not (WARMUP_CACHE / made.name).exists():
                shutil.copy2(made, WARMUP_CACHE / f".{made.name}.tmp")
                os.replace(WARMUP_CACHE / f".{made.name}.tmp", WARMUP_CACHE / made.name)

    def rpc_times(self, rpc: str, windows: list[tuple[float, float]]) -> list[float]:
        """The honest nodes' ``rpc`` round trips that ended inside any of ``windows``."""
        out = []
        for f in self.times_dir.glob("*.txt"):
            for line in f.read_text().splitlines():
                at, dt, kind = line.split()
                if kind == rpc and any(a <= float(at) <= b for a, b in windows):
                    out.append(float(dt))
        return out

    def grants(self, window: tuple[float, float]) -> tuple[int, dict[str, int]]:
        """Leases the honest nodes were granted in ``window``, and the replies that granted
        none, by the first word of their message ("update", "buffer", ...)."""
        total, empty = 0, {}
        for f in self.times_dir.glob("*.grants"):
            for line in f.read_text().splitlines():
                at, n, why = line.split()
                if window[0] <= float(at) <= window[1]:
                    total += int(n)
                    if not int(n):
                        empty[why] = empty.get(why, 0) + 1
        return total, empty

    def phase(self, name: str, seconds: float) -> dict:
        """Measure ``seconds`` of the swarm as it is now."""
        learner = self.learner()
        t0, v0 = time.time(), self.version()
        c0 = sum(self.coord.cpu_times()[:2])
        q0 = _runq_wait_s(self.coord.pid)
        l0 = sum(learner.cpu_times()[:2]) if learner else 0.0
        s0 = self.sandbox_cpu()
        time.sleep(seconds)
        t1, v1 = time.time(), self.version()
        c1 = sum(self.coord.cpu_times()[:2])
        q1 = _runq_wait_s(self.coord.pid)
        l1 = sum(learner.cpu_times()[:2]) if learner and learner.is_running() else l0
        s1 = self.sandbox_cpu()
        res: dict = {
            "window": [t0, t1],
            "versions_per_min": (v1 - v0) * 60.0 / (t1 - t0),
            "coordinator_cpu_pct": 100.0 * (c1 - c0) / (t1 - t0),
            # Time its threads were ready to run but waited for a core (the machine's load).
            "coordinator_runq_wait_pct": 100.0 * (q1 - q0) / (t1 - t0),
            "learner_cpu_pct": 100.0 * (l1 - l0) / (t1 - t0),
            # A zygote started during the phase counts from 0.
            "scoring_cpu_pct": 100.0 * sum(s1[p] - s0.get(p, 0.0) for p in s1) / (t1 - t0),
        }
        res["leases_granted"], res["empty_lease_replies"] = self.grants((t0, t1))
        for rpc in TIMED_RPCS.values():
            lat = self.rpc_times(rpc, [(t0, t1)])
            res[f"{rpc}_p50_ms"] = None if not lat else 1000 * _pct(lat, 0.5)
            res[f"{rpc}_p99_ms"] = None if not lat else 1000 * _pct(lat, 0.99)
            res[f"{rpc}_calls"] = len(lat)
        say(
            f"{name}: v{v0} -> v{v1} in {t1 - t0:.0f} s = {res['versions_per_min']:.1f} "
            f"versions/min; coordinator CPU {res['coordinator_cpu_pct']:.0f}% (waited for a "
            f"core {res['coordinator_runq_wait_pct']:.0f}%), learner "
            f"{res['learner_cpu_pct']:.0f}%, scoring {res['scoring_cpu_pct']:.0f}%; lease p50 "
            f"{_ms(res['lease_p50_ms'])}, p99 {_ms(res['lease_p99_ms'])} "
            f"({res['lease_calls']} calls); submit p50 {_ms(res['submit_p50_ms'])}, p99 "
            f"{_ms(res['submit_p99_ms'])} ({res['submit_calls']} calls); leases granted "
            f"{res['leases_granted']}, empty replies {res['empty_lease_replies']}"
        )
        return res

    def profile(self, folder: Path) -> list[subprocess.Popen]:
        """py-spy on the coordinator, the learner and the honest nodes until interrupted: where
        their time goes, waits included (``--idle``), since a wait is what an honest call sees."""
        folder.mkdir(parents=True, exist_ok=True)
        procs = [psutil.Process(p.pid) for p in self.swarm.procs if p.poll() is None]
        learner = self.learner()
        if learner is not None:
            procs.append(learner)
        exe = Path(sys.executable).with_name("py-spy")
        all_cpus = set(range(os.cpu_count() or 1))
        spies = []
        for proc in procs:
            # The swarm's launchers may be wrappers: sample the python that runs the part.
            name = "-".join(a.rsplit("/", 1)[-1] for a in proc.cmdline()[1:4])[:60]
            cmd = [str(exe) if exe.exists() else "py-spy", "record", "-p", str(proc.pid)]
            out = folder / f"{proc.pid}-{name}.txt"
            cmd += ["--idle", "-f", "raw", "-r", "100", "-o", str(out)]
            spies.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    # Not on the swarm's cores, which it would take from what it measures.
                    preexec_fn=lambda: os.sched_setaffinity(0, self.attacker_cpus or all_cpus),
                )
            )
        return spies

    def start_attackers(self, kinds: list[str]) -> None:
        cpus = self.attacker_cpus
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
        for kind in kinds:
            cmd = [
                *pin,
                *self.attacker_prefix,
                sys.executable,
                "-m", "echo.tools.attackers",
                kind,
                "--coordinator",
                self.swarm.maddr,
                "--job",
                self.job_id,
                "--stats",
                str(self.out / f"attack-{kind}.json"),
            ]
            if self.attacker_ip:
                own = self.attacker_ip == ATTACKER_IP and KIND_NETWORKS.get(kind)
                cmd += ["--source-ip", own or self.attacker_ip]
            if kind in ("liar", "stale"):
                cmd += ["--data-dir", str(self.out / kind)]
            if kind in ("leech", "leech24", "gossip", "demote"):
                for addr in self.node_addrs:
                    cmd += ["--peer", addr]
            if kind == "churn":
                cmd += ["--rate", str(CHURN_RATE)]
            if kind == "bomb":
                cmd += ["--marker-dir", str(self.marker_dir)]
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
            self.kinds.append(kind)

    def attacker_stats(self) -> dict:
        out = {}
        for path in sorted(self.out.glob("attack-*.json")):
            try:
                out[path.stem.removeprefix("attack-")] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def wait_for_stale(self, cap_s: float) -> None:
        """Until every stale hoarder has earned its quota and turned, at most ``cap_s``."""
        deadline = time.time() + cap_s
        while time.time() < deadline:
            st = self.attacker_stats().get("stale", {})
            if st.get("identities") and st.get("turned", 0) >= st["identities"]:
                say(f"the {st['turned']} stale hoarders have turned")
                return
            if self.attackers[self.kinds.index("stale")].poll() is not None:
                break
            time.sleep(1.0)
        st = self.attacker_stats().get("stale", {})
        say(
            f"stale hoarders: {st.get('turned', 0)} of {st.get('identities', '?')} turned "
            f"({st.get('warm_accepted', 0)} groups accepted meanwhile); attacking anyway"
        )

    def wait_for_start(self, cap_s: float) -> None:
        """Until every attacker started has begun (written its counters), at most ``cap_s``."""
        deadline = time.time() + cap_s
        waiting = list(self.kinds)
        while waiting and time.time() < deadline:
            waiting = [
                k
                for k, p in zip(self.kinds, self.attackers, strict=True)
                if not (self.out / f"attack-{k}.json").exists() and p.poll() is None
            ]
            time.sleep(0.5)
        if waiting:
            say(f"attackers not started after {cap_s:.0f} s (measured anyway): {waiting}")

    def dead_attackers(self) -> list[str]:
        return [k for k, p in zip(self.kinds, self.attackers, strict=True) if p.poll() is not None]

    def demotions(self) -> int:
        try:
            return len(DEMOTED_LINE.findall((self.out / "coordinator.log").read_text()))
        except OSError:
            return 0

    def stop_attackers(self) -> None:
        from echo.tools.processes import stop

        stop(self.attackers)

    def stop(self) -> None:
        self.stop_attackers()
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
    )
    t_start = time.time()
    try:
        deadline = time.time() + 180
        while bench.version() < 3:  # start-up and the warm-up steps are not measured
            if time.time() > deadline:
                raise SystemExit(f"the swarm did not reach v3 in 180 s; see {out}")
            time.sleep(1.0)
        say(f"the swarm reached v3 in {time.time() - t_start:.0f} s")
        bench.keep_warmup()
        calm = bench.phase("unattacked", phase_s)
        if "stale" in kinds:
            # First, and alone: until they turn they are honest nodes earning their quota,
            # which the other attackers would keep them from (one run: none of the three had
            # a group accepted in 60 s beside them).
            bench.start_attackers(["stale"])
            bench.wait_for_stale(STALE_WAIT_S[args.quick])
        bench.start_attackers([k for k in kinds if k != "stale"])
        bench.wait_for_start(ATTACKER_START_S[args.quick])
        time.sleep(SETTLE_S[args.quick])  # the attackers start up (identities, engines)
        demoted_before = bench.demotions()
        spies = bench.profile(args.profile) if args.profile else []
        hit = bench.phase("under attack", phase_s)
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples on an interrupt
        for spy in spies:
            spy.wait(30)
        demoted = bench.demotions() - demoted_before
        dead = bench.dead_attackers()
        bench.stop_attackers()
        stats = bench.attacker_stats()
        held = {"stale", "hoard", "bomb"} & set(kinds)
        time.sleep(LEASE_TIMEOUT_S + 2.0 if held else SETTLE_S[args.quick])
        after = bench.phase("unattacked again", phase_s)
    finally:
        bench.stop()
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
    recovery = (
        after["versions_per_min"] / calm["versions_per_min"] if calm["versions_per_min"] else 0
    )
    # The unattacked p99 from both calm phases' calls together: one 20 s phase holds a few
    # dozen calls per node, so its p99 is nearly its maximum.
    calm_windows = [tuple(calm["window"]), tuple(after["window"])]
    rpc = {}
    for name in TIMED_RPCS.values():
        p99 = _pct(bench.rpc_times(name, calm_windows), 0.99)
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
            f"0.8); after the attack the swarm ran at {recovery:.2f} of its first phase"
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
            "rpc_p99_under_attack_vs_unattacked": rpc_ratio,
            "rpc_p99_from": sorted(ratios),
            "recovery_after_attack": recovery,
            "swarm_stopped": stopped,
        }
    )
    return 1 if stopped else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [TIMED_NODE]:
        _run_timed_node(sys.argv[2:])
    else:
        sys.exit(main())
