"""Scoring submitted groups: each job's sandbox, awaited off the event loop, paid for by the sender.

Rewards are recomputed here from the completion text (DESIGN.md, step 6), and that text is
hostile: :class:`Scoring` hands it only to a job's :class:`~echo.tasks.sandbox.Sandbox` (a
confined process per group), and awaits it in a worker thread so that a slow scorer holds one
submission, never the loop that answers every other RPC, the HTTP API and housekeeping.

Three things keep strangers from spending the coordinator's CPU on the sandbox:

- **Separate slots.** Nodes with a run of valid results (:data:`TRUSTED_STREAK`) score in
  slots of their own; every other node shares :data:`NEW_NODE_SLOTS`. Scorer bombs from fresh
  identities queue behind each other, not in front of the swarm's honest work.
- **A per-node budget of scoring time.** Each group's wall seconds in the sandbox are charged
  to its node (a text that hit its timeout costs the whole timeout); a node whose budget is
  spent is refused before its next group is read, until the budget refills
  (:data:`SCORING_S_PER_MINUTE`).
- **A budget for all new nodes together** (:data:`NEW_NODES_S_PER_MINUTE`). One slot still
  lets fresh identities, each with its own full budget, keep a core busy with groups that
  run every text to its timeout: in benchmarks/attack.py five bombers' identities in 40 s
  took 54 % of the swarm's core and left the honest nodes 0.22 of their throughput. While
  that budget is spent, a new node's group is refused unread (``rate_limited``, not held
  against it) when its turn for the slot comes (:class:`NewNodesBusy`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from echo.coordinator.metrics import Metrics
from echo.p2p.budget import LruMap
from echo.tasks.sandbox import OK, Sandbox, Score

log = logging.getLogger("echo.coordinator.submissions.scoring")

# BOINC's adaptive replication trusts a host after about 10 valid results in a row.
TRUSTED_STREAK = 10
# Slots shared by nodes without that run: one, so they cannot take more than one core between
# them, whatever their number.
NEW_NODE_SLOTS = 1
# Honest groups score in milliseconds (the demo's in about 5 ms, 16 gym answers in 25 ms, 16
# math-verify ones in 40-60 ms here): half a core a node pays for a fast GPU node's long math
# answers many times over, and bounds what one identity's groups can take.
SCORING_S_PER_MINUTE = 30.0
# What a node may spend at once, and so the most one group may take: a few timeouts' worth,
# so a rare honest slow text never locks a node out.
SCORING_BURST_S = 30.0
# New nodes' groups together: a tenth of a core on average, while honest ones score in tens of
# milliseconds (a new node's first TRUSTED_STREAK groups cost it well under a second), so this
# admits dozens of honest newcomers a minute; the burst is one hostile group's worth (two texts
# run to TASK_COMPONENT_S, see echo.tasks.sandbox).
NEW_NODES_S_PER_MINUTE = 6.0
NEW_NODES_BURST_S = 20.0
# Budgets tracked at once; a flood of identities evicts the oldest (which start full again,
# but a new identity gets one lease, so that buys it one group).
MAX_TRACKED_NODES = 50_000


@dataclass
class _Bucket:
    level: float
    at: float

    def refill(self, now: float, per_minute: float, burst: float) -> _Bucket:
        self.level = min(burst, self.level + (now - self.at) * per_minute / 60.0)
        self.at = now
        return self


class NewNodesBusy(Exception):
    """New nodes' groups have spent their shared scoring budget for now (see the module doc)."""


