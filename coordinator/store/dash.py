"""The store's reads for the operator dashboard: time series and the recent nodes.

:class:`DashReads` is one part of :class:`~echo.coordinator.store.Store` (see its docstring). It
writes nothing; its series read the indexes of schema 3 (``rollouts_job_time``,
``rejections_job_time``, ``rollouts_trained``), so a snapshot costs the window it shows, not the
job's whole history. What the dashboard makes of them is :mod:`echo.coordinator.dashboard.data`'s.
"""

from __future__ import annotations

from typing import Any

from echo.coordinator.store.db import Database


class DashReads(Database):
    """Per-job series binned by time, staleness by version, and the recently seen nodes."""

    def staleness_by_version(self, job_id: str) -> list[tuple[int, float, int]]:
        """(version, mean, max) staleness of the groups each version trained, as the learner
        counts it: trained into v by the policy v - 1, sampled at version u, stale by v - 1 - u."""
        rows = self._db.execute(
            "SELECT trained_version, AVG(trained_version - 1 - version),"
            " MAX(trained_version - 1 - version) FROM rollouts"
            " WHERE job_id=? AND trained_version IS NOT NULL AND status='trained'"
            " GROUP BY trained_version ORDER BY trained_version",
            (job_id,),
        ).fetchall()
        return [(int(r[0]), float(r[1]), int(r[2])) for r in rows]

    def groups_per_bin(self, job_id: str, start: float, bin_s: float) -> dict[int, int]:
        """Groups accepted for the job since ``start``, by bin of ``bin_s`` seconds."""
        rows = self._db.execute(
            "SELECT CAST((created_at - ?) / ? AS INTEGER), COUNT(*) FROM rollouts"
            " WHERE job_id=? AND created_at>=? GROUP BY 1",
            (start, bin_s, job_id, start),
        ).fetchall()
        return {int(r[0]): int(r[1]) for r in rows}

    def rejections_per_bin(
        self, job_id: str, start: float, bin_s: float
    ) -> list[tuple[int, str, int]]:
        """(bin, reason, count) of the job's rejections since ``start``."""
        rows = self._db.execute(
            "SELECT CAST((at - ?) / ? AS INTEGER), reason, COUNT(*) FROM rejections"
            " WHERE job_id=? AND at>=? GROUP BY 1, 2",
            (start, bin_s, job_id, start),
        ).fetchall()
        return [(int(r[0]), r[1], int(r[2])) for r in rows]

    def recent_nodes(self, since: float, limit: int) -> list[dict[str, Any]]:
        """The nodes heard from after ``since``, latest first, at most ``limit``: the fields
        the dashboard's node table shows."""
        rows = self._db.execute(
            "SELECT node_id, engine, tokens_per_s, version, last_seen, accepted, rejected,"
            " excluded FROM nodes WHERE last_seen>? ORDER BY last_seen DESC LIMIT ?",
            (since, limit),
        ).fetchall()
        return [
            {
                "node_id": r[0],
                "engine": r[1],
                "tokens_per_s": float(r[2]),
                "version": int(r[3]),
                "last_seen": float(r[4]),
                "accepted": int(r[5]),
                "rejected": int(r[6]),
                "excluded": bool(r[7]),
            }
            for r in rows
        ]

    def recent_rejections(self, node_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The node's latest logged rejections (job, lease, reason, when), newest first: what
        its volunteer sees beside its credit (rejected work earns nothing)."""
        rows = self._db.execute(
            "SELECT job_id, lease_id, reason, at FROM rejections WHERE node_id=?"
            " ORDER BY at DESC LIMIT ?",
            (node_id, limit),
        ).fetchall()
        return [{"job_id": r[0], "lease_id": r[1], "reason": r[2], "at": float(r[3])} for r in rows]
