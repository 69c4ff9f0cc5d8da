"""Running a swarm tool (``python -m echo.tools.local_swarm`` or ``echo.tools.nat_swarm``) as
the end-to-end tests do: a separate process writing its logs and summary.json under ``--out``,
and a failed run failing the test with the tool's output and the end of every log, which is
where the cause of a swarm's failure is (a node's or the learner's traceback).

:class:`SwarmTool` starts a run in the background, so that a test module can start several
independent runs at once and each test waits for its own: a short run spends most of its wall
time waiting (processes starting, polls, the final sync), not on the CPU.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAIL = 3000  # characters of the output and of each log shown on a failure
# A run past its timeout gets SIGTERM (the tool then stops its swarm) and this long to exit.
STOP_GRACE_S = 30.0


class SwarmTool:
    """``python -m module --out out *args`` started from the repository root; :meth:`wait`
    waits for it, at most ``timeout`` seconds from the start, and fails the test on a non-zero
    exit as "``what`` failed" with the tool's stdout and stderr and every file under ``out``
    matching the glob ``logs`` (``**/*.log`` for the learner's too), each cut to its last TAIL
    characters. The tool's output goes to ``out``'s sibling files ``<name>.stdout`` and
    ``<name>.stderr`` (a pipe nobody reads would block a run started in the background)."""

    def __init__(
        self,
        module: str,
        out: Path,
        args: Sequence[str],
        *,
        timeout: float,
        what: str,
        logs: str = "*.log",
    ) -> None:
        self.out, self.what, self.logs = out, what, logs
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        out.parent.mkdir(parents=True, exist_ok=True)
        self.stdout = out.parent / f"{out.name}.stdout"
        self.stderr = out.parent / f"{out.name}.stderr"
        with open(self.stdout, "wb") as so, open(self.stderr, "wb") as se:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--out", str(out), *args],
                cwd=ROOT,
                stdout=so,
                stderr=se,
            )

    def wait(self) -> None:
        """Wait for the run (see the class docstring); raises subprocess.TimeoutExpired past
        the timeout, after stopping the tool."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise subprocess.TimeoutExpired(self.proc.args, self.timeout) from None
        if self.proc.returncode != 0:
            tails = "\n".join(
                f"--- {p.relative_to(self.out)}\n{p.read_text(errors='replace')[-TAIL:]}"
                for p in sorted(self.out.glob(self.logs))
            )
            out = self.stdout.read_text(errors="replace")[-TAIL:]
            err = self.stderr.read_text(errors="replace")[-TAIL:]
            pytest.fail(f"{self.what} failed ({self.proc.returncode}):\n{out}\n{err}\n{tails}")

    def stop(self) -> None:
        """End a run that is still going: SIGTERM, which the tool unwinds through the
        ``finally`` that stops its swarm, then SIGKILL after STOP_GRACE_S."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()


def run_swarm_tool(
    module: str,
    out: Path,
    args: Sequence[str],
    *,
    timeout: float,
    what: str,
    logs: str = "*.log",
) -> None:
    """Run the tool and wait for it (:class:`SwarmTool`)."""
    SwarmTool(module, out, args, timeout=timeout, what=what, logs=logs).wait()
