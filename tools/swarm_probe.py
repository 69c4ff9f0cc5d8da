"""What a benchmark reads of a running local swarm's processes from outside them: the learner
among the coordinator's children, the scoring sandbox's CPU, a process's waits for a core
(``/proc`` schedstat), and py-spy samples of chosen processes over a stretch of time.

Used by benchmarks/attack.py per phase; nothing here changes the processes it looks at.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
