"""The local swarm tool ends a run whose coordinator died instead of polling it until --timeout.

A status poll that gets no answer for a minute is tried again (a starved machine answers late),
but a coordinator process that has exited will never answer: on 2026-12-07 one died of a full
disk and the tool polled it for 7 minutes, to its timeout.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_dead_coordinator_ends_the_run_long_before_its_timeout(tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = tmp_path / "tool.log"
    with open(log, "wb") as sink:
        tool = subprocess.Popen(
            [sys.executable, "-m", "echo.tools.local_swarm", "--out", str(out), "--quiet",
             "--nodes", "1", "--engines", "torch", "--steps", "400", "--timeout", "600"],
            cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    orphans: list[psutil.Process] = []  # the coordinator's learner, left behind by the kill
    try:
        deadline = time.monotonic() + 240
        while b"first trained version" not in log.read_bytes():
            assert tool.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no trained version in 240 s"
            time.sleep(1)
        (coord,) = [p for p in psutil.Process(tool.pid).children()
                    if "echo.coordinator.cli" in " ".join(p.cmdline())]
        orphans = coord.children(recursive=True)
        coord.kill()
        killed = time.monotonic()
        rc = tool.wait(timeout=180)
        text = log.read_text(errors="replace")
        assert rc != 0, text[-3000:]
        assert "the coordinator exited" in text, text[-3000:]
        # One status poll's retries (STATUS_TRIES x (10 s timeout + 2 s)) at most, not 600 s.
        assert time.monotonic() - killed < 120
    finally:
        if tool.poll() is None:
            tool.terminate()
            tool.wait(timeout=60)
        for p in orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
