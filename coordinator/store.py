"""The coordinator's durable state in one SQLite database.

Owns the schema and every transaction that moves a rollout through its life:
``accepted -> in_batch -> trained`` (or ``rejected`` / ``dropped``). Each method is one
transaction, so a crash at any point leaves either the old or the new state, never half of one:
nothing accepted is lost, and nothing is trained twice (a rollout is marked trained in the same
transaction that records the version it went into).

SQLite calls are short and local; they run on the trio thread deliberately (a thread hop would
cost more than the query).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    status TEXT NOT NULL,               -- pending | running | done | cancelled | failed
    error TEXT NOT NULL DEFAULT '',
    learner_pubkey BLOB,
    learner_peer_id TEXT NOT NULL DEFAULT '',
    learner_addrs_json TEXT NOT NULL DEFAULT '[]',
    current_version INTEGER NOT NULL DEFAULT -1,
    next_prompt_id INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    public_key BLOB NOT NULL,
    engine TEXT NOT NULL,
    hardware_json TEXT NOT NULL,
    tokens_per_s REAL NOT NULL DEFAULT 0,
    upload_bps REAL NOT NULL DEFAULT 0,
    download_bps REAL NOT NULL DEFAULT 0,
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    streak INTEGER NOT NULL DEFAULT 0,   -- consecutive valid results (reputation)
    failures INTEGER NOT NULL DEFAULT 0, -- verification failures (not transport noise)
    excluded INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT -1,
    state_digest TEXT NOT NULL DEFAULT '',
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    prompt_id INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    issued_at REAL NOT NULL,
    deadline REAL NOT NULL,
    status TEXT NOT NULL                 -- open | submitted | expired
);
CREATE INDEX IF NOT EXISTS leases_open ON leases (job_id, status);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,          -- = lease_id: one submission per lease
    job_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    prompt_id INTEGER NOT NULL,
    status TEXT NOT NULL,                 -- accepted | in_batch | trained | rejected | dropped
    reason TEXT NOT NULL DEFAULT '',
    rewards_json TEXT NOT NULL,
    mean_reward REAL NOT NULL,
    tokens INTEGER NOT NULL,
    content_hash BLOB NOT NULL,
    envelope BLOB NOT NULL,
    created_at REAL NOT NULL,
    batch_at REAL,
    trained_version INTEGER
);
CREATE INDEX IF NOT EXISTS rollouts_job_status ON rollouts (job_id, status, created_at);
CREATE UNIQUE INDEX IF NOT EXISTS rollouts_content ON rollouts (job_id, content_hash);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS rejections_node ON rejections (node_id, reason);
CREATE TABLE IF NOT EXISTS versions (
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    kind TEXT NOT NULL,
    manifest BLOB NOT NULL,
    state_digest TEXT NOT NULL,
    total_size INTEGER NOT NULL,
    trained_count INTEGER NOT NULL,
    metrics_json TEXT NOT NULL,
    published_at REAL NOT NULL,
    all_nodes_at REAL,
    PRIMARY KEY (job_id, version)
);
CREATE TABLE IF NOT EXISTS node_versions (
    job_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job_id, node_id, version)
);
"""


# Learner verdicts that drop a rollout without holding it against its node: the learner could
# not score it (it restarted and no longer holds the weights of the version it claims).
NOT_THE_NODES_FAULT = frozenset({"unscorable"})


class StoreError(RuntimeError):
    """A state transition that the stored state does not allow."""


@dataclass(frozen=True, slots=True)
class LeaseRow:
    lease_id: str
    job_id: str
    node_id: str
    prompt_id: int
    group_size: int
    max_new_tokens: int
    seed: int
    min_version: int
    issued_at: float
    deadline: float
    status: str


