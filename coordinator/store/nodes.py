"""The store's ``nodes``, ``rejections`` and ``node_versions`` tables: who works, and how well.

:class:`NodeTables` is one part of :class:`~echo.coordinator.store.Store` (see its docstring for
the transaction rules). A node's record is its reputation: accepted and rejected counts, the
streak of valid results that grows its lease quota, and the verification failures that exclude
it. Rejections found later by the learner's re-scoring are booked by
:meth:`~echo.coordinator.store.ledger.Ledger.publish_version` in the same transaction as the
version they were found for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from echo.coordinator.store.db import Database
from echo.coordinator.store.rows import NodeRow, node_row
from echo.protocol import reasons as R


class NodeTables(Database):
    """Registered nodes, their rejections and the versions they were seen to hold."""

    def upsert_node(
        self,
        node_id: str,
        public_key: bytes,
        engine: str,
        hardware: dict[str, Any],
        tokens_per_s: float,
        upload_bps: float,
        download_bps: float,
    ) -> NodeRow:
        """Register the node or refresh what it declared; its record of results is kept.

        A hint (see ``Database._hint_tx``: no fsync of its own): a new row holds no record yet
        and a refresh only what the node declares again at its next registration, so a power cut
        loses nothing a node cannot re-send, while an fsync per registration let a churn of free
        identities keep the disk busy."""
        now = time.time()
        with self._hint_tx() as db:
            db.execute(
                "INSERT INTO nodes (node_id, public_key, engine, hardware_json, tokens_per_s,"
                " upload_bps, download_bps, first_seen, last_seen) VALUES (?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT(node_id) DO UPDATE SET engine=excluded.engine,"
                " hardware_json=excluded.hardware_json, tokens_per_s=excluded.tokens_per_s,"
                " upload_bps=excluded.upload_bps, download_bps=excluded.download_bps,"
                " last_seen=excluded.last_seen",
                (
                    node_id,
                    public_key,
                    engine,
                    json.dumps(hardware),
                    tokens_per_s,
                    upload_bps,
                    download_bps,
                    now,
                    now,
                ),
            )
            return node_row(
                db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()
            )

    def node(self, node_id: str) -> NodeRow | None:
        """The node ``node_id``, or None if it never registered."""
        row = self._db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return node_row(row) if row else None

    def nodes(self) -> list[NodeRow]:
        """Every registered node, first registered first."""
        rows = self._db.execute("SELECT * FROM nodes ORDER BY first_seen").fetchall()
        return [node_row(r) for r in rows]

    def active_nodes(self, since: float) -> list[NodeRow]:
        """Nodes not excluded and heard from after ``since``, first registered first.

        One range read on the ``nodes_active`` index: the excluded and long-silent identities a
        churn leaves behind (kept until retention forgets them) are never read.
        """
        rows = self._db.execute(
            "SELECT * FROM nodes WHERE excluded=0 AND last_seen>? ORDER BY first_seen", (since,)
        ).fetchall()
        return [node_row(r) for r in rows]

    def active_behind(self, since: float, version: int) -> Iterator[str]:
        """Ids of the nodes not excluded, heard from after ``since``, that hold a version older
        than ``version``, read as the caller goes (the ``nodes_active`` range, one column: no
        rows built; a caller that stops at the first it needs reads no further)."""
        cur = self._db.execute(
            "SELECT node_id FROM nodes WHERE excluded=0 AND last_seen>? AND version<?",
            (since, version),
        )
        for (node_id,) in cur:
            yield node_id

    def proven_node_active(self, since: float, proven_groups: int) -> bool:
        """Whether a node not excluded, heard from after ``since``, has ``proven_groups``
        accepted groups (the ``nodes_active`` range, stopped at the first such node)."""
        row = self._db.execute(
            "SELECT 1 FROM nodes WHERE excluded=0 AND last_seen>? AND accepted>=? LIMIT 1",
            (since, proven_groups),
        ).fetchone()
        return row is not None

    def touch_node(
        self,
        node_id: str,
        *,
        version: int | None = None,
        digest: str = "",
        tokens_per_s: float | None = None,
    ) -> None:
        """The node was heard from now; with ``version``, it holds that version's ``digest``
        (a hint: a power cut may lose it, see ``Database._hint_tx``)."""
        with self._hint_tx() as db:
            db.execute("UPDATE nodes SET last_seen=? WHERE node_id=?", (time.time(), node_id))
            if version is not None:
                db.execute(
                    "UPDATE nodes SET version=?, state_digest=? WHERE node_id=?",
                    (version, digest, node_id),
                )
            if tokens_per_s is not None:
                db.execute(
                    "UPDATE nodes SET tokens_per_s=? WHERE node_id=?", (tokens_per_s, node_id)
                )

    def record_node_version(self, job_id: str, node_id: str, version: int) -> None:
        """Log the first time the node held ``version`` of the job (repeats are ignored; a hint
        that a power cut may lose)."""
        with self._hint_tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO node_versions VALUES (?, ?, ?, ?)",
                (job_id, node_id, version, time.time()),
            )

    def sync_lags(self, job_id: str, node_id: str, n: int) -> list[float]:
        """Seconds from publication until the node reported holding each of its ``n`` newest
        versions of the job, newest first; its first version there is left out (the node
        joined then: that wait was no sync). Primary-key reads only."""
        rows = self._db.execute(
            "SELECT nv.at - v.published_at FROM node_versions nv JOIN versions v"
            " ON v.job_id=nv.job_id AND v.version=nv.version"
            " WHERE nv.job_id=? AND nv.node_id=? AND nv.version>"
            " (SELECT MIN(version) FROM node_versions WHERE job_id=? AND node_id=?)"
            " ORDER BY nv.version DESC LIMIT ?",
            (job_id, node_id, job_id, node_id, n),
        ).fetchall()
        return [max(0.0, float(r[0])) for r in rows]

    def rejection_counts(self, node_id: str) -> dict[str, int]:
        """The node's logged rejections by reason code."""
        rows = self._db.execute(
            "SELECT reason, COUNT(*) FROM rejections WHERE node_id=? GROUP BY reason", (node_id,)
        ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def set_excluded(self, node_id: str, excluded: bool) -> None:
        """Exclude (or readmit) the node; excluding also expires its leases and drops its buffer.

        The time of exclusion is kept: retention forgets an excluded identity only a while after
        it (:meth:`~echo.coordinator.store.prune.Pruning.prune`)."""
        with self._tx() as db:
            db.execute(
                "UPDATE nodes SET excluded=?, excluded_at=? WHERE node_id=?",
                (int(excluded), time.time() if excluded else 0.0, node_id),
            )
            if excluded:
                # Its open leases go back to the pool at once rather than at their deadline.
                db.execute(
                    "UPDATE leases SET status='expired' WHERE node_id=? AND status='open'",
                    (node_id,),
                )
                # An excluded node's accepted-but-untrained work is no longer trusted.
                db.execute(
                    "UPDATE rollouts SET status='dropped', reason=?"
                    " WHERE node_id=? AND status='accepted'",
                    (R.NODE_EXCLUDED, node_id),
                )

    def record_rejection(
        self,
        job_id: str,
        node_id: str,
        lease_id: str,
        reason: str,
        detail: str,
        *,
        counts_against: bool,
    ) -> None:
        """Log a rejection; ``counts_against`` resets the node's streak (a verification failure)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO rejections (job_id, node_id, lease_id, reason, detail, at)"
                " VALUES (?,?,?,?,?,?)",
                (job_id, node_id, lease_id, reason, detail[:500], time.time()),
            )
            if counts_against:
                db.execute(
                    "UPDATE nodes SET rejected=rejected+1, streak=0, failures=failures+1"
                    " WHERE node_id=?",
                    (node_id,),
                )
            else:
                db.execute("UPDATE nodes SET rejected=rejected+1 WHERE node_id=?", (node_id,))
