"""The store's ``jobs`` and ``versions`` tables, and the per-job figures the HTTP API reports.

:class:`JobTables` is one part of :class:`~echo.coordinator.store.Store` (see its docstring for
the transaction rules). A job's version ledger is written by
:meth:`~echo.coordinator.store.ledger.Ledger.publish_version`, together with the rollouts that
went into it; this part reads it back and stamps when every active node held a version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from echo.coordinator.store.db import Database
from echo.coordinator.store.rows import JobRow, VersionRow, job_row, version_row
from echo.protocol import reasons as R


class JobTables(Database):
    """Jobs: their spec, status, learner and prompt counter; their published versions."""

    def create_job(self, job_id: str, name: str, spec: dict[str, Any]) -> None:
        """Record a new job as ``pending``; raises sqlite3.IntegrityError for a taken id."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, status, created_at, updated_at)"
                " VALUES (?, ?, ?, 'pending', ?, ?)",
                (job_id, name, json.dumps(spec), now, now),
            )

    def job(self, job_id: str) -> JobRow | None:
        """The job ``job_id``, or None."""
        row = self._db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return job_row(row) if row else None

    def jobs(self, statuses: Iterable[str] | None = None) -> list[JobRow]:
        """Every job (or those in ``statuses``), oldest first."""
        if statuses is None:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        else:
            st = list(statuses)
            marks = ",".join("?" * len(st))
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY created_at", st
            ).fetchall()
        return [job_row(r) for r in rows]

    def set_learner_key(self, job_id: str, pubkey: bytes) -> None:
        """Pin the key the job's learner signs with."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET learner_pubkey=? WHERE job_id=?", (pubkey, job_id))

    def set_job_status(self, job_id: str, status: str, error: str = "") -> None:
        """Move the job to ``status`` (with ``error`` for a failed one)."""
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET status=?, error=?, updated_at=? WHERE job_id=?",
                (status, error, time.time(), job_id),
            )

    def attach_learner(self, job_id: str, pubkey: bytes, peer_id: str, addrs: list[str]) -> None:
        """Record the learner's identity and put the job's in-flight batches back in the buffer.

        A (re)attaching learner has lost whatever batch it held in memory without reporting it,
        so those rollouts become trainable again.
        """
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET learner_pubkey=?, learner_peer_id=?, learner_addrs_json=?,"
                " status=CASE WHEN status='pending' THEN 'running' ELSE status END, updated_at=?"
                " WHERE job_id=?",
                (pubkey, peer_id, json.dumps(addrs), time.time(), job_id),
            )
            db.execute(
                "UPDATE rollouts SET status='accepted', batch_at=NULL"
                " WHERE job_id=? AND status='in_batch'",
                (job_id,),
            )

    def next_prompt_ids(self, job_id: str, n: int) -> list[int]:
        """Reserve the job's next ``n`` prompt ids; each id is handed out once.

        Committed without an fsync of its own (``Database._hint_tx``): the leases that carry
        these ids are stored next, and that commit's fsync of the WAL makes this one durable
        too before any lease leaves the coordinator. A power cut between the two loses both,
        and the ids are handed out again to leases nobody holds."""
        with self._hint_tx() as db:
            row = db.execute("SELECT next_prompt_id FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            start = int(row[0])
            db.execute("UPDATE jobs SET next_prompt_id=? WHERE job_id=?", (start + n, job_id))
        return list(range(start, start + n))

    # ------------------------------------------------------------------ versions

    def version(self, job_id: str, version: int) -> VersionRow | None:
        """Published version ``version`` of the job, or None."""
        row = self._db.execute(
            "SELECT * FROM versions WHERE job_id=? AND version=?", (job_id, version)
        ).fetchone()
        return version_row(row) if row else None

    def versions(self, job_id: str) -> list[VersionRow]:
        """The job's published versions, oldest first."""
        rows = self._db.execute(
            "SELECT * FROM versions WHERE job_id=? ORDER BY version", (job_id,)
        ).fetchall()
        return [version_row(r) for r in rows]

    def publish_times(self, job_id: str, n: int) -> list[float]:
        """When the job's ``n`` newest versions were published, newest first (primary key)."""
        rows = self._db.execute(
            "SELECT published_at FROM versions WHERE job_id=? ORDER BY version DESC LIMIT ?",
            (job_id, n),
        ).fetchall()
        return [float(r[0]) for r in rows]

    def mark_all_nodes(self, job_id: str, version: int, at: float) -> None:
        """Stamp the first time every active node held ``version``; later stamps are ignored."""
        with self._tx() as db:
            db.execute(
                "UPDATE versions SET all_nodes_at=? WHERE job_id=? AND version=?"
                " AND all_nodes_at IS NULL",
                (at, job_id, version),
            )

    # ------------------------------------------------------------------ reports

    def reward_by_version(self, job_id: str) -> list[tuple[int, float, int]]:
        """(version, mean reward, groups) of the job's untainted rollouts, by version: every
        group sampled, including those not trained on for having no advantage (without them
        the curve would read the filter, not the policy)."""
        rows = self._db.execute(
            "SELECT version, AVG(mean_reward), COUNT(*) FROM rollouts"
            " WHERE job_id=? AND (status IN ('accepted','in_batch','trained')"
            " OR (status='dropped' AND reason=?))"
            " GROUP BY version ORDER BY version",
            (job_id, R.UNIFORM),
        ).fetchall()
        return [(int(r[0]), float(r[1]), int(r[2])) for r in rows]

    def rollout_counts(self, job_id: str) -> dict[str, int]:
        """The job's rollouts by status, plus ``rejected_total`` (every logged rejection) and
        ``uniform`` (those of the dropped that were set aside for having no advantage)."""
        rows = self._db.execute(
            "SELECT status, COUNT(*), SUM(reason=?) FROM rollouts WHERE job_id=? GROUP BY status",
            (R.UNIFORM, job_id),
        ).fetchall()
        counts = {r[0]: int(r[1]) for r in rows}
        counts["uniform"] = sum(int(r[2] or 0) for r in rows if r[0] == "dropped")
        counts["rejected_total"] = int(
            self._db.execute(
                "SELECT COUNT(*) FROM rejections WHERE job_id=?", (job_id,)
            ).fetchone()[0]
        )
        return counts

    def job_rejection_counts(self, job_id: str) -> dict[str, int]:
        """The job's logged rejections by reason code (those of submissions too broken to name
        a job are counted only against their node)."""
        rows = self._db.execute(
            "SELECT reason, COUNT(*) FROM rejections WHERE job_id=?"
            " GROUP BY reason ORDER BY reason",
            (job_id,),
        ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def mean_tokens_per_rollout(self, job_id: str) -> float | None:
        """Mean tokens per completion of the job's unrejected rollouts (None before the first)."""
        row = self._db.execute(
            "SELECT SUM(tokens), COUNT(*) FROM rollouts WHERE job_id=? AND status != 'rejected'",
            (job_id,),
        ).fetchone()
        if not row[1]:
            return None
        job = self.job(job_id)
        assert job is not None  # its rollouts exist
        return row[0] / (row[1] * job.spec["group_size"])
