"""Who held a job's lease window during a phase of ``benchmarks/attack.py``, from the
coordinator's own SQLite after the run.

A lease is held from its issue until its group was stored (delivered), or until its deadline
(let expire, or returned with a rejected group: the coordinator moves a returned lease's
deadline to the moment it was returned). :func:`window_held` sums those lease-seconds inside a
phase for the honest nodes and for everyone else; divided by the phase's length, each is the
average number of leases held. The attack on the window (stale hoarders, lease hoarders, a
churn of identities that take a lease and leave) shows as the others' share. Read-only; opens
the database in SQLite's read-only mode so that it never writes to a run's files.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def window_held(db_path: Path, honest: set[str], window: tuple[float, float]) -> dict:
    """Average leases held in ``window`` by the ``honest`` node ids and by all others, and the
    others' share of the lease-seconds (None where nothing was held)."""
    t0, t1 = window
    held = {"honest": 0.0, "others": 0.0}
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT leases.node_id, leases.issued_at, leases.deadline, rollouts.created_at"
            " FROM leases LEFT JOIN rollouts ON rollouts.rollout_id=leases.lease_id"
            " WHERE leases.issued_at < ? AND leases.deadline > ?",
            (t1, t0),
        ).fetchall()
    finally:
        db.close()
    for node_id, issued, deadline, stored in rows:
        end = deadline if stored is None else min(deadline, stored)
        span = min(end, t1) - max(issued, t0)
        if span > 0:
            held["honest" if node_id in honest else "others"] += span
    total = held["honest"] + held["others"]
    return {
        "leases_held_honest": held["honest"] / (t1 - t0),
        "leases_held_others": held["others"] / (t1 - t0),
        "others_share_of_window": None if not total else held["others"] / total,
    }
