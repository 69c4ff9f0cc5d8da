"""A scheduling pass's inputs: what each runnable job needs, and what each node counts for there.

:class:`PassInputs` turns the store and the placement's node records (:class:`NodeRecord`) into
the :func:`~echo.coordinator.scheduling.assign.schedule` inputs: a
:class:`~echo.coordinator.scheduling.assign.JobDemand` per runnable job (its measured terms,
:mod:`.measure`, and the operator's settings) and a
:class:`~echo.coordinator.scheduling.assign.NodeSupply` per active node (its declared cost, where
it works now, and the rollouts/s it counts for on each job it fits, :mod:`.fit`).

Identities are free, so what a node counts for is bounded by what the coordinator verified of it,
never by its own word alone:

- a node without an accepted group counts for :data:`UNPROVEN_SHARE` of its estimate (it is
  still placed, and measured, where a job lacks throughput), or a swarm of fresh identities
  "meets" a job's need and benches the nodes that do the work (found by benchmarks/attack.py);
- a node counts for no more than it delivered: its delivered rate on a job (accepted groups,
  :meth:`NodeRecord.update_delivered`) is the estimate itself; without one, its estimate is
  capped by its accepted rollouts over its time in the swarm. Counting reported rates let nodes
  that had stopped working keep the need "met" while honest nodes were put on standby
  (tests/e2e/test_adversaries.py: 44 of 150 versions in 330 s).

No I/O beyond store reads; raises nothing for well-formed rows.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.scheduling.assign import JobDemand, NodeSupply
from echo.coordinator.scheduling.bases import BaseBook, net_need
from echo.coordinator.scheduling.fit import delivered_rate, estimate_rate, misfit, param_count
from echo.coordinator.scheduling.measure import JobTerms, job_terms
from echo.coordinator.store import Store

# Nodes heard from within this long are scheduled (an idle node registers every few seconds).
ACTIVE_S = 60.0
# Rollouts/s assumed for a node nothing is known of (only ranks matter until it reports).
UNKNOWN_RATE = 1.0
# The share of its estimated rate a node without an accepted group counts for: a thousand
# fresh identities weigh as one proven node.
UNPROVEN_SHARE = 1e-3
# A node's lifetime delivered rate (the cap on its report before it has a windowed delivered rate
# on the job) is averaged over at least this long, so its first accepted groups do not read as a
# burst (an underestimate only activates more nodes; an overestimate benches them).
DELIVERY_MIN_AGE_S = 60.0


@dataclass
class NodeRecord:
    """What the placement knows of one node: what it declared, measured and delivered (the
    inputs here) and where it works (:class:`~echo.coordinator.scheduling.placement.Placement`
    keeps that part)."""

    cost: float = 1.0
    engine: str = ""
    hardware: dict[str, Any] = field(default_factory=dict)
    declared_tps: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)  # job -> reported tok/s, newest last
    # job -> completions/s the coordinator accepted from it there (newest last), and the
    # (accepted_at, completions) of its recent accepted groups per job.
    delivered: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # job -> version it reported holding
    job: str | None = None
    since: float = 0.0
    decided: bool = False  # placed by a scheduling pass (else: never, or adopted)
    switches: int = 0
    proven: bool = False  # has Placement.relay_groups accepted groups (any job)
    seen: float = field(default_factory=time.time)  # last heard from (see placement.FORGET_S)

    def update_delivered(self, now: float) -> None:
        """Update the delivered rate on the job the node serves (rates on jobs it left stay as
        they were when it left: what it delivered there)."""
        if self.job is None:
            return
        rate = delivered_rate(self.accepted.get(self.job, ()), self.since, now)
        if rate is None:
            return
        self.delivered.pop(self.job, None)  # re-inserted last: the newest measure
        if rate > 0:
            self.delivered[self.job] = rate
        # else nothing delivered for a whole window: no measure, and the node's report counts for
        # no more than its lifetime delivery (see supplies) -- not 0, which would bench it for good


class PassInputs:
    """The inputs of each scheduling pass, and what the last pass counted; see the module
    docstring.

    ``nodes`` is the placement's node records (read, and refreshed from the store's rows: last
    seen, proven, hardware); ``relay_groups`` the accepted groups that make a node proven.
    Caches each job's measured terms (per version) and model size, which also calibrate a
    node's rates on jobs that ended.
    """

    def __init__(
        self, store: Store, nodes: dict[str, NodeRecord], relay_groups: int, bases: BaseBook
    ) -> None:
        self.store = store
        self.nodes = nodes
        self.bases = bases  # LoRA jobs' bases: sibling jobs' deliveries, adapter switches
        self.relay_groups = relay_groups
        self._terms: dict[str, tuple[int, JobTerms]] = {}
        self._params_count: dict[str, int] = {}
        self.misfits: dict[str, str] = {}  # node -> why no running job fits it
        self.rates: dict[str, dict[str, float]] = {}  # node -> job -> rollouts/s, last pass

    def busy(self, job_id: str) -> float | None:
        """The learner's measured utilization on the job (None: not measured yet)."""
        terms = self._terms.get(job_id)
        return terms[1].busy if terms is not None else None

    def _job_terms(self, job_id: str, job: RunningJob, version: int) -> JobTerms:
        cached = self._terms.get(job_id)
        if cached is None or cached[0] != version:
            row = self.store.job(job_id)
            spec = row.spec if row is not None else job.spec.model_dump(mode="json")
            cached = (version, job_terms(self.store, job_id, spec, job.max_new_tokens))
            self._terms[job_id] = cached
        return cached[1]

    def _params_of(self, job_id: str, job: RunningJob) -> int:
        if job_id not in self._params_count:
            self._params_count[job_id] = param_count(job.spec.model_spec_dict())
        return self._params_count[job_id]

    def gather(
        self, runnable: Mapping[str, RunningJob], now: float
    ) -> tuple[list[JobDemand], list[NodeSupply]]:
        """The demands of the ``runnable`` jobs and the supplies of the nodes heard from within
        :data:`ACTIVE_S` (records made for those the placement does not know yet); keeps each
        node's rates and, for a node no running job fits, why (:attr:`misfits`)."""
        demands = []
        # Jobs that ended keep their terms and sizes: a node's rates there still calibrate it.
        tpr = {job_id: t.tokens_per_rollout for job_id, (_, t) in self._terms.items()}
        sizes = dict(self._params_count)
        shared = self.bases.shared_rates(self.nodes, runnable, now)  # by nodes of a sibling job
        for job_id, job in runnable.items():
            row = self.store.job(job_id)
            assert row is not None  # runnable
            terms = self._job_terms(job_id, job, row.current_version)
            tpr[job_id], sizes[job_id] = terms.tokens_per_rollout, self._params_of(job_id, job)
            sched = job.spec.schedule
            demands.append(
                JobDemand(job_id, net_need(terms.need_rps, shared.get(job_id, 0.0)),
                          sched.priority, sched.max_share, row.created_at)  # fmt: skip
            )
        supplies, self.rates = [], {}
        # Per job, once a pass: a median over every known node, asked for each node without a
        # rate of its own -- per node, a churn's fresh identities made the pass quadratic.
        typical: dict[str, float] = {}
        for row in self.store.active_nodes(now - ACTIVE_S):
            node = self.nodes.setdefault(row.node_id, NodeRecord(engine=row.engine))
            node.seen = max(node.seen, row.last_seen)
            node.proven = row.accepted >= self.relay_groups
            node.update_delivered(now)
            if not node.hardware:
                node.hardware, node.declared_tps = dict(row.hardware), row.tokens_per_s
            rates, why_not = {}, []
            for job_id, job in runnable.items():
                reason = misfit(
                    job.spec.model_spec_dict(), job.spec.publish_dtype, node.hardware, node.engine
                )
                if reason is not None:
                    why_not.append(reason)
                    continue
                rate = estimate_rate(
                    node.measured, sizes, tpr, job_id, node.declared_tps, node.delivered
                )
                if rate is None:
                    if job_id not in typical:
                        typical[job_id] = self.typical_rate(job_id, tpr)
                    rate = typical[job_id]
                # What the node counts for: bounded by what it delivered (module docstring).
                if row.accepted <= 0:
                    rates[job_id] = rate * UNPROVEN_SHARE
                elif job_id in node.delivered:
                    rates[job_id] = rate
                else:
                    lifetime = (
                        row.accepted
                        * job.spec.group_size
                        / max(now - row.first_seen, DELIVERY_MIN_AGE_S)
                    )
                    rates[job_id] = min(rate, lifetime)
            if why_not and not rates:
                self.misfits[row.node_id] = why_not[0]
            else:
                self.misfits.pop(row.node_id, None)
            switch = self.bases.shares(node.held, rates)  # adapter switches, not loads
            supplies.append(NodeSupply(row.node_id, rates, node.cost, node.job, node.since, switch))
            self.rates[row.node_id] = rates
        return demands, supplies

    def typical_rate(self, job_id: str, tpr: Mapping[str, float]) -> float:
        """The median rate the job's nodes delivered (else reported), for a node of which
        nothing is known."""
        nodes = self.nodes.values()
        delivered = [n.delivered[job_id] for n in nodes if n.delivered.get(job_id)]
        if delivered:
            return statistics.median(delivered)
        seen = [n.measured[job_id] for n in nodes if n.measured.get(job_id)]
        if not seen:
            return UNKNOWN_RATE
        return statistics.median(seen) / max(tpr.get(job_id, 1.0), 1e-9)


__all__ = ["ACTIVE_S", "NodeRecord", "PassInputs"]
