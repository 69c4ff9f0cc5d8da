"""Scheduling several jobs on one swarm: learner utilization against the capacity model, node
switches, time to a job's first trained version.

Real processes on loopback as ``tools/local_swarm.py`` runs them (its
:class:`~echo.tools.swarm.Swarm`): one coordinator (its ``[scheduler]`` with a short minimum stay,
so that a run of a few minutes sees moves), jobs with different model sizes and step times,
nodes of different speeds (token caps), one job that finishes early and one submitted mid-run.
Every second the run reads ``/v1/jobs`` (each job's nodes, the throughput they deliver by the
scheduler's estimate, its status); at the end, from each job's published versions:

- the learner's measured utilization: the share of the wall time from its first trained
  version to its last that it spent computing versions (``step_s + encode_s`` it reports per
  version), i.e. not waiting for rollouts (the wait for nodes to start or switch in before v1 is
  reported as the time to the first trained version; see :func:`steady`);
- the capacity model's prediction for the same job: ``T_train / period``
  (:func:`echo.coordinator.scheduling.capacity.step_period`) with the job's measured terms over the
  same versions, at the throughput the scheduler planned with (its estimate of the job's nodes, from
  what the coordinator accepted from each: ``have_rollouts_per_s``, sampled every second between
  the job's first and last version); and, as a secondary figure, at the throughput its nodes
  delivered (completions trained per second over the same span -- nearly circular: in a
  generation-bound run the model's period at that throughput is the measured one);
- node switches (a node loading another job's model) per node-hour and per job-hour;
- the time from a job's submission to its first trained version (v1).

Ends with one JSON line: ``learner_utilization_min`` (the lowest measured utilization of any
job), ``learner_utilization_predicted_min`` (the model's prediction for that job at the
scheduler's estimate),
``switches_per_node_hour``, and the per-job figures. ``--quick`` takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from pathlib import Path

import echo.tools.swarm
from echo.coordinator.scheduling.capacity import overlapped_period, step_period
from echo.tools.swarm import Swarm

ROOT = Path(__file__).resolve().parent.parent

SCHED_TOML = """
[scheduler]
every_s = 1.0
min_stay_s = {min_stay}
min_gain = 0.15
headroom = 1.1
"""


def job_toml(name: str, steps: int, hidden: int, layers: int, batch_groups: int) -> str:
    """A tiny addition job (no warm-up, no evaluation: the run measures pace, not learning)."""
    return echo.tools.swarm.job_toml(
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
        echo.tools.swarm.DEMO_COORDINATOR_TOML += SCHED_TOML.format(min_stay=self.min_stay)
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


def steady(versions: list[dict]) -> list[dict]:
    """The versions from the first trained one (v1) on: the window utilization is measured and
    predicted on. Before v1 the learner waits for nodes to start or switch in (engine start,
    model download, the first batch: 14-40 s of a quick run whose jobs then train in 6-40 s);
    the capacity model is a steady-state model with no term for that, and the wait is reported
    on its own, as the time from submission to the first trained version."""
    return [v for v in versions if v["version"] >= 1]


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
    vs = steady(st["versions"])
    if len(vs) < 2:
        return None
    span = vs[-1]["published_at"] - vs[0]["published_at"]
    spec = json.loads((Path(st["_job_dir"]) / "job.json").read_text())
    done = sum(v["trained_groups"] for v in vs[1:]) * spec["group_size"]
    return done / span if span > 0 else None


def terms(st: dict) -> dict | None:
    """The capacity model's terms for the job over the versions its utilization is measured on.

    ``t_train`` is the *mean* learner time of the versions after the first -- the same versions
    and the same statistic as :func:`utilization`, whose busy time is their sum: utilization is
    a ratio of sums, so the model's T_train for the same window must be the value whose n-fold
    sum is the measured busy time. A median would drop exactly the slow steps (the first one's
    warm-up, steps on a contended CPU) that the measurement counts. ``t_bcast`` is the median
    time until every node serving the job held a version, over the same versions (as the
    scheduler measures it; version 0's is the nodes starting, see :func:`steady`).
    """
    versions = steady(st["versions"])
    secs = [
        v["metrics"].get("step_s", 0.0) + v["metrics"].get("encode_s", 0.0) for v in versions[1:]
    ]
    if not secs:
        return None
    tta = sorted(v["time_to_all_s"] for v in versions if v["time_to_all_s"] is not None)
    spec = json.loads((Path(st["_job_dir"]) / "job.json").read_text())
    return {
        "R": spec["batch_groups"] * spec["group_size"],
        "t_train_s": sum(secs) / len(secs),
        "t_bcast_s": tta[len(tta) // 2] if tta else 0.0,
        "staleness": spec["staleness"],
    }


def predicted(st: dict, samples: list[float], period_of=overlapped_period) -> float | None:
    """The capacity model's learner_busy for the job (``T_train / period`` with the terms of
    :func:`terms`) at each throughput of ``samples``, averaged (a time average: the samples are
    taken every second). ``period_of``: :func:`overlapped_period` (nodes keep sampling while a
    version spreads, as the leases allow) or :func:`step_period` (ECHO-2's rule: in series)."""
    t = terms(st)
    if t is None or not samples:
        return None
    busy = []
    for mu in samples:
        period = period_of(t["R"], t["t_train_s"], t["t_bcast_s"], mu, t["staleness"])
        busy.append(min(1.0, t["t_train_s"] / period) if 0 < period < float("inf") else 0.0)
    return sum(busy) / len(busy)


def accepted_rps(out: Path, job_id: str, t0: float, t1: float) -> tuple[float, float] | None:
    """Completions/s the coordinator accepted for the job between ``t0`` and ``t1`` (what the
    scheduler's estimate counts), and the share of them not trained (stale, dropped, rejected
    later, or left in the buffer at the end), from the coordinator's database."""
    db = out / "coordinator" / "coordinator.sqlite"
    if t1 <= t0 or not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT status, COUNT(*) FROM rollouts WHERE job_id=? AND created_at BETWEEN ? AND ?"
            " GROUP BY status",
            (job_id, t0, t1),
        ).fetchall()
        group = con.execute("SELECT spec_json FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    finally:
        con.close()
    counts = dict(rows)
    total = sum(counts.values())
    size = json.loads(group[0])["group_size"] if group else 1
    untrained = total - counts.get("trained", 0)
    return total * size / (t1 - t0), (untrained / total if total else 0.0)


def switches(out: Path, names: list[str]) -> dict[str, int]:
    """Per node, how many times it loaded another job's model (its log says so)."""
    return {
        n: len(re.findall(r"switching to job", (out / f"{n}.log").read_text(errors="replace")))
        for n in names
    }


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small jobs: a minute or two")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("sched-%H%M%S"))
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every job's steps (a long run: steady phases of minutes, against the "
        "scheduler's 60 s estimate window)",
    )
    args = ap.parse_args()
    q = args.quick
    base = (12, 20, 10) if q else (40, 80, 40)
    steps_small, steps_large, steps_late = (max(1, round(n * args.scale)) for n in base)
    timeout = args.timeout or (240.0 if q else 900.0) * max(1.0, args.scale)
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
            vs = steady(st["versions"])
            # What the scheduler planned with, sampled over the span the utilization is measured
            # on (from the job's first trained version to its last).
            t_first = vs[0]["published_at"] if vs else 0.0
            t_last = vs[-1]["published_at"] if vs else 0.0
            mus = [
                j["have_rollouts_per_s"] or 0.0
                for at, jobs in run.samples
                for j in jobs
                if j["job_id"] == job_id and t_first <= at <= t_last
            ]
            acc = accepted_rps(out, job_id, t_first, t_last)
            first = next((v for v in vs if v["version"] == 1), None)
            every = st["versions"]
            span_h = (
                (every[-1]["published_at"] - every[0]["published_at"]) / 3600
                if len(every) > 1
                else 0
            )
            results[st["name"]] = {
                "job_id": job_id,
                "status": st["status"],
                "versions": st["current_version"],
                "utilization": utilization(vs),
                # From version 0: the nodes' start or switch-in included (no model term for it).
                "utilization_incl_startup": utilization(st["versions"]),
                # The model at the throughput the scheduler planned with (its estimate, from
                # what the coordinator accepted from each node), and at the throughput the
                # nodes delivered to the learner (completions trained).
                "utilization_predicted": predicted(st, mus),
                "utilization_predicted_at_delivered": predicted(
                    st, [mu] if (mu := delivered_rps(st)) else []
                ),
                # ECHO-2's rule (the broadcast in series with generation) at the same estimate.
                "utilization_predicted_serial": predicted(st, mus, step_period),
                "terms": terms(st),
                "estimated_rollouts_per_s": sum(mus) / len(mus) if mus else None,
                "accepted_rollouts_per_s": acc[0] if acc else None,
                "accepted_untrained_share": acc[1] if acc else None,
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
            t = r["terms"] or {}
            print(
                f"{name:6s} {r['status']:8s} v{r['versions']:<4d} learner busy {fmt(u, 3)} "
                f"(model {fmt(p, 3)} at the scheduler's estimate "
                f"{fmt(r['estimated_rollouts_per_s'])}/s "
                f"[{fmt(r['utilization_predicted_serial'], 3)} broadcast in series], "
                f"{fmt(r['utilization_predicted_at_delivered'], 3)} at the trained "
                f"{fmt(r['delivered_rollouts_per_s'])}/s; accepted "
                f"{fmt(r['accepted_rollouts_per_s'])}/s, {fmt(r['accepted_untrained_share'])} "
                f"untrained; T_train {fmt(t.get('t_train_s'), 3)} s, "
                f"T_bcast {fmt(t.get('t_bcast_s'))} s); "
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
        (out / "samples.json").write_text(json.dumps(run.samples))
        print(json.dumps(summary))
        return 0 if summary["all_done"] else 1
    finally:
        run.swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
