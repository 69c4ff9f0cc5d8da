"""A learner orphaned by a killed coordinator is fenced off from the next one (issue 13 item 5).

SIGKILL on a coordinator leaves its learner running; the restarted coordinator starts another
on the same job folder. The new learner must not touch the checkpoints (or report a version)
while the orphan lives: it waits on the job's learner lock, which the kernel frees when the
orphan exits, however it exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import trio

from echo.learner import fence

# The orphan: takes the lock as a learner does, says so, and lives until killed.
ORPHAN = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def _fence(job_dir: Path) -> float:
    """Seconds a new learner's fence waited in ``job_dir``."""
    t0 = time.monotonic()
    fd = trio.run(fence.hold, job_dir)
    os.close(fd)
    return time.monotonic() - t0


def test_a_new_learner_waits_for_the_orphan_to_die(tmp_path) -> None:
    orphan = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(tmp_path / "learner.lock")], stdout=subprocess.PIPE
    )
    try:
        assert orphan.stdout is not None and orphan.stdout.readline() == b"locked\n"
        threading.Timer(1.0, orphan.kill).start()  # SIGKILL: no clean-up of its own
        waited = _fence(tmp_path)
        assert 0.9 <= waited < 5.0, waited
    finally:
        orphan.kill()
        orphan.wait()


def test_no_orphan_no_wait(tmp_path) -> None:
    assert _fence(tmp_path) < 0.5
