"""Running a swarm tool (``python -m echo.tools.local_swarm`` or ``echo.tools.nat_swarm``) as
the end-to-end tests do: a separate process writing its logs and summary.json under ``--out``,
and a failed run failing the test with the tool's output and the end of every log, which is
where the cause of a swarm's failure is (a node's or the learner's traceback)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAIL = 3000  # characters of the output and of each log shown on a failure


def run_swarm_tool(
    module: str,
    out: Path,
    args: Sequence[str],
    *,
    timeout: float,
    what: str,
    logs: str = "*.log",
) -> None:
    """Run ``python -m module --out out *args`` from the repository root, at most ``timeout``
    seconds; on a non-zero exit, fail the test as "``what`` failed" with the tool's stdout and
    stderr and every file under ``out`` matching the glob ``logs`` (``**/*.log`` for the
    learner's too), each cut to its last TAIL characters."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tails = "\n".join(
            f"--- {p.relative_to(out)}\n{p.read_text(errors='replace')[-TAIL:]}"
            for p in sorted(out.glob(logs))
        )
        pytest.fail(
            f"{what} failed ({proc.returncode}):\n{proc.stdout[-TAIL:]}\n"
            f"{proc.stderr[-TAIL:]}\n{tails}"
        )