class Scoring:
    """Groups scored in their job's sandbox, with slots and budgets per node (see the module
    doc). One per coordinator; the sandboxes belong to the running jobs."""

    def __init__(self, metrics: Metrics, trusted_slots: int | None = None) -> None:
        self.metrics = metrics
        self.trusted = trio.CapacityLimiter(trusted_slots or max(2, os.cpu_count() or 2))
        self.new = trio.CapacityLimiter(NEW_NODE_SLOTS)
        self._budgets: LruMap[str, _Bucket] = LruMap(MAX_TRACKED_NODES)
        self._new_nodes = _Bucket(NEW_NODES_BURST_S, time.monotonic())

    def budget_left(self, node_id: str, now: float | None = None) -> float:
        """Seconds of scoring ``node_id`` may still spend (refilled at the per-minute rate)."""
        bucket = self._bucket(node_id, time.monotonic() if now is None else now)
        return bucket.level

    def new_nodes_left(self, now: float | None = None) -> float:
        """Seconds of scoring all new nodes together may still spend."""
        now = time.monotonic() if now is None else now
        return self._new_nodes.refill(now, NEW_NODES_S_PER_MINUTE, NEW_NODES_BURST_S).level

    def _bucket(self, node_id: str, now: float) -> _Bucket:
        b = self._budgets.setdefault(node_id, lambda: _Bucket(SCORING_BURST_S, now))
        return b.refill(now, SCORING_S_PER_MINUTE, SCORING_BURST_S)

    def charge(self, node_id: str, seconds: float) -> None:
        """Charge ``node_id`` for ``seconds`` of scoring (the level may go below zero: a
        group that cost more than was left is paid off before the next is read)."""
        self._bucket(node_id, time.monotonic()).level -= seconds

    async def score(
        self,
        sandbox: Sandbox,
        node_id: str,
        prompt_id: int,
        texts: Sequence[str],
        *,
        trusted: bool,
        context: Any = None,
    ) -> list[Score]:
        """Each text's score from ``sandbox``, charged to ``node_id``; ``context`` is the
        job's ``task.scoring_context(prompt_id)`` (see :meth:`Sandbox.score`).

        Runs in a trio worker thread under the node's class of slots; not abandoned on
        cancellation (the sandbox bounds every text by its budget, so the wait is bounded).

        :raises SandboxError: the job's sandbox cannot start.
        :raises NewNodesBusy: ``trusted`` is false and new nodes' shared budget is spent.
        """
        if trusted:
            return await self._run(sandbox, node_id, prompt_id, texts, context, self.trusted)
        async with self.new:
            # Checked once the slot is ours: groups queued behind a hostile one would otherwise
            # all pass a check made while the budget still stood.
            left = self.new_nodes_left()
            if left <= 0:
                raise NewNodesBusy(f"new nodes' scoring budget spent ({left:.1f} s)")
            scores = await self._run(sandbox, node_id, prompt_id, texts, context, None, left)
        self._new_nodes.level -= sum(s.seconds for s in scores)
        return scores

    async def _run(
        self,
        sandbox: Sandbox,
        node_id: str,
        prompt_id: int,
        texts: Sequence[str],
        context: Any,
        limiter: trio.CapacityLimiter | None,
        class_left: float = float("inf"),
    ) -> list[Score]:
        # A group may spend what its node (and its class) has left, at least one text's
        # budget: a group of texts that each stop just inside their own timeout costs its
        # sender, not the slot.
        max_s = max(min(self.budget_left(node_id), class_left), sandbox.budget_s)
        t0 = time.perf_counter()
        scores = await trio.to_thread.run_sync(
            sandbox.score, prompt_id, list(texts), context, max_s, limiter=limiter
        )
        self.metrics.scoring_seconds.observe(time.perf_counter() - t0)
        self.charge(node_id, sum(s.seconds for s in scores))
        for s in scores:
            if s.outcome != OK:
                self.metrics.scoring_failures.labels(outcome=s.outcome).inc()
        summary = outcome_summary(scores)
        if summary:
            log.info("group from %s: %s", node_id[-8:], summary)
        return scores


def outcome_summary(scores: Sequence[Score]) -> str:
    """``"2 of 16 completions scored 0: scorer_timeout"`` for a reply's detail; "" if all ok."""
    bad = [s.outcome for s in scores if s.outcome != OK]
    if not bad:
        return ""
    return f"{len(bad)} of {len(scores)} completions scored 0: {', '.join(sorted(set(bad)))}"
