"""The store's credit ledger: ``credit``, ``credit_totals`` and ``credit_cursor`` (schema 3).

:class:`CreditTables` is one part of :class:`~echo.coordinator.store.Store` (see its docstring
for the transaction rules). It stores what :class:`~echo.coordinator.credit.CreditBook` signs:
each entry is appended with the node's running total and chain head in one transaction, under a
``ref_key`` that names what it pays for and is unique, so nothing is paid twice. The ``credit``
table is append-only (SQLite triggers refuse an UPDATE or DELETE; :mod:`echo.coordinator.store.db`).
What an entry says, and the price list, are :mod:`echo.protocol.credit`'s.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from echo.coordinator.store.db import Database
from echo.protocol.credit import GENESIS, entry_digest


@dataclass(frozen=True)
class Payment:
    """One entry to append: who, for what (``ref_key``, unique; ``refs`` as the entry names
    them), how much, and the quantities it was priced by."""

    node_id: str
    kind: str
    job_id: str
    version: int
    ref_key: str
    amount: int
    refs: tuple[str, ...] = ()
    tokens: int = 0
    params: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class CreditRow:
    """A stored entry: the sealed envelope is the record; the rest indexes it."""

    node_id: str
    seq: int
    kind: str
    job_id: str
    version: int
    amount: int
    at: float
    envelope: bytes


class CreditTables(Database):
    """The append-only credit ledger and the per-job cursor of paid versions."""

    def append_credit(
        self, payment: Payment, at: float, seal: Callable[[Payment, int, bytes, float], bytes]
    ) -> CreditRow | None:
        """Append ``payment`` as the node's next entry; None when its ``ref_key`` was paid
        already (nothing changes then).

        ``seal(payment, seq, prev, at)`` returns the signed envelope for the entry's place in
        the node's chain; it runs inside the transaction, so two payments to one node never take
        one seq.
        """
        with self._tx() as db:
            if db.execute(
                "SELECT 1 FROM credit WHERE ref_key=?", (payment.ref_key,)
            ).fetchone():
                return None
            return self._append(db, payment, at, seal)

    def _append(
        self,
        db: sqlite3.Connection,
        payment: Payment,
        at: float,
        seal: Callable[[Payment, int, bytes, float], bytes],
    ) -> CreditRow:
        row = db.execute(
            "SELECT entries, head FROM credit_totals WHERE node_id=?", (payment.node_id,)
        ).fetchone()
        seq, prev = (int(row[0]), bytes(row[1])) if row else (0, GENESIS)
        envelope = seal(payment, seq, prev, at)
        db.execute(
            "INSERT INTO credit (node_id, seq, kind, job_id, version, ref_key, amount, at,"
            " envelope) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                payment.node_id,
                seq,
                payment.kind,
                payment.job_id,
                payment.version,
                payment.ref_key,
                payment.amount,
                at,
                envelope,
            ),
        )
        db.execute(
            "INSERT INTO credit_totals (node_id, total, entries, head) VALUES (?,?,1,?)"
            " ON CONFLICT(node_id) DO UPDATE SET total=total+excluded.total,"
            " entries=entries+1, head=excluded.head",
            (payment.node_id, payment.amount, entry_digest(envelope)),
        )
        return CreditRow(
            payment.node_id,
            seq,
            payment.kind,
            payment.job_id,
            payment.version,
            payment.amount,
            at,
            envelope,
        )

    def pay_versions(
        self,
        job_id: str,
        upto: int,
        payments: list[Payment],
        at: float,
        seal: Callable[[Payment, int, bytes, float], bytes],
    ) -> int:
        """Append ``payments`` (the trained groups of ``job_id``'s versions up to ``upto``) and
        move the job's cursor to ``upto``, in one transaction; returns the entries appended
        (payments already made are skipped)."""
        with self._tx() as db:
            n = 0
            for p in payments:
                if db.execute("SELECT 1 FROM credit WHERE ref_key=?", (p.ref_key,)).fetchone():
                    continue
                self._append(db, p, at, seal)
                n += 1
            db.execute(
                "INSERT INTO credit_cursor VALUES (?, ?)"
                " ON CONFLICT(job_id) DO UPDATE SET version=excluded.version",
                (job_id, upto),
            )
            return n

    def credit_cursors(self) -> dict[str, int]:
        """The last paid version of each job with one (a job without: none paid yet)."""
        rows = self._db.execute("SELECT job_id, version FROM credit_cursor").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def trained_since(self, job_id: str, after: int, upto: int) -> list[tuple[int, str, str, int]]:
        """(trained_version, node, rollout id, tokens) of the job's groups trained into versions
        ``after < v <= upto``, by version then rollout id."""
        rows = self._db.execute(
            "SELECT trained_version, node_id, rollout_id, tokens FROM rollouts"
            " WHERE job_id=? AND trained_version>? AND trained_version<=? AND status='trained'"
            " ORDER BY trained_version, rollout_id",
            (job_id, after, upto),
        ).fetchall()
        return [(int(r[0]), r[1], r[2], int(r[3])) for r in rows]

    def credit_entries(self, node_id: str, after: int = -1, limit: int = 1000) -> list[CreditRow]:
        """The node's entries with ``seq > after``, oldest first, at most ``limit``."""
        rows = self._db.execute(
            "SELECT node_id, seq, kind, job_id, version, amount, at, envelope FROM credit"
            " WHERE node_id=? AND seq>? ORDER BY seq LIMIT ?",
            (node_id, after, limit),
        ).fetchall()
        return [
            CreditRow(r[0], int(r[1]), r[2], r[3], int(r[4]), int(r[5]), float(r[6]), bytes(r[7]))
            for r in rows
        ]

    def credit_total(self, node_id: str) -> tuple[int, int]:
        """(micro-credits, entries) the node holds; (0, 0) for a node never paid."""
        row = self._db.execute(
            "SELECT total, entries FROM credit_totals WHERE node_id=?", (node_id,)
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def credit_by_kind(self, node_id: str) -> dict[str, int]:
        """The node's micro-credits by kind of work."""
        rows = self._db.execute(
            "SELECT kind, SUM(amount) FROM credit WHERE node_id=? GROUP BY kind", (node_id,)
        ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def credit_totals_of(self, node_ids: list[str]) -> dict[str, int]:
        """Micro-credits of each of ``node_ids`` that was ever paid."""
        out: dict[str, int] = {}
        for i in range(0, len(node_ids), 500):  # under SQLite's limit on bound parameters
            part = node_ids[i : i + 500]
            marks = ",".join("?" * len(part))
            for r in self._db.execute(
                f"SELECT node_id, total FROM credit_totals WHERE node_id IN ({marks})", part
            ):
                out[r[0]] = int(r[1])
        return out

    def leaderboard(self, limit: int = 20) -> list[tuple[str, int, int]]:
        """(node, micro-credits, entries) of the ``limit`` best-paid nodes, best first."""
        rows = self._db.execute(
            "SELECT node_id, total, entries FROM credit_totals ORDER BY total DESC, node_id"
            " LIMIT ?",
            (limit,),
        ).fetchall()
        return [(r[0], int(r[1]), int(r[2])) for r in rows]
