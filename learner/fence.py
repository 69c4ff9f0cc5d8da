"""One learner per job at a time: the job's ``learner.lock``, held for a learner's whole life.

A coordinator killed with SIGKILL leaves its learner running, orphaned; the next coordinator
starts another on the same job folder. The two must never write the checkpoints at once (nor
both report a version), so a learner takes the lock before it reads a checkpoint, waiting for
whoever holds it: the orphan exits at its next failed call to the dead coordinator (or once the
job is done), and the kernel frees its lock however it exits.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import trio

log = logging.getLogger("echo.learner")

# How often a learner waiting for the lock (an orphaned learner still running) tries it.
POLL_S = 0.2


async def hold(job_dir: Path) -> int:
    """Wait for and take the exclusive lock of the learner of the job in ``job_dir``; returns
    the open descriptor, which holds it until the process exits (keep it referenced).

    :raises OSError: the lock file cannot be opened.
    """
    fd = os.open(job_dir / "learner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    waited = 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if waited == 0.0:
                log.info("another learner of this job is still running; waiting for it")
            await trio.sleep(POLL_S)
            waited += POLL_S
    if waited:
        log.info("the previous learner exited after %.1f s", waited)
    return fd
