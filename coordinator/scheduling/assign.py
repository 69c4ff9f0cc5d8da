"""Placing nodes on jobs: which job each node serves, and which nodes stand by. Pure.

:func:`schedule` owns the decision, from what the coordinator measured (it measures nothing):

- **Need.** Each job's need is the rollout throughput that keeps its learner busy, from the
  ECHO-2 capacity model (:func:`echo.coordinator.scheduling.capacity.required_throughput`) with the
  job's own measured step time, broadcast time and rollout length. A job not measured yet (no
  version trained, or one whose broadcast outlasts its steps) needs every node that fits it.
- **Fit.** A node serves only the jobs in its ``rates`` (the caller leaves out those whose model
  does not fit its memory or engine; :mod:`echo.coordinator.scheduling.fit`), at the throughput it
  delivers on each (rollouts/s, measured or estimated).
- **Operator.** Higher ``priority`` first; a job holds at most ``max_share`` of the nodes (and
  at least one).
- **Cost.** A job takes the free node with the least cost per unit of its throughput first
  (cost-aware activation), until its need is met with ``headroom``; nodes no job needs stand by.

The allocation runs in two phases. First every job, by priority, gets one node (a job without a
node can neither train nor be measured). Then, tier by tier of priority, the job furthest from
its need (the lowest share of it met) takes its cheapest free node, until every job in the tier
is met, capped, or out of nodes that fit.

**Hysteresis.** Every switch costs the node a model download, so the ideal allocation is not
applied as is. A node on standby, new, or whose job ended or no longer fits goes where the
allocation says at once. A working node moves only after ``min_stay_s`` on its job, and only when
the gain is clear: the share of need the destination gains, less the share the source loses
(counted only between equal priorities; a higher-priority destination ignores the loss, a
lower-priority one may only take a node its source can spare), is at least ``min_gain``. A node
goes to standby only when its job stays above its target by ``min_gain`` without it (a band, so
that noise in the measurements does not toggle it). A job with no node takes one from a job of
no higher priority that has two or more; the last node of a job only leaves it for a job of
higher priority. A move that costs the node only an adapter switch (a LoRA job whose base it
holds, ``NodeSupply.switch``) waits and gains in proportion to its cost: ``min_stay_s`` and
``min_gain`` times that share of a model load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# Job states for the operator: its learner has (per the capacity model) what keeps it busy, or not.
STARVED, SATURATED, UNMEASURED, NO_NODES = "starved", "saturated", "unmeasured", "no nodes"


@dataclass(frozen=True)
class JobDemand:
    """A runnable job as the scheduler sees it. ``need_rps``: rollouts/s that keep its learner
    busy (None: not measured yet); ``created_at`` breaks ties (older first)."""

    job_id: str
    need_rps: float | None
    priority: int = 0
    max_share: float = 1.0
    created_at: float = 0.0


@dataclass(frozen=True)
class NodeSupply:
    """An active node: its cost per hour, the rollouts/s it delivers on each job that fits it,
    the job it serves now (None: standby or new) and since when. ``switch`` maps the jobs that
    cost the node less than a model load to start on to that cost as a share of one (a LoRA job
    whose base it holds: an adapter switch, :mod:`echo.coordinator.scheduling.bases`); a job
    not in it costs a model load (1.0)."""

    node_id: str
    rates: Mapping[str, float]
    cost: float = 1.0
    job: str | None = None
    since: float = 0.0
    switch: Mapping[str, float] = field(default_factory=dict)

    def switch_share(self, job_id: str | None) -> float:
        """What starting on ``job_id`` costs the node, as a share of a model load (standby:
        nothing to load, 1.0 so that standby keeps its full hysteresis)."""
        return self.switch.get(job_id, 1.0) if job_id is not None else 1.0


@dataclass(frozen=True)
class SchedulerParams:
    """Hysteresis and activation knobs (``[scheduler]`` of coordinator.toml)."""

    min_stay_s: float = 60.0  # a node serves a job at least this long before it is moved
    min_gain: float = 0.15  # share of a job's need a move must gain, net
    headroom: float = 1.1  # activate until the throughput is this much above the need


@dataclass(frozen=True)
class Move:
    """One node placed elsewhere: from ``src`` to ``dst`` (None: standby or new)."""

    node_id: str
    src: str | None
    dst: str | None
    why: str


@dataclass
class JobView:
    """What the operator sees of a job: its nodes, its need and what they deliver."""

    job_id: str
    need_rps: float | None
    have_rps: float
    nodes: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        """:data:`NO_NODES`, :data:`UNMEASURED`, :data:`STARVED` or :data:`SATURATED`."""
        if not self.nodes:
            return NO_NODES
        if self.need_rps is None:
            return UNMEASURED
        return SATURATED if self.have_rps >= self.need_rps else STARVED


@dataclass
class Decision:
    """The outcome: where every node goes (None: standby), the moves, and each job's view."""

    assignment: dict[str, str | None]
    moves: list[Move]
    jobs: dict[str, JobView]


