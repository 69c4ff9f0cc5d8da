"""The store's ``leases`` table: which prompt each node owes, and until when.

:class:`LeaseTables` is one part of :class:`~echo.coordinator.store.Store` (see its docstring for
the transaction rules). A lease is ``open`` until its group is submitted (accepted or not) or its
deadline passes; an accepted group closes its lease in the same transaction that stores it
(:meth:`~echo.coordinator.store.ledger.Ledger.accept_rollout`), so a lease yields one group at most.

A lease is *delivered* only when a group of it was accepted (its rollout row exists: a rollout is
stored under its lease's id). Every other lease that stopped being owed -- expired, or closed by
a rejected submission, a stale version's included -- counts against its node's quota
(:meth:`LeaseTables.undelivered_lease_count`) until the penalty window passes or the node has a
group accepted after it (a lease returned with a rejected group, for a time that grows with how
long the node held it). Nothing but an accepted group forgives: a stale-version submission,
which costs the node nothing to make, used to close its lease as "submitted" and so forgive every
lease of its grant (they share a deadline); hoarders kept a job's whole lease window that way.
"""

from __future__ import annotations

import time

from echo.coordinator.store.db import Database
from echo.coordinator.store.rows import LeaseRow, lease_row, lease_values


class LeaseTables(Database):
    """Leases: issued in bulk, closed once, expired by deadline."""

    def add_leases(self, rows: list[LeaseRow]) -> None:
        """Store newly issued leases, all or none."""
        with self._tx() as db:
            db.executemany(
                "INSERT INTO leases VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [lease_values(r) for r in rows],
            )

    def lease(self, lease_id: str) -> LeaseRow | None:
        """The lease ``lease_id``, or None."""
        row = self._db.execute("SELECT * FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        return lease_row(row) if row else None

    def expire_leases(self, now: float) -> int:
        """Expire the open leases whose deadline is before ``now``; returns how many."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE leases SET status='expired' WHERE status='open' AND deadline < ?", (now,)
            )
            return cur.rowcount

    def open_lease_count(self, job_id: str, node_id: str | None = None) -> int:
        """Open leases of the job (of one node, with ``node_id``)."""
        if node_id is None:
            q, args = "job_id=?", (job_id,)
        else:
            q, args = "job_id=? AND node_id=?", (job_id, node_id)
        return int(
            self._db.execute(
                f"SELECT COUNT(*) FROM leases WHERE status='open' AND {q}", args
            ).fetchone()[0]
        )

    def open_lease_count_fresh(self, job_id: str) -> int:
        """Open leases of the job held by nodes that never had a group accepted."""
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM leases JOIN nodes USING (node_id)"
                " WHERE leases.job_id=? AND leases.status='open' AND nodes.accepted=0",
                (job_id,),
            ).fetchone()[0]
        )

    def open_lease_count_unproven(self, job_id: str, proven_groups: int) -> int:
        """Open leases of the job held by nodes with fewer than ``proven_groups`` accepted."""
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM leases JOIN nodes USING (node_id)"
                " WHERE leases.job_id=? AND leases.status='open' AND nodes.accepted<?",
                (job_id, proven_groups),
            ).fetchone()[0]
        )

    def delivery_times(self, node_id: str, n: int) -> list[float]:
        """Seconds from issue to acceptance of the node's ``n`` newest accepted groups (its
        newest rollouts through ``rollouts_node``, each lease by its key); a group the learner's
        re-scoring rejected was no delivery."""
        rows = self._db.execute(
            "SELECT rollouts.created_at - leases.issued_at FROM rollouts"
            " JOIN leases ON leases.lease_id=rollouts.rollout_id"
            " WHERE rollouts.node_id=? AND rollouts.status!='rejected'"
            " ORDER BY rollouts.created_at DESC LIMIT ?",
            (node_id, n),
        ).fetchall()
        return [max(0.0, float(r[0])) for r in rows]

    def undelivered_lease_count(
        self,
        node_id: str,
        since: float,
        *,
        now: float | None = None,
        returned_min_s: float = 0.0,
        returned_factor: float = 0.0,
    ) -> int:
        """Leases the node took and did not deliver (let expire, or had a submission of them
        rejected) that stopped being owed at or after ``since`` and after the node's last group
        accepted by the coordinator (a later accepted group forgives what came before; one of the
        same grant does not, its siblings stop being owed after it). Indexed reads only
        (``leases_node``, ``rollouts_node``, the rollouts' key).

        With ``now``, a lease *returned* with a rejected submission counts only until
        ``returned_factor`` times as long as the node held it, at least ``returned_min_s``, after
        it was returned (never past ``since``'s window): a slow newcomer's first group that came
        back stale in 5 s costs it a short while, a hoarder that held its lease for 22 s and then
        sent a stale group a long one. A lease let expire counts for the whole window."""
        last = self._db.execute(
            # Walks the node's rollouts newest first: a rollout the learner's re-scoring rejected
            # was not valid work and forgives nothing.
            "SELECT created_at FROM rollouts WHERE node_id=? AND status!='rejected'"
            " ORDER BY created_at DESC LIMIT 1",
            (node_id,),
        ).fetchone()
        after = last[0] if last is not None else float("-inf")
        returned = ""
        args: tuple = (node_id, since, after)
        if now is not None:
            # A returned lease's deadline is when it was returned (close_lease), so deadline -
            # issued_at is how long the node held it.
            returned = (
                " AND (status='expired' OR deadline + MAX(?, ? * (deadline - issued_at)) >= ?)"
            )
            args += (returned_min_s, returned_factor, now)
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM leases WHERE node_id=? AND status IN ('expired','submitted')"
                " AND deadline>=? AND deadline>?" + returned + " AND NOT EXISTS"
                " (SELECT 1 FROM rollouts WHERE rollouts.rollout_id=leases.lease_id)",
                args,
            ).fetchone()[0]
        )

    def recent_deliveries(self, job_id: str, n: int) -> dict[str, int]:
        """Of the job's ``n`` newest groups accepted by the coordinator (those the learner's
        re-scoring rejected left out), how many each node delivered (``rollouts_job_time``)."""
        counts: dict[str, int] = {}
        for (node_id,) in self._db.execute(
            "SELECT node_id FROM rollouts WHERE job_id=? AND status!='rejected'"
            " ORDER BY created_at DESC LIMIT ?",
            (job_id, n),
        ):
            counts[node_id] = counts.get(node_id, 0) + 1
        return counts

    def has_open_lease(self, node_id: str) -> bool:
        """Whether the node holds any open lease (one indexed read: the submit path's gate)."""
        row = self._db.execute(
            "SELECT 1 FROM leases WHERE node_id=? AND status='open' LIMIT 1", (node_id,)
        ).fetchone()
        return row is not None

    def close_lease(self, lease_id: str) -> None:
        """Close an open lease whose submission was rejected: its prompt is not issued again.

        Its deadline becomes the time it was closed (no group will come for it any more): from
        then on it counts as undelivered, like a lease let expire, and only a group accepted
        after it forgives it (:meth:`undelivered_lease_count`). It stays ``submitted``, so a
        second submission of it is a duplicate."""
        with self._tx() as db:
            db.execute(
                "UPDATE leases SET status='submitted', deadline=MIN(deadline, ?)"
                " WHERE lease_id=? AND status='open'",
                (time.time(), lease_id),
            )
