"""Who held a job's lease window during a phase of ``benchmarks/attack.py``, from the
coordinator's own SQLite after the run.

A lease is held from its issue until its group was stored (delivered), or until its deadline
(let expire, or returned with a rejected group: the coordinator moves a returned lease's
deadline to the moment it was returned). :func:`window_held` sums those lease-seconds inside a
phase for the honest nodes, for other nodes with accepted groups (the stale hoarders, whose
leases come out of the window) and for strangers (no accepted group: lease hoarders, a churn of
identities; their share comes on top of the window); divided by the phase's length, each is
the average number of leases held. Read-only; opens
the database in SQLite's read-only mode so that it never writes to a run's files.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def window_held(db_path: Path, honest: set[str], window: tuple[float, float]) -> dict:
    """Average leases held in ``window`` by the ``honest`` node ids, by other nodes with an
    accepted group and by strangers (see the module docstring)."""
    t0, t1 = window
    held = {"honest": 0.0, "others": 0.0, "strangers": 0.0}
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT leases.node_id, leases.issued_at, leases.deadline, rollouts.created_at,"
            " COALESCE(nodes.accepted, 0)"
            " FROM leases LEFT JOIN rollouts ON rollouts.rollout_id=leases.lease_id"
            " LEFT JOIN nodes ON nodes.node_id=leases.node_id"
            " WHERE leases.issued_at < ? AND leases.deadline > ?",
            (t1, t0),
        ).fetchall()
    finally:
        db.close()
    for node_id, issued, deadline, stored, accepted in rows:
        end = deadline if stored is None else min(deadline, stored)
        span = min(end, t1) - max(issued, t0)
        if span > 0:
            who = "honest" if node_id in honest else "others" if accepted else "strangers"
            held[who] += span
    return {f"leases_held_{who}": s / (t1 - t0) for who, s in held.items()}
