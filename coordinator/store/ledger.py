"""The store's ``rollouts`` and ``completions`` tables: the life of every accepted group.

:class:`Ledger` is one part of :class:`~echo.coordinator.store.Store` (see its docstring for the
transaction rules) and owns every move of a rollout: ``accepted -> in_batch -> trained`` (or
``rejected`` / ``dropped``). A group is stored when it is accepted in the form the learner trains
on -- an encoded :class:`~echo.protocol.messages.TrainingGroup` of its prompt, completions and
recomputed rewards -- so a batch hands out stored bytes and decodes nothing. The node's signed
envelope is kept beside it for audit only (who signed what was trained: ``tests/e2e/test_e2e.py``
re-verifies it).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time

from echo.coordinator.store.db import Database, StoreError
from echo.coordinator.store.rows import BatchRow, RolloutRow, rollout_row
from echo.protocol import reasons as R

log = logging.getLogger("echo.coordinator.store")

# Learner verdicts that drop a rollout without holding it against its node: the learner could
# not score it (it restarted and no longer holds the weights of the version it claims).
NOT_THE_NODES_FAULT = frozenset({R.UNSCORABLE})


class Ledger(Database):
    """Rollouts from acceptance to the version that trained them."""

    def accept_rollout(
        self,
        *,
        lease_id: str,
        job_id: str,
        node_id: str,
        version: int,
        prompt_id: int,
        engine: str,
        group: bytes,
        rewards: list[float],
        tokens: int,
        content_hash: bytes,
        envelope: bytes,
        buffered: bool = True,
        received_at: float | None = None,
    ) -> None:
        """Store an accepted group (``group``: its encoded TrainingGroup) and close its lease,
        atomically.

        ``buffered=False`` stores it ``dropped`` with reason ``uniform`` instead of buffering it
        for a batch: valid work its node is credited for, with no advantage to train on.
        ``received_at``: when the group arrived (the caller checked its node admitted and its
        lease open and in time then). Scoring comes between that check and this write, and
        meanwhile housekeeping may expire the lease at its deadline, or the node may be
        excluded (its leases expired with it, by a learner's report of its earlier groups).
        Decided here, in the transaction that stores the group: an excluded node's group is
        refused (StoreError(R.NODE_EXCLUDED)), never stored; a lease expired with a deadline
        not before ``received_at`` still takes the group (the delay was the coordinator's, and
        its prompt id is never issued again). None: only an open lease takes it.
        Raises StoreError(R.DUPLICATE) if the lease was already used or the same content was
        already accepted for this job; the caller turns a StoreError into a rejection with the
        reason it carries.
        """
        now = time.time()
        status, reason = ("accepted", "") if buffered else ("dropped", R.UNIFORM)
        with self._tx() as db:
            if db.execute(
                "SELECT 1 FROM nodes WHERE node_id=? AND excluded=1", (node_id,)
            ).fetchone():
                raise StoreError(R.NODE_EXCLUDED)
            in_time = "status='open'"
            args: tuple = (lease_id,)
            if received_at is not None:
                in_time = "(status='open' OR (status='expired' AND deadline>=?))"
                args = (lease_id, received_at)
            cur = db.execute(
                f"UPDATE leases SET status='submitted' WHERE lease_id=? AND {in_time}", args
            )
            if cur.rowcount != 1:
                raise StoreError(R.DUPLICATE)
            try:
                db.execute(
                    "INSERT INTO rollouts (rollout_id, job_id, node_id, version, prompt_id,"
                    " engine, status, reason, rewards_json, mean_reward, tokens, content_hash,"
                    " envelope, created_at, training_group) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        lease_id,
                        job_id,
                        node_id,
                        version,
                        prompt_id,
                        engine,
                        status,
                        reason,
                        json.dumps(rewards),
                        sum(rewards) / len(rewards),
                        tokens,
                        content_hash,
                        envelope,
                        now,
                        group,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError(R.DUPLICATE) from exc
            db.execute(
                "UPDATE nodes SET accepted=accepted+1, streak=streak+1 WHERE node_id=?",
                (node_id,),
            )

    def rollout_node(self, rollout_id: str) -> str | None:
        """The node that produced the rollout, or None."""
        row = self._db.execute(
            "SELECT node_id FROM rollouts WHERE rollout_id=?", (rollout_id,)
        ).fetchone()
        return row[0] if row else None

    def uniform_count(self, job_id: str, version: int) -> int:
        """Groups sampled at ``version`` that were not buffered for having no advantage."""
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM rollouts WHERE job_id=? AND version=?"
                " AND status='dropped' AND reason=?",
                (job_id, version, R.UNIFORM),
            ).fetchone()[0]
        )

    def buffered_count(self, job_id: str) -> int:
        """Groups accepted for the job and not yet trained (buffered or in a batch)."""
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM rollouts"
                " WHERE job_id=? AND status IN ('accepted','in_batch')",
                (job_id,),
            ).fetchone()[0]
        )

    def take_batch(self, job_id: str, max_groups: int, min_version: int) -> list[BatchRow]:
        """Move up to ``max_groups`` trainable groups to ``in_batch`` and return them, oldest first.

        Groups older than ``min_version`` are dropped as stale in the same transaction.
        """
        now = time.time()
        with self._tx() as db:
            db.execute(
                "UPDATE rollouts SET status='dropped', reason='stale'"
                " WHERE job_id=? AND status='accepted' AND version < ?",
                (job_id, min_version),
            )
            rows = [
                BatchRow(rollout_row(r), bytes(r["training_group"]))
                for r in db.execute(
                    "SELECT * FROM rollouts WHERE job_id=? AND status='accepted'"
                    " ORDER BY created_at LIMIT ?",
                    (job_id, max_groups),
                ).fetchall()
            ]
            db.executemany(
                "UPDATE rollouts SET status='in_batch', batch_at=? WHERE rollout_id=?",
                [(now, r.rollout.rollout_id) for r in rows],
            )
            return rows

    def publish_version(
        self,
        job_id: str,
        version: int,
        *,
        kind: str,
        manifest: bytes,
        state_digest: str,
        total_size: int,
        trained: list[str],
        rejected: list[tuple[str, str, str]],
        metrics: dict[str, float],
    ) -> None:
        """Record version ``version`` and the ledger of what went into it, in one transaction.

        ``trained`` rollouts must be in_batch for this job; ``rejected`` are (rollout_id, reason,
        detail) that failed the learner's re-scoring. A repeated report of the same version with
        the same digest is accepted as a no-op (the learner re-sends after a restart). Raises
        StoreError, changing nothing, for an unknown job, a version that does not follow the
        current one, or another digest for a published version; a trained rollout that is not
        trainable here (unknown, or trained already) is logged and left out.
        """
        now = time.time()
        with self._tx() as db:
            job = db.execute(
                "SELECT current_version FROM jobs WHERE job_id=?", (job_id,)
            ).fetchone()
            if job is None:
                raise StoreError(f"unknown job {job_id}")
            prev = db.execute(
                "SELECT state_digest FROM versions WHERE job_id=? AND version=?", (job_id, version)
            ).fetchone()
            if prev is not None:
                if prev[0] != state_digest:
                    raise StoreError(f"version {version} already published with another digest")
                return
            if version != int(job[0]) + 1:
                raise StoreError(f"version {version} does not follow the current version {job[0]}")
            for rid in trained:
                # 'accepted' and 'dropped' too: a learner that crashed after checkpointing v but
                # before reporting it re-attaches (which returns its batch to the buffer, where
                # groups may be dropped as stale) and re-sends the report of v. The weights hold
                # what the report names whatever its state here, so the version is booked in any
                # case (refusing it would wedge the job); a group already trained or unknown is
                # not credited twice, and said so.
                cur = db.execute(
                    "UPDATE rollouts SET status='trained', trained_version=?, reason=''"
                    " WHERE rollout_id=? AND job_id=?"
                    " AND status IN ('in_batch', 'accepted', 'dropped')",
                    (version, rid, job_id),
                )
                if cur.rowcount != 1:
                    log.warning(
                        "v%d of %s names rollout %s, which was not trainable here: "
                        "booked without it",
                        version,
                        job_id,
                        rid,
                    )
            for rid, reason, detail in rejected:
                row = db.execute(
                    "SELECT node_id FROM rollouts WHERE rollout_id=? AND job_id=?", (rid, job_id)
                ).fetchone()
                if row is None:
                    continue
                if reason in NOT_THE_NODES_FAULT:
                    db.execute(
                        "UPDATE rollouts SET status='dropped', reason=? WHERE rollout_id=?",
                        (reason, rid),
                    )
                    continue
                db.execute(
                    "UPDATE rollouts SET status='rejected', reason=? WHERE rollout_id=?",
                    (reason, rid),
                )
                db.execute(
                    "INSERT INTO rejections (job_id, node_id, lease_id, reason, detail, at)"
                    " VALUES (?,?,?,?,?,?)",
                    (job_id, row[0], rid, reason, detail[:500], now),
                )
                db.execute(
                    "UPDATE nodes SET rejected=rejected+1, accepted=MAX(accepted-1, 0), streak=0,"
                    " failures=failures+1 WHERE node_id=?",
                    (row[0],),
                )
            # Whatever the learner took but neither trained nor rejected goes back to the buffer.
            db.execute(
                "UPDATE rollouts SET status='accepted', batch_at=NULL"
                " WHERE job_id=? AND status='in_batch'",
                (job_id,),
            )
            db.execute(
                "INSERT INTO versions (job_id, version, kind, manifest, state_digest, total_size,"
                " trained_count, metrics_json, published_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    job_id,
                    version,
                    kind,
                    manifest,
                    state_digest,
                    total_size,
                    len(trained),
                    json.dumps(metrics),
                    now,
                ),
            )
            db.execute(
                "UPDATE jobs SET current_version=?, updated_at=? WHERE job_id=?",
                (version, now, job_id),
            )

    def trained_rollouts(self, job_id: str) -> list[RolloutRow]:
        """The job's trained rollouts, in the order of the versions that trained them."""
        rows = self._db.execute(
            "SELECT * FROM rollouts WHERE job_id=? AND status='trained' ORDER BY trained_version",
            (job_id,),
        ).fetchall()
        return [rollout_row(r) for r in rows]
