"""The processes of a local Echo swarm and its job API: a coordinator (with its learner) and
volunteer nodes started as processes of their own under one run folder, talking over loopback
exactly as across the internet (libp2p TCP + Noise + yamux, HTTP for the job API); the demo's
tiny-model job file and coordinator.toml; submitting a job, polling its status, a learner crash
drill and stopping everything (:class:`Swarm`).

The command line that runs one live (``python -m echo.tools.local_swarm``) is
:mod:`echo.tools.local_swarm`; tests and benchmarks that drive processes themselves use
:class:`Swarm` directly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from echo.protocol.jobspec import GRPOParams
from echo.tools.processes import start, stop, wait_for

ROOT = Path(__file__).resolve().parent.parent
# How long a job submission may take (the coordinator builds the job first: a real model's
# tokenizer, a dataset, its scorer in a fresh sandbox), and how often a status poll is tried.
SUBMIT_TIMEOUT_S = 120.0
STATUS_TRIES = 5
# vLLM's CPU attention needs a head size of at least 32: with vLLM nodes the demo model (hidden
# 64) gets 2 heads instead of 4.
HEADS, VLLM_HEADS = 4, 2

JOB_TOML = """\
[job]
name = "{name}"
steps = {steps}
group_size = {group_size}
batch_groups = {batch_groups}
staleness = {staleness}
skip_uniform_groups = {skip_uniform}
anchor_every = {anchor_every}
publish_dtype = "{dtype}"

[job.model]
kind = "tiny"
hidden = 64
layers = 2
heads = {heads}
seed = {seed}

[job.task]
name = "{task}"
params = {{ max_operand = {max_operand} }}

[job.grpo]
lr = {lr}
kl_coef = {kl_coef}

[job.sampling]
temperature = 1.0
max_new_tokens = 4

[job.warmup]
steps = {warmup}

[job.eval]
every = {eval_every}
"""


# The demo job's settings: what job_toml fills in for the fields a caller leaves out.
JOB_DEFAULTS: dict[str, object] = {
    "steps": 200,
    "group_size": 16,
    "batch_groups": 16,
    "staleness": 2,
    "skip_uniform": "false",
    "anchor_every": 10,
    "dtype": "float32",
    "task": "addition",
    "max_operand": 5,
    "lr": GRPOParams.model_fields["lr"].default,
    "kl_coef": 0.0,
    "warmup": 30,
    "heads": HEADS,
    "seed": 0,
    "eval_every": 10,
}


def job_toml(name: str, **fields: object) -> str:
    """The tiny-model job file :data:`JOB_TOML` with ``fields`` over :data:`JOB_DEFAULTS`;
    TypeError for a field the template does not have."""
    unknown = sorted(set(fields) - set(JOB_DEFAULTS))
    if unknown:
        raise TypeError(f"job_toml: unknown fields {unknown}")
    return JOB_TOML.format(name=name, **{**JOB_DEFAULTS, **fields})


# Loopback is as fast as memory, so the planner would rightly have the learner send to 3 nodes
# itself. The demo declares a home-sized learner uplink instead: the plan then puts one node
# under the learner and has it relay to the others, as a real swarm of many nodes would.
DEMO_COORDINATOR_TOML = f"""\
[jobs]
dataset_roots = ["{ROOT / "tests" / "data"}"]

