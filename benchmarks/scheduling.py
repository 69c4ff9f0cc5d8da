"""Scheduling several jobs on one swarm: learner utilization against the capacity model, node
switches, time to a job's first trained version.

Real processes on loopback as ``scripts/local_swarm.py`` runs them (its :class:`Swarm`): one
coordinator (its ``[scheduler]`` with a short minimum stay, so that a run of a few minutes sees
moves), jobs with different model sizes and step times, nodes of different speeds (token caps),
one job that finishes early and one submitted mid-run. Every second the run reads ``/v1/jobs``
(each job's nodes, the throughput they deliver by the scheduler's estimate, its status); at the
end, from each job's published versions:

- the learner's measured utilization: the share of the wall time from its first version to its
  last that it spent computing versions (``step_s + encode_s`` it reports per version), i.e. not
  waiting for rollouts;
- the capacity model's prediction for the same job: ``T_train / period``
  (:func:`echo.coordinator.capacity.step_period`) with the job's measured terms, at the
  throughput its nodes delivered (completions trained per second), and also at the throughput the
  scheduler estimated from the nodes' reported tokens/s (averaged over the run's samples);
- node switches (a node loading another job's model) per node-hour and per job-hour;
- the time from a job's submission to its first trained version (v1).

Ends with one JSON line: ``learner_utilization_min`` (the lowest measured utilization of any
job), ``learner_utilization_predicted_min`` (the model's prediction for that job),
``switches_per_node_hour``, and the per-job figures. ``--quick`` takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import local_swarm  # noqa: E402
from local_swarm import Swarm  # noqa: E402

from echo.coordinator.capacity import step_period  # noqa: E402

SCHED_TOML = """
[scheduler]
every_s = 1.0
min_stay_s = {min_stay}
min_gain = 0.15
headroom = 1.1
"""


def job_toml(name: str, steps: int, hidden: int, layers: int, batch_groups: int) -> str:
    """A tiny addition job (no warm-up, no evaluation: the run measures pace, not learning)."""
    return local_swarm.job_toml(
        name, steps=steps, group_size=8, batch_groups=batch_groups, warmup=0, eval_every=0
    ).replace("hidden = 64\nlayers = 2", f"hidden = {hidden}\nlayers = {layers}")


class Run:
    """One benchmark run: its swarm, the jobs submitted (id -> submit time) and the samples."""

    def __init__(self, out: Path, min_stay: float) -> None:
        self.out = out
        self.swarm = Swarm(out)
        self.min_stay = min_stay
        self.submitted: dict[str, float] = {}
        self.samples: list[tuple[float, list[dict]]] = []

    def start(self) -> None:
        local_swarm.DEMO_COORDINATOR_TOML += SCHED_TOML.format(min_stay=self.min_stay)
        self.swarm.start_coordinator()

    def submit(self, toml: str) -> str:
        job_id = self.swarm.submit(toml)
        self.submitted[job_id] = time.time()
        return job_id

    def poll(self) -> list[dict]:
        assert self.swarm.api is not None
        jobs = self.swarm.api.get("/v1/jobs").json()
        self.samples.append((time.time(), jobs))
        return jobs

    def job(self, job_id: str) -> dict:
        assert self.swarm.api is not None
        return self.swarm.api.get(f"/v1/jobs/{job_id}").json()


def utilization(versions: list[dict]) -> float | None:
    """Measured: learner seconds of every version after the first over the span they took."""
    if len(versions) < 2:
        return None
    span = versions[-1]["published_at"] - versions[0]["published_at"]
    busy = sum(
        v["metrics"].get("step_s", 0.0) + v["metrics"].get("encode_s", 0.0) for v in versions[1:]
    )
    return min(1.0, busy / span) if span > 0 else None


def delivered_rps(st: dict) -> float | None:
    """Rollouts/s the job's nodes delivered: completions trained in versions after the first,
    over the span from the first version to the last (the same window as :func:`utilization`)."""
    vs = st["versions"]
    if len(vs) < 2:
        return None
    span = vs[-1]["published_at"] - vs[0]["published_at"]
    spec = json.loads((Path(st["_job_dir"]) / "job.json").read_text())
    done = sum(v["trained_groups"] for v in vs[1:]) * spec["group_size"]
    return done / span if span > 0 else None


def predicted(st: dict, samples: list[float]) -> float | None:
    """The capacity model's learner_busy for the job (``T_train / period``, with its measured
    ``T_train`` and ``T_bcast``) at each throughput of ``samples``, averaged."""
    versions = st["versions"]
    secs = sorted(
        v["metrics"].get("step_s", 0.0) + v["metrics"].get("encode_s", 0.0) for v in versions[1:]
    )
    tta = sorted(v["time_to_all_s"] for v in versions if v["time_to_all_s"] is not None)
    if not secs or not samples:
        return None
    t_train = secs[len(secs) // 2]
    t_bcast = tta[len(tta) // 2] if tta else 0.0
    spec = json.loads((Path(st["_job_dir"]) / "job.json").read_text())
    R = spec["batch_groups"] * spec["group_size"]
    busy = []
    for mu in samples:
        period = step_period(R, t_train, t_bcast, mu, spec["staleness"])
        busy.append(min(1.0, t_train / period) if 0 < period < float("inf") else 0.0)
    return sum(busy) / len(busy)


def switches(out: Path, names: list[str]) -> dict[str, int]:
    """Per node, how many times it loaded another job's model (its log says so)."""
    return {
        n: len(re.findall(r"switching to job", (out / f"{n}.log").read_text(errors="replace")))
        for n in names
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small jobs: a minute or two")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("sched-%H%M%S"))
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args()
    q = args.quick
    steps_small, steps_large, steps_late = (12, 20, 10) if q else (40, 80, 40)
    timeout = args.timeout or (240.0 if q else 900.0)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, min_stay=10.0 if q else 30.0)
    node_names = ["node-fast", "node-mid", "node-slow"]
    node_args = {  # speeds differ by token caps (the machine has 2 cores for everything)
        "node-fast": [],
        "node-mid": ["--max-tokens-per-s", "1500"],
        "node-slow": ["--max-tokens-per-s", "600", "--cost", "2.0"],
    }
    t0 = time.time()
    try:
        run.start()
        run.submit(job_toml("small", steps_small, 64, 2, 4))
        large = run.submit(job_toml("large", steps_large, 128, 4, 4))
        for n in node_names:
            run.swarm.start_node(
                n, ["--threads", "1", "--leases-at-once", "2", "--engine", "torch", *node_args[n]]
            )
        late = None
        while time.time() - t0 < timeout:
            jobs = run.poll()
            by_id = {j["job_id"]: j for j in jobs}
            if late is None and by_id[large]["current_version"] >= steps_large // 3:
                late = run.submit(job_toml("late", steps_late, 64, 2, 4))
            if late is not None and all(j["status"] in ("done", "failed") for j in jobs):
                break
            dead = [p for p in run.swarm.procs if p.poll() is not None]
            if dead:
                print(f"a process exited early (exit {dead[0].returncode}); logs in {out}")
                break
            time.sleep(1.0)
        wall = time.time() - t0
        results = {}
        for job_id in run.submitted:
            st = run.job(job_id)
            st["_job_dir"] = str(out / "coordinator" / "jobs" / job_id)
            mus = [
                j["have_rollouts_per_s"]
                for _, jobs in run.samples
                for j in jobs
                if j["job_id"] == job_id
                and j.get("have_rollouts_per_s")
                and j["status"] == "running"
            ]
            vs = st["versions"]
            first = next((v for v in vs if v["version"] == 1), None)
            span_h = ((vs[-1]["published_at"] - vs[0]["published_at"]) / 3600) if len(vs) > 1 else 0
            results[st["name"]] = {
                "job_id": job_id,
                "status": st["status"],
                "versions": st["current_version"],
                "utilization": utilization(vs),
                # The model at the throughput the nodes delivered, and at the throughput the
                # scheduler estimated from their reported tokens/s (what it planned with).
                "utilization_predicted": predicted(st, [mu] if (mu := delivered_rps(st)) else []),
                "utilization_predicted_from_estimate": predicted(st, mus),
                "delivered_rollouts_per_s": mu,
                "submit_to_first_version_s": (
                    first["published_at"] - run.submitted[job_id] if first else None
                ),
                "switches_in": st["schedule"].get("switches_in", 0),
                "job_hours": span_h,
            }
        sw = switches(out, node_names)
        node_hours = len(node_names) * wall / 3600
        job_hours = sum(r["job_hours"] for r in results.values())
        total_sw = sum(sw.values())
        for name, r in results.items():
            u, p = r["utilization"], r["utilization_predicted"]
            print(
                f"{name:6s} {r['status']:8s} v{r['versions']:<4d} learner busy "
                f"{'-' if u is None else f'{u:.2f}'} (model {'-' if p is None else f'{p:.2f}'} at "
                f"the delivered throughput, {fmt(r['utilization_predicted_from_estimate'])} at "
                f"the scheduler's estimate); "
                f"first trained version {r['submit_to_first_version_s'] or float('nan'):.1f} s "
                f"after submission; {r['switches_in']} node(s) moved in"
            )
        print(
            f"node switches: {sw} -> {total_sw / max(node_hours, 1e-9):.1f} per node-hour, "
            f"{total_sw / max(job_hours, 1e-9):.1f} per job-hour; wall {wall:.0f} s"
        )
        measured = {n: r for n, r in results.items() if r["utilization"] is not None}
        worst = min(measured, key=lambda n: measured[n]["utilization"]) if measured else None
        summary = {
            "learner_utilization_min": measured[worst]["utilization"] if worst else None,
            "learner_utilization_predicted_min": (
                measured[worst]["utilization_predicted"] if worst else None
            ),
            "learner_utilization_min_job": worst,
            "switches_per_node_hour": total_sw / max(node_hours, 1e-9),
            "switches_per_job_hour": total_sw / max(job_hours, 1e-9),
            "jobs": results,
            "node_switches": sw,
            "all_done": all(r["status"] == "done" for r in results.values()),
            "nodes_alive": all(p.poll() is None for p in run.swarm.procs[1:]),
            "wall_s": wall,
        }
        (out / "scheduling.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))
        return 0 if summary["all_done"] else 1
    finally:
        run.swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