class _Ledger:
    """Throughput and node counts per job while an allocation is built."""

    def __init__(self, jobs: list[JobDemand], nodes: list[NodeSupply], headroom: float) -> None:
        self.jobs = {j.job_id: j for j in jobs}
        self.have = {j.job_id: 0.0 for j in jobs}
        self.count = {j.job_id: 0 for j in jobs}
        self.target: dict[str, float] = {}
        for j in jobs:
            if j.need_rps is not None and math.isfinite(j.need_rps):
                self.target[j.job_id] = headroom * j.need_rps
            else:  # unmeasured: every node that fits it
                self.target[j.job_id] = sum(n.rates.get(j.job_id, 0.0) for n in nodes)
        total = len(nodes)
        self.cap = {j.job_id: max(1, math.floor(j.max_share * total + 1e-9)) for j in jobs}

    def met(self, job_id: str, have: float | None = None) -> float:
        """The share of the job's target met (1.0 at or above it)."""
        target = self.target[job_id]
        h = self.have[job_id] if have is None else have
        return 1.0 if target <= 0 else min(1.0, h / target)

    def add(self, job_id: str, rate: float) -> None:
        self.have[job_id] += rate
        self.count[job_id] += 1

    def remove(self, job_id: str, rate: float) -> None:
        self.have[job_id] -= rate
        self.count[job_id] -= 1


def _order(jobs: list[JobDemand]) -> list[JobDemand]:
    return sorted(jobs, key=lambda j: (-j.priority, j.created_at, j.job_id))


# A node already on a job counts as this much cheaper for it: equal nodes do not trade places.
_STICKY = 0.8


def _best_node(job_id: str, free: list[NodeSupply]) -> NodeSupply | None:
    """The free node with the least cost per rollout/s on ``job_id`` (its own nodes favoured,
    and nodes that start on it with an adapter switch nearly as much: the base they hold is
    what a model load would download)."""
    best, best_key = None, None
    for n in free:
        rate = n.rates.get(job_id, 0.0)
        if rate <= 0:
            continue
        if n.job == job_id:
            sticky = _STICKY
        else:  # a model load: 1.0; an adapter switch of share s: nearly _STICKY
            sticky = 1.0 - (1.0 - _STICKY) * (1.0 - n.switch_share(job_id))
        key = (n.cost / rate * sticky, n.node_id)
        if best_key is None or key < best_key:
            best, best_key = n, key
    return best


def allocate(
    jobs: list[JobDemand], nodes: list[NodeSupply], params: SchedulerParams
) -> dict[str, str | None]:
    """The ideal placement, ignoring hysteresis (see the module docstring). Pure."""
    ledger = _Ledger(jobs, nodes, params.headroom)
    free = sorted(nodes, key=lambda n: n.node_id)
    out: dict[str, str | None] = {n.node_id: None for n in nodes}

    def take(job_id: str) -> bool:
        node = _best_node(job_id, free)
        if node is None:
            return False
        free.remove(node)
        out[node.node_id] = job_id
        ledger.add(job_id, node.rates[job_id])
        return True

    ordered = _order(jobs)
    for j in ordered:  # phase 1: one node each
        take(j.job_id)
    tiers: dict[int, list[JobDemand]] = {}
    for j in ordered:
        tiers.setdefault(j.priority, []).append(j)
    for prio in sorted(tiers, reverse=True):  # phase 2: fill needs, furthest from need first
        open_jobs = [j.job_id for j in tiers[prio]]
        while open_jobs:
            open_jobs = [
                jid
                for jid in open_jobs
                if ledger.met(jid) < 1.0 and ledger.count[jid] < ledger.cap[jid]
            ]
            if not open_jobs:
                break
            jid = min(open_jobs, key=lambda x: (ledger.met(x), ledger.count[x]))
            if not take(jid):
                open_jobs.remove(jid)
    return out


