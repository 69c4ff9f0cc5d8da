"""CPU over one timed window of a benchmark: how much of the machine a set of processes used,
how busy the whole machine was (other jobs included), and how long the processes' event loops
waited for a core per second they ran (``/proc/<pid>/schedstat`` of their main threads).

On a machine shared with other work the last figure says whether a timing measured the links
or the contention for cores; ``benchmarks/broadcast.py`` prints all three with every run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import trio


class CpuMeter:
    """CPU over a window: the agents' own share of the machine (100% = every core busy with
    them), and the whole machine's utilisation (average, and peak of 0.5 s samples; it includes
    anything else running on the machine)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.samples: list[float] = []
        self.start = psutil.cpu_times()
        self.t0 = time.monotonic()
        self.procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                self.procs.append((proc, proc.cpu_times()))
            except psutil.Error:
                continue

    @staticmethod
    def _schedstat(pids: Sequence[int]) -> tuple[float, float]:
        """(seconds on CPU, seconds runnable but waiting for a CPU) of the agents' main threads
        (the event loops; worker threads come and go and would take their counts with them)."""
        run = wait = 0.0
        for pid in pids:
            try:
                on, delay, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            run += int(on) / 1e9
            wait += int(delay) / 1e9
        return run, wait

    def start_sched(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.sched0 = self._schedstat(self.pids)

    def sched_wait_ratio(self) -> float:
        """Run-queue wait per second of CPU our agents got: ~0 on an idle machine; above 1 means
        they spent longer waiting for a core than running (the machine, not the links, limits)."""
        run, wait = self._schedstat(self.pids)
        d_run, d_wait = run - self.sched0[0], wait - self.sched0[1]
        return d_wait / d_run if d_run > 0 else 0.0

    def agents_pct(self) -> float:
        used = 0.0
        for proc, before in self.procs:
            try:
                now = proc.cpu_times()
            except psutil.Error:
                continue
            used += (now.user - before.user) + (now.system - before.system)
        wall = time.monotonic() - self.t0
        return 100.0 * used / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0

    async def sample(self) -> None:
        psutil.cpu_percent(interval=None)
        while True:
            await trio.sleep(0.5)
            self.samples.append(psutil.cpu_percent(interval=None))

    def result(self) -> tuple[float, float]:
        end = psutil.cpu_times()
        busy = sum(getattr(end, f) - getattr(self.start, f) for f in end._fields
                   if f not in ("idle", "iowait", "guest", "guest_nice"))
        total = busy + (end.idle - self.start.idle) + (
            getattr(end, "iowait", 0.0) - getattr(self.start, "iowait", 0.0))
        avg = 100.0 * busy / total if total > 0 else 0.0
        return avg, max(self.samples, default=avg)