class Store:
    """One SQLite database file; open with :meth:`open`, close with :meth:`close`."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._db = conn

    @classmethod
    def open(cls, path: Path | str) -> Store:
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: an accepted rollout is acknowledged to its node only after it is on disk.
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.executescript(_SCHEMA)
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise StoreError(
                f"database {path} has schema {row[0]}, this build expects {SCHEMA_VERSION}"
            )
        return cls(conn)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------ jobs

    def create_job(self, job_id: str, name: str, spec: dict[str, Any]) -> None:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, status, created_at, updated_at)"
                " VALUES (?, ?, ?, 'pending', ?, ?)",
                (job_id, name, json.dumps(spec), now, now),
            )

    def job(self, job_id: str) -> sqlite3.Row | None:
        return self._db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()

    def jobs(self, statuses: Iterable[str] | None = None) -> list[sqlite3.Row]:
        if statuses is None:
            return self._db.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        st = list(statuses)
        marks = ",".join("?" * len(st))
        return self._db.execute(
            f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY created_at", st
        ).fetchall()

    def set_learner_key(self, job_id: str, pubkey: bytes) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET learner_pubkey=? WHERE job_id=?", (pubkey, job_id))

    def set_job_status(self, job_id: str, status: str, error: str = "") -> None:
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
        with self._tx() as db:
            row = db.execute("SELECT next_prompt_id FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            start = int(row[0])
            db.execute("UPDATE jobs SET next_prompt_id=? WHERE job_id=?", (start + n, job_id))
        return list(range(start, start + n))

    # ------------------------------------------------------------------ nodes

    def upsert_node(
        self,
        node_id: str,
        public_key: bytes,
        engine: str,
        hardware: dict[str, Any],
        tokens_per_s: float,
        upload_bps: float,
        download_bps: float,
    ) -> sqlite3.Row:
        now = time.time()
        with self._tx() as db:
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
            return db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()

    def node(self, node_id: str) -> sqlite3.Row | None:
        return self._db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()

    def nodes(self) -> list[sqlite3.Row]:
        return self._db.execute("SELECT * FROM nodes ORDER BY first_seen").fetchall()

    def touch_node(
        self,
        node_id: str,
        *,
        version: int | None = None,
        digest: str = "",
        tokens_per_s: float | None = None,
    ) -> None:
        with self._tx() as db:
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
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO node_versions VALUES (?, ?, ?, ?)",
                (job_id, node_id, version, time.time()),
            )

    def rejection_counts(self, node_id: str) -> dict[str, int]:
        rows = self._db.execute(
            "SELECT reason, COUNT(*) FROM rejections WHERE node_id=? GROUP BY reason", (node_id,)
        ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def set_excluded(self, node_id: str, excluded: bool) -> None:
        with self._tx() as db:
            db.execute("UPDATE nodes SET excluded=? WHERE node_id=?", (int(excluded), node_id))
            if excluded:
                # Its open leases go back to the pool at once rather than at their deadline.
                db.execute(
                    "UPDATE leases SET status='expired' WHERE node_id=? AND status='open'",
                    (node_id,),
                )
                # An excluded node's accepted-but-untrained work is no longer trusted.
                db.execute(
                    "UPDATE rollouts SET status='dropped', reason='node_excluded'"
                    " WHERE node_id=? AND status='accepted'",
                    (node_id,),
                )

    # ------------------------------------------------------------------ leases

    def add_leases(self, rows: list[LeaseRow]) -> None:
        with self._tx() as db:
            db.executemany(
                "INSERT INTO leases VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        r.lease_id,
                        r.job_id,
                        r.node_id,
                        r.prompt_id,
                        r.group_size,
                        r.max_new_tokens,
                        r.seed,
                        r.min_version,
                        r.issued_at,
                        r.deadline,
                        r.status,
                    )
                    for r in rows
                ],
            )

    def lease(self, lease_id: str) -> LeaseRow | None:
        row = self._db.execute("SELECT * FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        return LeaseRow(**dict(row)) if row else None

    def expire_leases(self, now: float) -> int:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE leases SET status='expired' WHERE status='open' AND deadline < ?", (now,)
            )
            return cur.rowcount

    def open_lease_count(self, job_id: str, node_id: str | None = None) -> int:
        if node_id is None:
            q, args = "job_id=?", (job_id,)
        else:
            q, args = "job_id=? AND node_id=?", (job_id, node_id)
        return int(
            self._db.execute(
                f"SELECT COUNT(*) FROM leases WHERE status='open' AND {q}", args
            ).fetchone()[0]
        )

    # ------------------------------------------------------------------ rollouts

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

    def accept_rollout(
        self,
        *,
        lease_id: str,
        job_id: str,
        node_id: str,
        version: int,
        prompt_id: int,
        rewards: list[float],
        tokens: int,
        content_hash: bytes,
        envelope: bytes,
    ) -> None:
        """Store an accepted group and close its lease, atomically.

        Raises StoreError('duplicate') if the lease was already used or the same content was
        already accepted for this job; the caller turns that into a rejection.
        """
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "UPDATE leases SET status='submitted' WHERE lease_id=? AND status='open'",
                (lease_id,),
            )
            if cur.rowcount != 1:
                raise StoreError("duplicate")
            try:
                db.execute(
                    "INSERT INTO rollouts (rollout_id, job_id, node_id, version, prompt_id,"
                    " status, rewards_json, mean_reward, tokens, content_hash, envelope,"
                    " created_at) VALUES (?,?,?,?,?,'accepted',?,?,?,?,?,?)",
                    (
                        lease_id,
                        job_id,
                        node_id,
                        version,
                        prompt_id,
                        json.dumps(rewards),
                        sum(rewards) / len(rewards),
                        tokens,
                        content_hash,
                        envelope,
                        now,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError("duplicate") from exc
            db.execute(
                "UPDATE nodes SET accepted=accepted+1, streak=streak+1 WHERE node_id=?",
                (node_id,),
            )

    def close_lease(self, lease_id: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE leases SET status='submitted' WHERE lease_id=? AND status='open'",
                (lease_id,),
            )

    def rollout_node(self, rollout_id: str) -> str | None:
        row = self._db.execute(
            "SELECT node_id FROM rollouts WHERE rollout_id=?", (rollout_id,)
        ).fetchone()
        return row[0] if row else None

    def buffered_count(self, job_id: str) -> int:
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM rollouts"
                " WHERE job_id=? AND status IN ('accepted','in_batch')",
                (job_id,),
            ).fetchone()[0]
        )

    def take_batch(self, job_id: str, max_groups: int, min_version: int) -> list[sqlite3.Row]:
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
            rows = db.execute(
                "SELECT * FROM rollouts WHERE job_id=? AND status='accepted'"
                " ORDER BY created_at LIMIT ?",
                (job_id, max_groups),
            ).fetchall()
            db.executemany(
                "UPDATE rollouts SET status='in_batch', batch_at=? WHERE rollout_id=?",
                [(now, r["rollout_id"]) for r in rows],
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
        the same digest is accepted as a no-op (the learner re-sends after a restart).
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
                # 'accepted' too: a learner that crashed after checkpointing v but before
                # reporting it re-attaches (which returns its batch to the buffer) and re-sends
                # the report of v before taking anything else.
                cur = db.execute(
                    "UPDATE rollouts SET status='trained', trained_version=?"
                    " WHERE rollout_id=? AND job_id=? AND status IN ('in_batch', 'accepted')",
                    (version, rid, job_id),
                )
                if cur.rowcount != 1:
                    raise StoreError(f"rollout {rid} was not in a batch of job {job_id}")
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

    def version(self, job_id: str, version: int) -> sqlite3.Row | None:
        return self._db.execute(
            "SELECT * FROM versions WHERE job_id=? AND version=?", (job_id, version)
        ).fetchone()

    def versions(self, job_id: str) -> list[sqlite3.Row]:
        return self._db.execute(
            "SELECT * FROM versions WHERE job_id=? ORDER BY version", (job_id,)
        ).fetchall()

    def mark_all_nodes(self, job_id: str, version: int, at: float) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE versions SET all_nodes_at=? WHERE job_id=? AND version=?"
                " AND all_nodes_at IS NULL",
                (at, job_id, version),
            )

    # ------------------------------------------------------------------ reports

    def reward_by_version(self, job_id: str) -> list[tuple[int, float, int]]:
        rows = self._db.execute(
            "SELECT version, AVG(mean_reward), COUNT(*) FROM rollouts"
            " WHERE job_id=? AND status IN ('accepted','in_batch','trained')"
            " GROUP BY version ORDER BY version",
            (job_id,),
        ).fetchall()
        return [(int(r[0]), float(r[1]), int(r[2])) for r in rows]

    def rollout_counts(self, job_id: str) -> dict[str, int]:
        rows = self._db.execute(
            "SELECT status, COUNT(*) FROM rollouts WHERE job_id=? GROUP BY status", (job_id,)
        ).fetchall()
        counts = {r[0]: int(r[1]) for r in rows}
        counts["rejected_total"] = int(
            self._db.execute(
                "SELECT COUNT(*) FROM rejections WHERE job_id=?", (job_id,)
            ).fetchone()[0]
        )
        return counts

    def mean_tokens_per_rollout(self, job_id: str) -> float | None:
        row = self._db.execute(
            "SELECT SUM(tokens), COUNT(*) FROM rollouts WHERE job_id=? AND status != 'rejected'",
            (job_id,),
        ).fetchone()
        if not row[1]:
            return None
        spec = json.loads(self.job(job_id)["spec_json"])
        return row[0] / (row[1] * spec["group_size"])

    def trained_rollouts(self, job_id: str) -> list[sqlite3.Row]:
        return self._db.execute(
            "SELECT * FROM rollouts WHERE job_id=? AND status='trained' ORDER BY trained_version",
            (job_id,),
        ).fetchall()
