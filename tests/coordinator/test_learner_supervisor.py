"""The coordinator's learner supervisor (coordinator/jobs/learners.py) against real processes.

Found by tests/e2e/test_chaos.py: the supervisor failed a job after its learner's fourth crash in
the coordinator's lifetime, however far apart, so a long job whose learner is killed now and
then (out of memory, an operator's kill) failed although it was making progress. Only crashes
in a row without a booked version count now.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

from echo.coordinator.jobs import learners
from tests.conftest import store_with_anchor

# A stand-in learner: books the next version in the real store, then crashes (exit 1), until
# the ledger reaches STOP_AT, where it exits cleanly. With PROGRESS=0 it crashes at once.
SCRIPT = """
import sys
from echo.coordinator.store import Store
db, progress, stop_at = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
store = Store.open(db)
v = store.job("j").current_version
if v >= stop_at:
    sys.exit(0)
if progress:
    store.publish_version("j", v + 1, kind="patch", manifest=b"m", state_digest=f"d{v + 1}",
                          total_size=1, trained=[], rejected=[], metrics={})
sys.exit(1)
"""


class _Host:
    """A :class:`~echo.coordinator.api.ports.LearnerHost` that starts the stand-in learner."""

    def __init__(self, tmp: Path, progress: bool, stop_at: int) -> None:
        self.db = tmp / "c.db"
        self.store = store_with_anchor(self.db)
        self.store.set_job_status("j", "running")
        self.tmp, self.progress, self.stop_at = tmp, progress, stop_at

    def job_dir(self, job_id: str) -> Path:
        return self.tmp

    def learner_command(self, job_id: str) -> list[str]:
        flag = "1" if self.progress else "0"
        return [sys.executable, "-c", SCRIPT, str(self.db), flag, str(self.stop_at)]


def _supervise(host: _Host) -> None:
    trio.run(learners.supervise_learner, host, "j", trio.CancelScope())


def test_crashes_between_booked_versions_never_fail_the_job(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(learners, "RESTART_DELAY_S", 0.0)
    stop_at = learners.MAX_RESTARTS + 3  # more crashes than the limit, each after progress
    host = _Host(tmp_path, progress=True, stop_at=stop_at)
    _supervise(host)
    row = host.store.job("j")
    assert row.status == "running" and row.current_version == stop_at, (row.status, row.error)


def test_a_learner_crashing_without_progress_fails_the_job(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(learners, "RESTART_DELAY_S", 0.0)
    host = _Host(tmp_path, progress=False, stop_at=100)
    _supervise(host)
    row = host.store.job("j")
    assert row.status == "failed" and "in a row without progress" in row.error
    assert row.current_version == 0


def test_a_learner_asked_for_a_device_it_lacks_is_not_restarted(tmp_path: Path) -> None:
    """The real learner, asked for a device this machine cannot compute on, exits with the
    status that fails the job at once (a restart would fail alike), saying why."""
    proc = subprocess.run(
        [sys.executable, "-m", "echo.learner", "--job-dir", str(tmp_path), "--job-id", "j",
         "--coordinator", "/ip4/127.0.0.1/tcp/1", "--device", "gpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == learners.LEARNER_CANNOT_RESUME, proc.stderr[-2000:]
    assert "device must be auto, cpu, mps, cuda or cuda:N, not 'gpu'" in proc.stderr
