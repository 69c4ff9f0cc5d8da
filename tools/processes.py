"""The processes of a local run: started in sessions of their own with their log, stopped with
SIGINT then SIGKILL, and a script that unwinds through its ``finally`` on SIGTERM.

Used by :mod:`echo.tools.swarm`, :mod:`echo.tools.local_swarm` and the benchmarks that run real
processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def exit_on_sigterm() -> None:
    """Make SIGTERM (kill, timeout, a benchmark cut short) unwind this script like Ctrl-C, through
    the ``finally`` that stops its swarm. The swarm's processes run in sessions of their own, so
    a signal to this script alone reaches none of them, and Python's default for SIGTERM exits
    without running ``finally``: they were left running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def new_run_dir(out: Path) -> Path:
    """``out``, created, for a new run; SystemExit with a message when it holds an earlier run's
    coordinator data (started there, the coordinator would resume that run's jobs beside the
    new one)."""
    out = out.resolve()
    if (out / "coordinator" / "coordinator.sqlite").exists():
        raise SystemExit(f"{out} holds an earlier run (its coordinator would resume that run's "
                         "jobs): choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}; see its log")
        time.sleep(0.1)
    raise TimeoutError(f"coordinator did not start within {timeout} s")
