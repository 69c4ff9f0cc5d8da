"""The coordinator's SQLite file: its schema, its migrations, and the transaction of each write.

:class:`Database` owns the connection. :meth:`Database.open` sets the pragmas that make an
acknowledged write durable (WAL, ``synchronous=FULL``), creates the tables, and brings a database
of an older schema up to :data:`SCHEMA_VERSION` in one transaction (or refuses a newer one with
:class:`StoreError`). The table methods of :class:`~echo.coordinator.store.Store` derive from it
and run each write in :meth:`Database._tx`: ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on any
exception, so a crash leaves the old state or the new one, never half of one.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

# 2: a rollout keeps its decoded group (rollouts.engine, the completions table), so a batch is
#    built from rows; the node's envelope stays for audit only.
# 3: a lease keeps its prompt's token ids (leases.prompt_tokens, rendered once when it is
#    issued) and an accepted rollout its encoded TrainingGroup (rollouts.training_group, the form
#    the learner trains on, made once when it is accepted): a batch hands out stored bytes.
# 4: the credit ledger (credit, credit_totals, credit_cursor; append-only by trigger) and the
#    indexes the dashboard's time series read (echo.coordinator.store.credit, .dash).
SCHEMA_VERSION = 4

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
    last_seen REAL NOT NULL,
    excluded_at REAL NOT NULL DEFAULT 0  -- when it was excluded (retention forgets it later)
);
-- The active nodes (read every second): excluded and long-silent identities stay out of the
-- range, however many a churn left behind (100k excluded rows made a full scan take 1.3 s).
CREATE INDEX IF NOT EXISTS nodes_active ON nodes (excluded, last_seen);
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
    status TEXT NOT NULL,                -- open | submitted | expired
    prompt_tokens BLOB NOT NULL DEFAULT x''  -- int32 little-endian, as the signed lease has them
);
CREATE INDEX IF NOT EXISTS leases_open ON leases (job_id, status);
-- A node's leases by status: the submit path's "has an open lease" gate and the expiry penalty.
CREATE INDEX IF NOT EXISTS leases_node ON leases (node_id, status, deadline);
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
    envelope BLOB NOT NULL,               -- the node's signed Submission, for audit
    created_at REAL NOT NULL,
    batch_at REAL,
    trained_version INTEGER,
    engine TEXT NOT NULL DEFAULT '',
    training_group BLOB NOT NULL DEFAULT x''  -- the encoded messages.TrainingGroup
);
CREATE INDEX IF NOT EXISTS rollouts_job_status ON rollouts (job_id, status, created_at);
CREATE UNIQUE INDEX IF NOT EXISTS rollouts_content ON rollouts (job_id, content_hash);
-- A node's groups, newest last: the lease quota's "accepted since" (a read per lease request).
CREATE INDEX IF NOT EXISTS rollouts_node ON rollouts (node_id, created_at);
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


class StoreError(RuntimeError):
    """A state transition that the stored state does not allow, or a database of another schema."""


class Database:
    """One SQLite database file; open with :meth:`open`, close with :meth:`close`."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._db = conn

    @classmethod
    def open(cls, path: Path | str) -> Self:
        """Open (or create) the database at ``path`` at :data:`SCHEMA_VERSION`.

        Raises StoreError for a database of a schema this build cannot migrate (a newer one).
        """
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: an accepted rollout is acknowledged to its node only after it is on disk.
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.executescript(_SCHEMA)
        db = cls(conn)
        with db._tx() as tx:
            _add_columns(tx)
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        have = SCHEMA_VERSION if row is None else int(row[0])
        if not 1 <= have <= SCHEMA_VERSION:
            raise StoreError(
                f"database {path} has schema {row[0]}, this build expects {SCHEMA_VERSION}"
            )
        with db._tx() as tx:  # every step in one transaction: all of them or none
            if row is None:
                _create_credit(tx)
                tx.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif have < SCHEMA_VERSION:
                if have < 3:
                    _migrate_to_3(tx)
                _migrate_3_to_4(tx)
                tx.execute(
                    "UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),)
                )
        return db

    def close(self) -> None:
        """Close the connection; every committed transaction is already on disk."""
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

    @contextmanager
    def _hint_tx(self) -> Iterator[sqlite3.Connection]:
        """A transaction for a hint that a power cut may lose (a node's last-seen time, the
        first time it held a version, a prompt-id reservation that the leases' own commit makes
        durable): committed without an fsync of its own. It survives a
        crash of the process (the OS has the write), it becomes durable with the next
        :meth:`_tx`'s fsync of the WAL, and the WAL's checksums keep a cut-short tail from
        corrupting anything. Measured under benchmarks/attack.py: every lease made such a
        commit, and fsyncs in the event loop's thread were 11% of the coordinator's samples."""
        self._db.execute("PRAGMA synchronous=NORMAL")  # not allowed inside a transaction
        try:
            with self._tx() as db:
                yield db
        finally:
            self._db.execute("PRAGMA synchronous=FULL")


