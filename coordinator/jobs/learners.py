"""Supervision of a job's local learner subprocess.

:func:`supervise_learner` owns the learner process of one job: it starts it, writes its output
to ``<job dir>/learner.log``, restarts it after a crash (the learner resumes from its last
checkpoint, and the rollouts it held in memory go back to the buffer when it re-attaches), and
marks the job failed after too many crashes. Each start gets a new learner epoch
(``host.learner_command``), which fences every earlier learner of the job; one that exits
because a newer learner holds the job is not restarted. Cancelling ``scope`` terminates the
process (SIGTERM, then SIGKILL after trio's grace period).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import trio

from echo.coordinator.api.ports import LearnerHost

log = logging.getLogger("echo.coordinator.jobs.learners")

# A learner that keeps crashing without progress has a real problem (bad model path, out of
# memory); three restarts in a row cover transient failures without hiding a broken job for long.
MAX_RESTARTS = 3
# A learner exits with this status when a restart cannot help (its checkpoints are behind the
# ledger: learner/service.py, EXIT_CANNOT_RESUME): the job fails at once, with the reason.
LEARNER_CANNOT_RESUME = 3
# A learner exits with this status when the coordinator refused its learner epoch: a newer
# learner holds the job (an external one its operator handed it to; learner/service.py,
# EXIT_SUPERSEDED). Restarting would take the job back from it, so supervision ends, the job
# still running under the newer learner.
LEARNER_SUPERSEDED = 4
RESTART_DELAY_S = 2.0


def tail(path: Path, n: int = 20) -> str:
    """The last ``n`` lines of the text file at ``path`` ("" if it does not exist yet)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


async def supervise_learner(host: LearnerHost, job_id: str, scope: trio.CancelScope) -> None:
    """Run the job's learner until it exits cleanly, the job ends, or ``scope`` is cancelled.

    A crash is retried :data:`MAX_RESTARTS` times in a row (a learner that booked a version
    before crashing starts the count again), then the job is marked failed with the log's
    tail. Raises OSError if the log cannot be opened or the learner cannot be started.
    """
    log_path = host.job_dir(job_id) / "learner.log"
    with scope:
        crashes = 0  # in a row, without a version booked in between
        while True:
            started_at = _version(host, job_id)
            command = host.learner_command(job_id)
            with open(log_path, "ab") as out:
                proc = await trio.run_process(
                    command, check=False, stdout=out, stderr=subprocess.STDOUT
                )
            row = host.store.job(job_id)
            assert row is not None  # jobs are never deleted
            status = row.status
            returncode, why = exit_status(proc.returncode, command, host.job_dir(job_id))
            if returncode == 0 or status in ("done", "cancelled"):
                log.info("learner of %s exited (%s)", job_id, status)
                return
            if returncode == LEARNER_SUPERSEDED:
                log.warning("learner of %s was superseded by a newer one; not restarting", job_id)
                return
            if returncode == LEARNER_CANNOT_RESUME:
                why = why or tail(log_path, 4)
                host.store.set_job_status(job_id, "failed", why)
                log.error("learner of %s cannot resume:\n%s", job_id, why)
                return
            # A learner that booked versions before it crashed is not crash-looping: a long job
            # may lose its learner now and then (out of memory, a kill) and must not fail for
            # crashes days apart.
            crashes = 1 if row.current_version > started_at else crashes + 1
            if crashes > MAX_RESTARTS:
                break
            log.warning(
                "learner of %s crashed (exit %s), %d in a row:\n%s",
                job_id,
                returncode,
                crashes,
                tail(log_path, 8),
            )
            await trio.sleep(RESTART_DELAY_S)
        host.store.set_job_status(
            job_id,
            "failed",
            f"learner crashed {crashes} times in a row without progress:\n" + tail(log_path),
        )


def exit_status(returncode: int, command: list[str], job_dir: Path) -> tuple[int, str]:
    """The learner's own exit status, and why it exited if it said ("" if not). An FSDP2
    learner runs under torchrun, which exits 1 whichever status a rank had; its rank 0 leaves
    the one that matters, its learner epoch and its reason in ``learner.exit``
    (learner/fsdp/ranks.py). One left by an earlier learner of the job (an orphan exiting superseded
    after this one started) names another epoch and is ignored."""
    if returncode == 0 or "--epoch" not in command:
        return returncode, ""
    try:
        head, _, why = (job_dir / "learner.exit").read_text().partition("\n")
        code, epoch = head.split()
        if epoch == command[command.index("--epoch") + 1]:
            return int(code), why.strip()
    except (OSError, ValueError, IndexError):
        pass
    return returncode, ""


def _version(host: LearnerHost, job_id: str) -> int:
    row = host.store.job(job_id)
    assert row is not None  # jobs are never deleted
    return row.current_version
