"""The store's ``learner_epochs`` table: which learner of each job the coordinator vouches for.

A learner epoch is a number the coordinator issues each time it starts a job's learner (or its
operator hands the job to an external one, ``POST /v1/jobs/{id}/learner-epoch``): one more than
the last. Every request a learner sends carries the epoch it was given, and
:class:`~echo.coordinator.rpc.learner.LearnerRPC` refuses any other than the job's newest, so a
learner that was superseded (an orphan of a killed coordinator, a second copy on another host)
can neither take batches nor book a version, whatever version it reports. Epoch 0 means none was
ever issued; a job stays at 0 only while no learner of it was started or handed over.

The epoch is durable before it is handed out (one fsynced transaction), so a restarted
coordinator never issues a number an earlier learner already holds.

:class:`LearnerEpochs` is one part of the store, in the manner of
:mod:`~echo.coordinator.store.jobs`: ``class Store(..., LearnerEpochs)`` in
:mod:`echo.coordinator.store`.
"""

from __future__ import annotations

import sqlite3
import time

from echo.coordinator.store.db import Database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS learner_epochs (
    job_id TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL,         -- the newest issued; requests with any other are refused
    issued_at REAL NOT NULL
);
"""


class LearnerEpochs(Database):
    """Learner epochs per job; see the module docstring. Creates its table when constructed
    (``CREATE TABLE IF NOT EXISTS``: a database of an older build gains it without a
    migration, and nothing else reads it)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        conn.executescript(_SCHEMA)

    def issue_learner_epoch(self, job_id: str) -> int:
        """A new epoch for ``job_id``'s learner, larger than every one issued before (1 for the
        first); durable when this returns. Raises sqlite3 errors only."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO learner_epochs (job_id, epoch, issued_at) VALUES (?, 1, ?)"
                " ON CONFLICT(job_id) DO UPDATE SET epoch = epoch + 1,"
                " issued_at = excluded.issued_at",
                (job_id, time.time()),
            )
            row = db.execute(
                "SELECT epoch FROM learner_epochs WHERE job_id=?", (job_id,)
            ).fetchone()
        return int(row[0])

    def learner_epoch(self, job_id: str) -> int:
        """The newest epoch issued for ``job_id`` (0: none ever was)."""
        row = self._db.execute(
            "SELECT epoch FROM learner_epochs WHERE job_id=?", (job_id,)
        ).fetchone()
        return int(row[0]) if row else 0