def _gain(
    ledger: _Ledger, node: NodeSupply, src: str, dst: str | None, min_gain: float
) -> tuple[float, str]:
    """How much moving ``node`` from ``src`` to ``dst`` gains, and why (see the module doc)."""
    r_src = node.rates.get(src, 0.0)
    loss = ledger.met(src) - ledger.met(src, ledger.have[src] - r_src)
    if dst is None:
        # A clear surplus, not a marginal one: the node would be called back at the next dip.
        if ledger.have[src] - r_src >= ledger.target[src] * (1.0 + min_gain):
            return math.inf, f"job {src} stays met without it: standby saves its cost"
        return -math.inf, ""
    r_dst = node.rates.get(dst, 0.0)
    gain_dst = ledger.met(dst, ledger.have[dst] + r_dst) - ledger.met(dst)
    p_src, p_dst = ledger.jobs[src].priority, ledger.jobs[dst].priority
    if ledger.count[dst] == 0 and ledger.count[src] >= 2 and p_dst >= p_src:
        return math.inf, f"job {dst} has no node"
    if p_dst > p_src:
        return gain_dst, f"job {dst} has priority over job {src}"
    if ledger.count[src] <= 1:  # never strand a job of equal or higher priority
        return -math.inf, ""
    if p_dst < p_src:
        if loss <= 1e-9:
            return gain_dst, f"job {src} can spare it"
        return -math.inf, ""
    return gain_dst - loss, f"job {dst} is further from its need"


def schedule(
    jobs: list[JobDemand],
    nodes: list[NodeSupply],
    now: float,
    params: SchedulerParams | None = None,
) -> Decision:
    """Place every node of ``nodes`` on one of ``jobs`` or on standby, with hysteresis.

    ``now`` is compared with each node's ``since``. Pure and deterministic; raises nothing.
    Cost: O(nodes x jobs) per node placed.
    """
    params = params or SchedulerParams()
    ideal = allocate(jobs, nodes, params)
    job_ids = {j.job_id for j in jobs}
    ledger = _Ledger(jobs, nodes, params.headroom)
    current: dict[str, str | None] = {}
    for n in nodes:
        job = n.job if n.job in job_ids and n.rates.get(n.job, 0.0) > 0 else None
        current[n.node_id] = job
        if job is not None:
            ledger.add(job, n.rates[job])
    moves: list[Move] = []
    for n in sorted(nodes, key=lambda n: n.node_id):
        src, dst = current[n.node_id], ideal[n.node_id]
        if dst == n.job:
            continue
        # Hysteresis weighs what the move costs: an adapter switch (same base) a tenth of a load.
        share = n.switch_share(dst)
        if src is None:
            why = "new or on standby" if n.job is None else f"job {n.job} ended or does not fit"
        elif now - n.since < params.min_stay_s * share:
            continue
        else:
            gain, why = _gain(ledger, n, src, dst, params.min_gain)
            if gain < params.min_gain * share:
                continue
            if share < 1.0:
                why += " (an adapter switch: the node holds the base)"
            ledger.remove(src, n.rates[src])
        if dst is not None:
            ledger.add(dst, n.rates[dst])
        current[n.node_id] = dst
        moves.append(Move(n.node_id, n.job, dst, why))
    views = {
        j.job_id: JobView(
            j.job_id,
            j.need_rps if j.need_rps is not None and math.isfinite(j.need_rps) else None,
            ledger.have[j.job_id],
            sorted(nid for nid, job in current.items() if job == j.job_id),
        )
        for j in jobs
    }
    return Decision(current, moves, views)
