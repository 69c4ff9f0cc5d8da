"""What a benchmark reads of a running local swarm's processes from outside them: the learner
among the coordinator's children, the scoring sandbox's CPU, a process's waits for a core
(``/proc`` schedstat), the CPU of a process tree, where a process tree may run (its cores and
scheduling policy), and py-spy samples of chosen processes over a stretch of time.

Used by benchmarks/attack.py per phase; nothing here changes the processes it looks at.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


def runq_wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent ready to run but waiting for a core
    (``/proc/<pid>/task/*/schedstat``; 0 where the kernel does not keep it)."""
    total = 0.0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def learner(coord: psutil.Process) -> psutil.Process | None:
    """The learner the coordinator ``coord`` started, if it runs."""
    for child in coord.children(recursive=True):
        if "echo.learner" in " ".join(child.cmdline()):
            return child
    return None


def sandbox_cpu(coord: psutil.Process) -> dict[int, float]:
    """CPU seconds of each scoring zygote under ``coord``, with the children it forked per group
    and reaped (psutil's children times): what scoring costs, which the coordinator's own CPU
    leaves out."""
    out = {}
    for child in coord.children(recursive=True):
        try:
            if "sandbox_zygote" in " ".join(child.cmdline()):
                out[child.pid] = sum(child.cpu_times()[:4])
        except psutil.Error:
            continue
    return out


def start_profiles(
    procs: list[psutil.Process], folder: Path, cpus: set[int] | None
) -> list[subprocess.Popen]:
    """py-spy on each of ``procs`` until :func:`stop_profiles`: where their time goes, waits
    included (``--idle``), since a wait is what an honest call sees. One raw-stacks file per
    process in ``folder``. The samplers run on ``cpus`` (all of them when None): not on the
    cores of what they measure, where they would take from it."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("py-spy")
    on = cpus or set(range(os.cpu_count() or 1))
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
                preexec_fn=lambda: os.sched_setaffinity(0, on),
            )
        )
    return spies


def stop_profiles(spies: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Interrupt the samplers, which makes py-spy write its samples, and wait for them."""
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        spy.wait(timeout_s)


def process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` that still run, each followed by all its descendants."""
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue  # ended meanwhile
    return procs


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the processes ``pids`` with all their descendants: the live ones' own, and
    the reaped ones' through their parents' children times (each counted once)."""
    total = 0.0
    for proc in process_trees(pids):
        try:
            total += sum(proc.cpu_times()[:4])
        except psutil.Error:
            continue
    return total


def placement(pids: list[int]) -> dict:
    """Where the processes ``pids`` and their descendants may run: how many there are, how many
    run under SCHED_IDLE (threads inherit it from the process that made them), the union of
    their allowed cores, and their autogroups' nice values (a session's autogroup is weighed as
    one task of that nice, whatever its tasks' policy)."""
    seen = idle = 0
    cores: set[int] = set()
    nices: set[int] = set()
    for proc in process_trees(pids):
        try:
            policy = os.sched_getscheduler(proc.pid)
            cores |= os.sched_getaffinity(proc.pid)
        except OSError:
            continue
        seen += 1
        idle += policy == os.SCHED_IDLE
        with contextlib.suppress(OSError, ValueError, IndexError):  # no autogroups here
            nices.add(int(Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1]))
    out = {"processes": seen, "sched_idle": idle, "cores": sorted(cores)}
    return out | {"autogroup_nice": sorted(nices)}


def cores_busy_s(cores: set[int]) -> float:
    """CPU seconds the cores ``cores`` have spent busy since boot, whoever ran (this machine's
    other work included): with the swarm's own CPU, what others took of the swarm's cores."""
    per_cpu = psutil.cpu_times(percpu=True)
    return sum(
        t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        for i, t in enumerate(per_cpu)
        if i in cores
    )


def cpu_snapshot(
    coord: psutil.Process, nodes: list[int], attackers: list[int], cores: set[int]
) -> dict[str, dict[int, float]]:
    """CPU seconds so far of each part of a local swarm, by process: the coordinator's own and
    its waits for a core, the learner, the scoring sandbox, each honest node and each attacker
    (with their descendants), and the busy time of the swarm's ``cores`` (key -1).
    :func:`cpu_pct` turns two into shares of one core."""
    learner_proc = learner(coord)
    snap: dict[str, dict[int, float]] = {
        "coordinator_cpu": {coord.pid: sum(coord.cpu_times()[:2])},
        "coordinator_runq_wait": {coord.pid: runq_wait_s(coord.pid)},
        "learner_cpu": {},
        "scoring_cpu": sandbox_cpu(coord),
        "honest_nodes_cpu": {pid: tree_cpu_s([pid]) for pid in nodes},
        "attackers_cpu": {pid: tree_cpu_s([pid]) for pid in attackers},
        "swarm_cores_busy": {-1: cores_busy_s(cores)},
        "time": {-1: time.time()},
    }
    if learner_proc is not None:
        with contextlib.suppress(psutil.Error):  # it ended meanwhile
            snap["learner_cpu"][learner_proc.pid] = sum(learner_proc.cpu_times()[:2])
    return snap


def cpu_pct(before: dict, after: dict) -> dict[str, float]:
    """Each part's CPU between two :func:`cpu_snapshot`\\ s in % of one core, and what others
    took of the swarm's cores. A process started in between counts from 0; one that ended in
    between is left out."""
    seconds = after["time"][-1] - before["time"][-1]
    out = {}
    for part, now in after.items():
        if part != "time":
            spent = sum(v - before[part].get(pid, 0.0) for pid, v in now.items())
            out[f"{part}_pct"] = 100.0 * spent / seconds
    # What the swarm's cores gave to neither the swarm nor the attackers (kept off them): this
    # machine's other work, and the benchmark's own process, asleep nearly all the time.
    out["others_on_swarm_cores_pct"] = out["swarm_cores_busy_pct"] - sum(
        out[f"{k}_cpu_pct"] for k in ("coordinator", "learner", "scoring", "honest_nodes")
    )
    return out
