"""What the operator dashboard shows, read from the store and the coordinator's soft state.

:func:`snapshot` owns the dashboard's data model: one JSON-ready dict per update, the same for
every viewer (the live feed builds it once and sends it to all;
:mod:`echo.coordinator.dashboard.live`). Per job: reward and held-out accuracy by version, staleness
of the groups each version trained, rollouts/s and versions/min over the last :data:`WINDOW_S` in
bins of :data:`BIN_S`, rejections by reason in the same bins, the current relay plan with each
edge's planned and measured rate, and the scheduler's view of the job. Swarm-wide: the nodes
(engine, reachability, tokens/s, version held, last seen, credit), the scheduler's recent moves and
the credit leaderboard.
:func:`public_snapshot` is the part anyone may see (see docs/dashboard.md).

:class:`EdgeRates` keeps the measured rate of each relay edge, as the dissemination plane times
receipts (:attr:`~echo.coordinator.dissemination.receipts.Receipts.on_edge`); bounded.
Reads only; raises nothing for any stored state.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Protocol

from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.jobs.control import FINISHED
from echo.coordinator.scheduling.placement import Placement
from echo.coordinator.store import Store
from echo.coordinator.store.rows import JobRow
from echo.protocol.credit import UCREDITS_PER_CREDIT

# The time series cover this much of the recent past, in bins of BIN_S.
WINDOW_S = 1800.0
BIN_S = 10.0
# Nodes heard from within this long are listed (and at most MAX_NODES of them, latest first).
NODE_WINDOW_S = 3600.0
MAX_NODES = 500
# Measured edges remembered (the newest; a plan of a thousand nodes has about that many edges).
MAX_EDGES = 4096
LEADERBOARD = 20
# Finished jobs shown beside the live ones (the newest): a long-lived coordinator's history
# would otherwise grow every snapshot.
FINISHED_SHOWN = 10
MOVES_SHOWN = 50


class EdgeRates:
    """The last measured rate of each relay edge, per job (bounded: the oldest go first)."""

    def __init__(self, cap: int = MAX_EDGES) -> None:
        self.cap = cap
        self._rates: OrderedDict[tuple[str, str, str], tuple[int, float, float]] = OrderedDict()

    def record(self, job_id: str, version: int, parent: str, child: str, bps: float) -> None:
        """``child`` got its stripes of ``version`` from ``parent`` at ``bps`` (B/s)."""
        key = (job_id, parent, child)
        self._rates.pop(key, None)
        self._rates[key] = (version, bps, time.time())
        while len(self._rates) > self.cap:
            self._rates.popitem(last=False)

    def of(self, job_id: str, parent: str, child: str) -> tuple[int, float] | None:
        """(version, B/s) last measured on the edge, or None."""
        got = self._rates.get((job_id, parent, child))
        return (got[0], got[1]) if got else None


class DashBackend(Protocol):
    """What the dashboard reads of the coordinator."""

    @property
    def store(self) -> Store: ...

    @property
    def dissemination(self) -> Dissemination: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def edge_rates(self) -> EdgeRates: ...

    def job_schedule(self, job_id: str) -> dict[str, Any]: ...


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _bins(now: float, since: float) -> tuple[float, int]:
    """The first bin's start and the number of bins of the window ending at ``now``: the last
    :data:`WINDOW_S`, or from ``since`` (the job's start) when that is later."""
    start = math.floor(max(now - WINDOW_S, min(since, now - BIN_S)) / BIN_S) * BIN_S
    return start, int(math.ceil((now - start) / BIN_S))


def job_series(store: Store, row: JobRow, now: float) -> dict[str, Any]:
    """The curves of one job (see the module docstring)."""
    job_id = row.job_id
    reward = [[v, r] for v, r, _ in store.reward_by_version(job_id)]
    evals, published = [], []
    for v in store.versions(job_id):
        published.append(v.published_at)
        if "eval_accuracy" in v.metrics:
            evals.append([v.version, v.metrics["eval_accuracy"]])
    stale = [[v, mean, mx] for v, mean, mx in store.staleness_by_version(job_id)]
    start, n = _bins(now, row.created_at)
    group_size = int(row.spec.get("group_size", 1))
    rollouts = [0.0] * n
    for b, count in store.groups_per_bin(job_id, start, BIN_S).items():
        if 0 <= b < n:
            rollouts[b] = count * group_size / BIN_S
    versions_per_min = []
    for i in range(n):
        end = start + (i + 1) * BIN_S
        versions_per_min.append(float(sum(1 for t in published if end - 60.0 < t <= end)))
    by_reason: dict[str, list[int]] = {}
    for b, reason, count in store.rejections_per_bin(job_id, start, BIN_S):
        if 0 <= b < n:
            by_reason.setdefault(reason, [0] * n)[b] = count
    return {
        "reward": reward,
        "eval": evals,
        "staleness": stale,
        "t": [start + (i + 1) * BIN_S for i in range(n)],
        "rollouts_per_s": rollouts,
        "versions_per_min": versions_per_min,
        "rejections": by_reason,
        "rejected_total": store.job_rejection_counts(job_id),
    }


def relay_tree(coord: DashBackend, job_id: str) -> dict[str, Any] | None:
    """The job's current relay plan as a graph: edges with the planned and measured rates."""
    plan = coord.dissemination.current_plan(job_id)
    if plan is None:
        return None
    edges = []
    for i, stripe in enumerate(plan.stripes):
        for parent, kids in stripe.children.items():
            for kid in kids:
                measured = coord.edge_rates.of(job_id, parent, kid)
                edges.append(
                    {
                        "from": parent,
                        "to": kid,
                        "stripe": i,
                        "planned_bps": _finite(plan.edge_rate(parent, kid)),
                        "measured_bps": measured[1] if measured else None,
                        "measured_version": measured[0] if measured else None,
                    }
                )
    return {"source": plan.source, "kind": plan.kind, "stripes": len(plan.stripes), "edges": edges}


def reachability(coord: DashBackend, node_id: str) -> str:
    """What the dial-backs found of the node: its verdict, else dialable / not / unprobed."""
    link = coord.dissemination.relays.links.get(node_id)
    if link is None or link.reachable is None:
        return "unprobed"
    if link.verdict:
        return link.verdict
    return "dialable" if link.reachable else "not dialable"


def node_table(coord: DashBackend, now: float) -> list[dict[str, Any]]:
    """The nodes heard from within :data:`NODE_WINDOW_S`, latest first."""
    rows = coord.store.recent_nodes(now - NODE_WINDOW_S, MAX_NODES)
    totals = coord.store.credit_totals_of([r["node_id"] for r in rows])
    placement = coord.placement.nodes
    for r in rows:
        placed = placement.get(r["node_id"])
        r["reachability"] = reachability(coord, r["node_id"])
        r["job"] = placed.job if placed is not None else None
        r["credits"] = totals.get(r["node_id"], 0) / UCREDITS_PER_CREDIT
    return rows


def leaderboard(store: Store, limit: int = LEADERBOARD) -> list[dict[str, Any]]:
    """The best-paid nodes, best first."""
    return [
        {"node_id": n, "credits": total / UCREDITS_PER_CREDIT, "entries": entries}
        for n, total, entries in store.leaderboard(limit)
    ]


class Snapshots:
    """Builds snapshots, keeping the series of finished jobs (they no longer change)."""

    def __init__(self, coord: DashBackend) -> None:
        self.coord = coord
        self._done: dict[str, tuple[float, dict[str, Any]]] = {}

    def full(self, now: float | None = None) -> dict[str, Any]:
        """Everything the operator's page shows (see the module docstring)."""
        now = time.time() if now is None else now
        coord, jobs = self.coord, []
        rows = coord.store.jobs()
        done = [r.job_id for r in rows if r.status in FINISHED][-FINISHED_SHOWN:]
        rows = [r for r in rows if r.status not in FINISHED or r.job_id in done]
        self._done = {j: v for j, v in self._done.items() if j in done}
        for row in rows:
            if row.status in FINISHED:
                cached = self._done.get(row.job_id)
                if cached is None or cached[0] != row.updated_at:
                    cached = (row.updated_at, job_series(coord.store, row, now))
                    self._done[row.job_id] = cached
                series = cached[1]
            else:
                series = job_series(coord.store, row, now)
            jobs.append(
                {
                    "job_id": row.job_id,
                    "name": row.name,
                    "status": row.status,
                    "current_version": row.current_version,
                    "schedule": coord.job_schedule(row.job_id),
                    "series": series,
                    "tree": relay_tree(coord, row.job_id),
                }
            )
        moves = [
            {"at": at, "node_id": nid, "from": src, "to": dst, "why": why}
            for at, nid, src, dst, why in list(coord.placement.moves)[-MOVES_SHOWN:]
        ]
        return {
            "at": now,
            "bin_s": BIN_S,
            "jobs": jobs,
            "nodes": node_table(coord, now),
            "moves": moves[::-1],
            "leaderboard": leaderboard(coord.store),
        }

    def public(self, now: float | None = None) -> dict[str, Any]:
        """What anyone may see: the leaderboard and the swarm's size."""
        now = time.time() if now is None else now
        store = self.coord.store
        return {
            "at": now,
            "leaderboard": leaderboard(store),
            "nodes_active": len(store.active_nodes(now - 60.0)),
            "jobs_running": sum(1 for j in store.jobs(("running",))),
        }