def _add_columns(db: sqlite3.Connection) -> None:
    """Add the columns that came without a schema change to a file made before them.

    Only additive columns with a default belong here: a build that predates one never names it
    (``SELECT *`` rows are read by name, inserts name their columns), so the file stays readable
    by it and :data:`SCHEMA_VERSION` need not change.
    """
    have = {r[1] for r in db.execute("PRAGMA table_info(nodes)").fetchall()}
    if "excluded_at" not in have:
        db.execute("ALTER TABLE nodes ADD COLUMN excluded_at REAL NOT NULL DEFAULT 0")
        # When they were excluded is unknown: counted from now, they are kept a full
        # retention window before they may be forgotten.
        db.execute("UPDATE nodes SET excluded_at=? WHERE excluded!=0", (time.time(),))


def _migrate_to_3(db: sqlite3.Connection) -> None:
    """Bring a schema 1 or 2 file to schema 3.

    Neither stored a group's prompt, and only a job's task can render one again, so the groups
    still waiting for a batch are dropped (reason ``upgraded``: not held against their nodes)
    and the open leases, which a protocol 9 node never holds, are forgotten rather than expired
    (an expired lease counts against its node). A schema 2 file keeps its ``completions`` table
    as the record of the groups trained before; nothing reads it.
    """
    # A table the old file lacked was just made at schema 3; the others gain their columns.
    for table, column, decl in (
        ("leases", "prompt_tokens", "BLOB NOT NULL DEFAULT x''"),
        ("rollouts", "engine", "TEXT NOT NULL DEFAULT ''"),
        ("rollouts", "training_group", "BLOB NOT NULL DEFAULT x''"),
    ):
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
    db.execute(
        "UPDATE rollouts SET status='dropped', reason='upgraded'"
        " WHERE status IN ('accepted', 'in_batch')"
    )
    db.execute("DELETE FROM leases WHERE status='open'")


# The credit ledger (schema 4). Entries are never changed or deleted: the triggers refuse it, so
# no code path (retention included) can rewrite what a volunteer was paid. ``ref_key`` names what
# an entry pays for and is unique: nothing is paid twice. ``credit_totals`` keeps each node's
# sum, entry count and chain head (the next entry's ``prev``); ``credit_cursor`` the last version
# of each job whose trained groups were paid.
_CREDIT_DDL = (
    """CREATE TABLE IF NOT EXISTS credit (
        node_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        job_id TEXT NOT NULL,
        version INTEGER NOT NULL,
        ref_key TEXT NOT NULL UNIQUE,
        amount INTEGER NOT NULL,
        at REAL NOT NULL,
        envelope BLOB NOT NULL,
        PRIMARY KEY (node_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS credit_totals (
        node_id TEXT PRIMARY KEY,
        total INTEGER NOT NULL,
        entries INTEGER NOT NULL,
        head BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS credit_totals_rank ON credit_totals (total)",
    """CREATE TABLE IF NOT EXISTS credit_cursor (
        job_id TEXT PRIMARY KEY, version INTEGER NOT NULL
    )""",
    """CREATE TRIGGER IF NOT EXISTS credit_no_update BEFORE UPDATE ON credit
        BEGIN SELECT RAISE(ABORT, 'the credit ledger is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS credit_no_delete BEFORE DELETE ON credit
        BEGIN SELECT RAISE(ABORT, 'the credit ledger is append-only'); END""",
    # The groups a version trained (what the ledger pays for, version by version).
    "CREATE INDEX IF NOT EXISTS rollouts_trained ON rollouts (job_id, trained_version)",
    # The dashboard's per-job time series: groups and rejections by time.
    "CREATE INDEX IF NOT EXISTS rollouts_job_time ON rollouts (job_id, created_at)",
    "CREATE INDEX IF NOT EXISTS rejections_job_time ON rejections (job_id, at)",
)


def _create_credit(db: sqlite3.Connection) -> None:
    for stmt in _CREDIT_DDL:
        db.execute(stmt)


def _migrate_3_to_4(db: sqlite3.Connection) -> None:
    """Add the credit ledger. No cursor is written: the coordinator's credit book then pays the
    groups trained before the ledger existed too, signed when it first runs."""
    _create_credit(db)