[broadcast]
learner_upload_bps = 2.0e6
default_node_upload_bps = 4.0e6
"""


def buffer_toml(batches: int, batch_groups: int) -> str:
    """The coordinator.toml lines that keep ``batches`` batches of groups ahead of the learner
    ("" for the coordinator's default)."""
    if batches <= 0:
        return ""
    return f"\n[verification]\nbuffer_groups = {batches * batch_groups}\n"


class Swarm:
    """The processes of a local swarm under ``out``; :meth:`stop` ends them all."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen] = []
        self.env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.api: httpx.Client | None = None
        self.maddr = ""

    def start_coordinator(
        self, listen: str = "/ip4/127.0.0.1/tcp/0", config_extra: str = ""
    ) -> dict:
        (self.out / "coordinator.json").unlink(missing_ok=True)  # never read a previous run's
        (self.out / "coordinator.toml").write_text(DEMO_COORDINATOR_TOML + config_extra)
        coord = start(
            [
                sys.executable,
                "-m",
                "echo.coordinator.cli",
                "serve",
                "--config",
                str(self.out / "coordinator.toml"),
                "--data-dir",
                str(self.out / "coordinator"),
                "--listen",
                listen,
                "--http-port",
                "0",
                "--info-file",
                str(self.out / "coordinator.json"),
            ],
            self.out / "coordinator.log",
            self.env,
        )
        self.procs.append(coord)
        info = wait_for(self.out / "coordinator.json", coord, 60)
        self.maddr = info["multiaddrs"][0]
        self.api = httpx.Client(
            base_url=info["http"][0],
            timeout=10,
            headers={"Authorization": f"Bearer {info['token']}"},
        )
        return info

    def submit(self, job_toml: str) -> str:
        assert self.api is not None
        (self.out / "job.toml").write_text(job_toml)
        # The coordinator loads the job's reward in a sandbox first (reasoning-gym and sympy
        # imported in a fresh process): over 10 s on 2 cores shared with other sessions.
        r = self.api.post(
            "/v1/jobs",
            content=job_toml,
            headers={"content-type": "application/toml"},
            timeout=SUBMIT_TIMEOUT_S,
        )
        r.raise_for_status()
        return r.json()["job_id"]

    def start_node(
        self,
        name: str,
        extra: list[str] | None = None,
        module: list[str] | None = None,
        python: Path | None = None,
        wrap: list[str] | None = None,
    ) -> subprocess.Popen:
        # ``wrap``: a prefix such as ``ip netns exec NS`` (tools/nat_swarm.py's hosts).
        joins = module is None or module[-1] == "join"  # the node CLI, not an adversary's own
        cmd = [
            *(wrap or []),
            str(python or sys.executable),
            "-m",
            *(module or ["echo.node.cli", "join"]),
            "--coordinator",
            self.maddr,
            "--data-dir",
            str(self.out / name),
            # Each role here stands for a machine of its own: a node does not yield the core to
            # the coordinator and learner beside it as it would to its volunteer's own work.
            *(["--nice", "0"] if joins and "--nice" not in (extra or []) else []),
            *(extra or []),
        ]
        proc = start(cmd, self.out / f"{name}.log", self.env)
        self.procs.append(proc)
        return proc

    def status(self, job_id: str) -> tuple[dict, list[dict]]:
        """The job's status and the nodes. A call that times out or whose connection drops is
        tried again (STATUS_TRIES in all): on a loaded 2-core machine a coordinator building a
        real model's job answered late or reset the connection, and one missed poll must not
        end a run of an hour."""
        assert self.api is not None
        for attempt in range(STATUS_TRIES):
            try:
                return (self.api.get(f"/v1/jobs/{job_id}").json(), self.api.get("/v1/nodes").json())
            except httpx.TransportError:  # a reset keep-alive connection, a starved poller
                if attempt == STATUS_TRIES - 1:
                    raise
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def wait_finished(
        self, job_id: str, stall_s: float = 120.0, cap_s: float = 900.0
    ) -> tuple[dict, list[str]]:
        """Poll the job until it ends, its version stops advancing for ``stall_s`` or ``cap_s``
        pass; return its last status and a trace (version and non-excluded nodes' accepted counts
        every 30 s) for a failure message. Judging by progress, not a fixed wall time, keeps
        start-up on a loaded 2-core machine (a dozen processes importing torch: ~2 minutes) from
        reading as a stalled swarm."""
        start = last_move = time.time()
        st: dict = {}
        version = -1
        trace: list[str] = []
        while time.time() - start < cap_s:
            st, nodes = self.status(job_id)
            if st["status"] in ("done", "failed", "cancelled"):
                break
            if st["current_version"] != version:
                version, last_move = st["current_version"], time.time()
            elif time.time() - last_move > stall_s:
                trace.append(f"no new version for {stall_s:.0f} s")
                break
            if len(trace) < (time.time() - start) // 30:
                accepted = sorted(n["accepted"] for n in nodes if not n["excluded"])
                trace.append(f"{time.time() - start:.0f}s v{version} accepted {accepted}")
            time.sleep(2)
        return st, trace

    def kill_learner(self) -> int | None:
        """SIGKILL the coordinator's learner subprocess (a crash drill); returns its pid."""
        import psutil

        # The learner's own process, or an FSDP2 learner's last rank (not torchrun, which
        # would leave its ranks running). A process a learner forked carries the learner's
        # command line too: only the top-most learner processes are candidates.
        learners = []
        for child in psutil.Process(self.procs[0].pid).children(recursive=True):
            try:  # a process that exited meanwhile, or a zombie not yet reaped, is no learner
                cmd, ppid = " ".join(child.cmdline()), child.ppid()
            except psutil.Error:
                continue
            if "echo.learner" in cmd and "torch.distributed.run" not in cmd:
                learners.append((child, ppid))
        pids = {child.pid for child, _ in learners}
        learners = [child for child, ppid in learners if ppid not in pids]
        if not learners:
            return None
        learners[-1].kill()
        return learners[-1].pid

    def stop(self) -> None:
        stop(self.procs)
