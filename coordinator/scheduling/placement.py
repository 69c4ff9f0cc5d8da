"""Applying the scheduler: where each node works, kept current as jobs and nodes come and go.

:class:`Placement` owns the coordinator's in-memory placement of nodes on jobs (soft state: a
restarted coordinator places nodes afresh as they register, ask for leases or report). It books
what the node RPCs say of each node (:class:`~echo.coordinator.scheduling.inputs.NodeRecord`:
declared cost, memory and engine, the tokens/s each reports, and the groups the coordinator
accepted from it, :meth:`Placement.accepted`), runs
:func:`~echo.coordinator.scheduling.assign.schedule` on the inputs
:class:`~echo.coordinator.scheduling.inputs.PassInputs` gathers from those records (what each
job needs, what each node counts for there) every ``every_s`` and soon after a node registers
unplaced, and answers the node RPCs: the job a registering node is placed on, and whether a
node asking for leases has been moved. Nodes learn of a move from their next lease
reply (``LeaseReply.assigned_job``) or, when idle, their next registration.

Identities are free, so nothing a stranger sends buys a pass of its own: registrations that need
one wait for the next, at most every :data:`PASS_COALESCE_S` (:meth:`Placement.place`), and what
is kept per node is bounded -- per-job entries only for the live jobs, and a node not heard from
for :data:`FORGET_S` is forgotten (:meth:`Placement.refresh`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import trio

from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.scheduling.assign import Decision, JobView, SchedulerParams, schedule
from echo.coordinator.scheduling.bases import BaseBook
from echo.coordinator.scheduling.fit import DELIVERY_WINDOW_S
from echo.coordinator.scheduling.inputs import ACTIVE_S, NodeRecord, PassInputs
from echo.coordinator.store import Store
from echo.coordinator.store.rows import JobRow
from echo.protocol import messages as m

log = logging.getLogger("echo.coordinator.scheduling.assign")

# Accepted groups kept per node and job for its delivered rate: far more than a window holds at
# the submission rate limit's pace is not needed (older ones leave the window anyway).
DELIVERY_KEPT = 512
# Passes that registrations (or a standby node's lease request) ask for run at most this often:
# a pass costs O(active nodes x jobs) per node placed, and a churn of identities registered 5
# per second, each with a pass of its own. A registering node waits at most this long.
PASS_COALESCE_S = 0.25
# A node not heard from (registration, status, lease, accepted group) for this long is forgotten:
# far past ACTIVE_S, so a node that pauses keeps its measured rates, while a churn of identities
# leaves at most FORGET_S of them behind. Placement is soft state: a node that comes back later
# is placed afresh, as after a coordinator restart.
FORGET_S = 10 * ACTIVE_S
# Scheduler moves remembered for the dashboard (soft state, like the placement itself).
MOVES_KEPT = 200


class Placement:
    """The placement of nodes on jobs (see the module docstring).

    One class because one fact, where each node works, is read and written by every method: the
    node RPC hooks (registration, status, lease, accepted group) both update what is known of a
    node and answer from the current placement, and a pass replaces that placement as a whole.
    Split, the hooks would have to reach across to decide whether a node needs a pass. What a
    pass is computed from -- each job's need and what each node counts for there, under the
    trust caps -- is :class:`~echo.coordinator.scheduling.inputs.PassInputs`' part.

    ``jobs`` is the live jobs of :class:`~echo.coordinator.jobs.control.JobControl`.
    """

    def __init__(
        self,
        store: Store,
        jobs: Mapping[str, RunningJob],
        params: SchedulerParams | None = None,
        every_s: float = 2.0,
        relay_groups: int = 1,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.bases = BaseBook(store)  # LoRA jobs' bases: what a move costs a node
        self.params = params or SchedulerParams()
        self.every_s = every_s
        self.nodes: dict[str, NodeRecord] = {}
        # Accepted groups a node needs to be planned as a relay (see proven()).
        self.inputs = PassInputs(store, self.nodes, relay_groups, self.bases)
        self.views: dict[str, JobView] = {}
        self.switches_into: Counter[str] = Counter()
        # The last MOVES_KEPT moves, (when, node, from, to, why), for the operator's dashboard.
        self.moves: deque[tuple[float, str, str | None, str | None, str]] = deque(
            maxlen=MOVES_KEPT
        )
        self.passes = 0  # scheduling passes run so far
        self._last_pass = -math.inf  # time.monotonic() of the last one

    # ------------------------------------------------------------------ node RPC hooks

    def registered(self, node_id: str, reg: m.Register) -> tuple[str, str]:
        """Book a node's registration; its job ("" for none) and what to tell it. Runs a pass
        of its own when the node needs one: the registration handler calls :meth:`place`,
        which coalesces them."""
        node = self._book(node_id, reg)
        if self._needs_pass(node):
            self.refresh()
        return node.job or "", self._idle_reason(node_id)

    async def place(self, node_id: str, reg: m.Register) -> tuple[str, str]:
        """Book a node's registration; its job ("" for none) and what to tell it, as
        :meth:`registered`, except that a node which needs a pass waits for the next one
        (at most :data:`PASS_COALESCE_S`) and every registration waiting then shares it."""
        node = self._book(node_id, reg)
        if self._needs_pass(node):
            await self._next_pass()
        return node.job or "", self._idle_reason(node_id)

    def _book(self, node_id: str, reg: m.Register) -> NodeRecord:
        node = self.nodes.setdefault(node_id, NodeRecord())
        node.cost, node.engine = reg.cost, reg.engine
        node.hardware, node.declared_tps = reg.hardware.to_obj(), reg.tokens_per_s
        node.seen = time.time()
        return node

    def _needs_pass(self, node: NodeRecord) -> bool:
        return not node.decided or node.job not in self._runnable()

    async def _next_pass(self) -> None:
        """Return once a pass that started after this call has run: the first waiter to reach
        :data:`PASS_COALESCE_S` after the last pass runs it, for every waiter."""
        want = self.passes + 1
        while self.passes < want:
            wait = self._last_pass + PASS_COALESCE_S - time.monotonic()
            if wait <= 0:
                self.refresh()
            else:
                await trio.sleep(wait)

    def _refresh_if_due(self) -> None:
        """A pass, unless one ran within :data:`PASS_COALESCE_S` (the periodic pass follows)."""
        if time.monotonic() - self._last_pass >= PASS_COALESCE_S:
            self.refresh()

    def observed(self, node_id: str, job_id: str, tokens_per_s: float, version: int) -> None:
        """A node's status: its delivered tokens/s on ``job_id`` and the version it holds. A
        status naming a job that is not live is only a sign of life: the per-job entries are
        keyed by the live jobs alone, whatever ``job_id`` a node writes."""
        live = job_id in self.jobs
        node = self.nodes.get(node_id)
        if node is None:  # a node from before a coordinator restart: it works where it says
            if not live:
                return
            node = self.nodes[node_id] = NodeRecord(job=job_id, since=time.time())
        node.seen = time.time()
        if not live:
            return
        if tokens_per_s > 0:
            node.measured.pop(job_id, None)  # re-inserted last: the newest measure
            node.measured[job_id] = tokens_per_s
        if version >= 0:
            node.held[job_id] = version

    def accepted(
        self, node_id: str, job_id: str, completions: int, at: float | None = None
    ) -> None:
        """The coordinator accepted a group of ``completions`` from the node for ``job_id``: the
        node's delivered throughput is counted from these (see :meth:`refresh`), never from its
        own report."""
        node = self.nodes.setdefault(node_id, NodeRecord())
        at = time.time() if at is None else at
        node.seen = max(node.seen, at)
        times = node.accepted.setdefault(job_id, deque(maxlen=DELIVERY_KEPT))
        times.append((at, completions))
        while times and times[0][0] < at - DELIVERY_WINDOW_S:
            times.popleft()

    def redirect(self, node_id: str, job_id: str) -> str | None:
        """None when the node should keep working for ``job_id``; else where the scheduler put
        it (a job id, or "" for standby). A node not placed yet is adopted on ``job_id``."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeRecord(job=job_id, since=time.time())
            return None
        node.seen = time.time()
        if node.job is None and not node.decided:
            node.job, node.since = job_id, time.time()
            return None
        if node.job is None and job_id in self._runnable():
            # Placed on standby while nothing ran, say: look again. Not a pass per request,
            # though: a standby identity may ask for leases 20 times a second.
            self._refresh_if_due()
        if node.job == job_id or job_id not in self._runnable():
            return None  # a job that ended says so itself ("job is done")
        if self.bases.same_base(node.job, job_id):
            return None  # a node serves every job of its job's base (RegisterReply.base_jobs)
        return node.job or ""

    def moved(self, node_id: str, row: JobRow) -> m.LeaseReply | None:
        """The lease reply that tells a node asking for leases of ``row``'s job where the
        scheduler moved it (no leases); None when it stays (see :meth:`redirect`)."""
        dst = self.redirect(node_id, row.job_id)
        if dst is None:
            return None
        return m.LeaseReply(
            leases=[],
            current_version=row.current_version,
            retry_after_s=0.0,
            message=f"moved to job {dst}" if dst else "moved to standby",
            assigned_job=dst,
        )

    def plannable(self, node_id: str, job_id: str, anchor: bool) -> bool:
        """Whether a version of ``job_id`` may be planned through the node: it serves the job
        and holds one of its versions, or the version is an anchor (which needs no base). A
        job new since the last pass is scheduled first, so its first version reaches the nodes
        placed on it."""
        if job_id not in self.views:
            self.refresh()
        node = self.nodes.get(node_id)
        if node is None or node.job != job_id:
            return False
        return anchor or node.held.get(job_id, -1) >= 0

    def proven(self, node_id: str) -> bool:
        """The node has had a group accepted (as of the last scheduling pass). Identities are
        free: planned as relays before they had delivered anything, 16 lease hoarders (no relay
        at all) sat in anchors' trees and stalled their subtrees (benchmarks/attack.py), so an
        unproven node is planned as a leaf. Left out of plans instead, a new node had to pull
        whole versions and, on a fast job, never caught up to earn its first acceptance.
        One group was not enough either: stale-version hoarders that bought a lease quota with 3
        sat at the roots of stripes, and when they stopped, every honest node waited out its
        push stall (10 s) for each version (benchmarks/attack.py); the coordinator sets
        ``relay_groups`` to ``[verification] proven_groups``."""
        node = self.nodes.get(node_id)
        return node is not None and node.proven

    def serves(self, node_id: str, job_id: str) -> bool:
        """The node is placed on ``job_id``."""
        node = self.nodes.get(node_id)
        return node is not None and node.job == job_id

    # ------------------------------------------------------------------ scheduling

    def _runnable(self) -> dict[str, RunningJob]:
        out = {}
        for job_id, job in self.jobs.items():
            row = self.store.job(job_id)
            if row is not None and row.status == "running" and row.current_version >= 0:
                out[job_id] = job
        return out

    def _starting(self) -> bool:
        """Whether a job is submitted or runs whose learner has not published version 0 yet."""
        rows = (self.store.job(job_id) for job_id in self.jobs)
        return any(
            r is not None and r.status in ("pending", "running") and r.current_version < 0
            for r in rows
        )

    def _forget(self, now: float) -> None:
        """Drop the nodes not heard from for :data:`FORGET_S` (see the module docstring)."""
        gone = [nid for nid, n in self.nodes.items() if n.seen < now - FORGET_S]
        for nid in gone:
            del self.nodes[nid]
            self.inputs.misfits.pop(nid, None)

    def refresh(self, now: float | None = None) -> Decision:
        """Run one scheduling pass over the runnable jobs and active nodes, and apply it; forget
        the nodes gone for :data:`FORGET_S`."""
        now = time.time() if now is None else now
        self.passes += 1
        self._last_pass = time.monotonic()
        demands, supplies = self.inputs.gather(self._runnable(), now)
        decision = schedule(demands, supplies, now, self.params)
        self._apply(decision, now)
        self._forget(now)
        self.bases.forget(self.jobs)
        return decision

    def _apply(self, decision: Decision, now: float) -> None:
        for move in decision.moves:
            node = self.nodes[move.node_id]
            loads = move.src is not None and move.dst is not None  # not an adapter of its base:
            if loads and not self.bases.same_base(move.src, move.dst):  # a model to download
                node.switches += 1
                self.switches_into[move.dst] += 1
            node.job, node.since = move.dst, now
            self.moves.append((now, move.node_id, move.src, move.dst, move.why))
            log.info(
                "node %s: %s -> %s (%s)",
                move.node_id[-8:],
                move.src or "standby",
                move.dst or "standby",
                move.why,
            )
        for node_id in decision.assignment:
            self.nodes[node_id].decided = True
        self.views = decision.jobs

    def _idle_reason(self, node_id: str) -> str:
        node = self.nodes[node_id]
        if node.job is not None:
            return ""
        if not self._runnable():
            return m.JOB_STARTING if self._starting() else "no running job"
        if node_id in self.inputs.misfits:
            return f"no running job fits this node: {self.inputs.misfits[node_id]}"
        return "standby: the running jobs have the throughput they need"

    async def run_forever(self) -> None:
        """Refresh every ``every_s`` until cancelled; a failing pass is logged, not fatal."""
        while True:
            await trio.sleep(self.every_s)
            try:
                self.refresh()
            except Exception:  # one bad pass must not stop the coordinator's scheduling
                log.exception("scheduling pass failed")

    # ------------------------------------------------------------------ operator view

    def job_view(self, job_id: str) -> dict[str, Any]:
        """A job's placement for the API: its nodes, measured need, throughput they deliver,
        the learner's state (per the capacity model) and measured utilization."""
        view = self.views.get(job_id)
        busy = self.inputs.busy(job_id)
        if view is None:
            nodes = sorted(nid for nid, n in self.nodes.items() if n.job == job_id)
            return {
                "nodes": nodes,
                "need_rollouts_per_s": None,
                "have_rollouts_per_s": None,
                "learner": "not running",
                "learner_busy": busy,
                "switches_in": self.switches_into[job_id],
            }
        return {
            "nodes": view.nodes,
            "need_rollouts_per_s": view.need_rps,
            "have_rollouts_per_s": view.have_rps,
            # Each node's share of it: the rollouts/s the scheduler counts it for on this job.
            "node_rollouts_per_s": {
                nid: self.inputs.rates.get(nid, {}).get(job_id, 0.0) for nid in view.nodes
            },
            "learner": view.state,
            "learner_busy": busy,
            "switches_in": self.switches_into[job_id],
        }
