"""Timing each version's receipts against its plan: the only way a relay's uplink is confirmed.

:class:`Receipts` keeps, for each job's newest :data:`TIMED_VERSIONS` plans, what each child is
owed by each of its relay parents and when the plan was announced. When a child with accepted
work, on another network than its parent, reports holding a version (:meth:`Receipts.delivered`),
each of its parents in that version's plan is credited with the stripe bytes it owed that child
over the time the child took (at least the time the learner's own uplink needs for the whole
version: nobody can hold it sooner). The credited rate goes to
:meth:`echo.coordinator.dissemination.relays.RelayBeliefs.confirm` (the cap on what the parent
may claim of itself), the credited bytes to the credit ledger (:attr:`Receipts.on_relay_credit`)
and every timed edge to the dashboard (:attr:`Receipts.on_edge`). A child that reported a parent
as stalled (:meth:`Receipts.stalled`) credits it nothing for that version.

No I/O; raises nothing. Plans are remembered from a planning worker thread and receipts timed on
the trio thread: a lock guards the timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from echo.coordinator.dissemination.planner.plan import TreePlan
from echo.coordinator.dissemination.relays import RelayBeliefs
from echo.protocol import broadcast as b

# Versions per job whose plans are remembered to time the receipts by. A node reports holding a
# version within seconds of getting it; older versions' receipts are no longer timed.
TIMED_VERSIONS = 4


@dataclass
class _Credit:
    """What one parent was credited with in one version: bytes its children got, the longest
    any of them took, and the networks they were on (one credited child per network)."""

    nbytes: float = 0.0
    elapsed: float = 0.0
    networks: set[str] = field(default_factory=set)


@dataclass
class _Timing:
    """One announced plan, kept to time its receipts (:meth:`Receipts.delivered`)."""

    started: float
    floor_s: float  # the learner's own time to send the version once: nobody holds it sooner
    owed: dict[str, list[tuple[str, float]]]  # child -> [(relay parent, bytes of its stripe)]
    arrived: set[str] = field(default_factory=set)
    stalled: set[tuple[str, str]] = field(default_factory=set)  # (child, parent) it reported
    credit: dict[str, _Credit] = field(default_factory=dict)


def _owed(plan: TreePlan, total_bytes: int) -> dict[str, list[tuple[str, float]]]:
    """What each child of ``plan`` is owed by each of its relay parents (the source's own pushes
    are not timed: its uplink is the operator's figure)."""
    weights = list(plan.weights) or [1] * len(plan.stripes)
    owed: dict[str, list[tuple[str, float]]] = {}
    for stripe, weight in zip(plan.stripes, weights, strict=True):
        share = total_bytes * weight / sum(weights)
        for parent, kids in stripe.children.items():
            if parent == plan.source:
                continue
            for kid in kids:
                owed.setdefault(kid, []).append((parent, share))
    return owed


class Receipts:
    """The receipts of each job's newest plans, timed against them; see the module docstring.

    ``relays``: whose word counts, which network each node is on, and where confirmed uplinks
    go. ``clock``: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, relays: RelayBeliefs, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.relays = relays
        self._clock = clock
        # Called (job, version, parent, child, bytes) for each relay edge credited by a receipt
        # (:meth:`delivered`), and (job, version, parent, child, B/s) for each receipt timed.
        self.on_relay_credit: Callable[[str, int, str, str, float], None] | None = None
        self.on_edge: Callable[[str, int, str, str, float], None] | None = None
        self._timings: dict[tuple[str, int], _Timing] = {}  # the last TIMED_VERSIONS per job
        self._lock = threading.Lock()

    def expect(
        self, job_id: str, version: int, plan: TreePlan, total_bytes: int, floor_s: float
    ) -> None:
        """``plan`` was announced for ``version`` now: time its receipts from here, no sooner
        than ``floor_s`` after (the learner's own time to send the version once). Keeps the
        job's newest :data:`TIMED_VERSIONS` plans."""
        timing = _Timing(self._clock(), floor_s, _owed(plan, total_bytes))
        with self._lock:
            self._timings[(job_id, version)] = timing
            mine = sorted(v for j, v in self._timings if j == job_id)
            for old in mine[:-TIMED_VERSIONS]:
                del self._timings[(job_id, old)]

    def delivered(
        self, node_id: str, job_id: str, version: int, *, accepted: int | None = None
    ) -> None:
        """``node_id`` proved it holds ``version`` of ``job_id`` (its status named the version's
        digest): time its receipt and credit each relay parent of it in that version's plan
        (:class:`_Credit`). Counts only once per node and version, only for a node with
        :data:`~echo.coordinator.dissemination.relays.MIN_ACCEPTED` accepted groups
        (``accepted``; None: as of its last plan) on a network the dial-back saw, and only for
        parents on another network that the node did not report as stalled. A parent that
        pushed slowly while the child pulled the rest elsewhere is credited as if it had pushed
        all of it: bounded by the child's real time."""
        with self._lock:
            timing = self._timings.get((job_id, version))
        if timing is None or node_id in timing.arrived:
            return
        timing.arrived.add(node_id)
        elapsed = max(self._clock() - timing.started, timing.floor_s, 1e-3)
        if self.on_edge is not None:  # what the dashboard draws, credible or not
            for parent, nbytes in timing.owed.get(node_id, ()):
                self.on_edge(job_id, version, parent, node_id, nbytes / elapsed)
        network = self.relays.credible_network(node_id, accepted)
        if network is None:
            return
        for parent, nbytes in timing.owed.get(node_id, ()):
            plink = self.relays.links.get(parent)
            if plink is None or (node_id, parent) in timing.stalled or plink.network == network:
                continue
            credit = timing.credit.setdefault(parent, _Credit())
            if network in credit.networks:
                continue
            credit.networks.add(network)
            credit.nbytes += nbytes
            credit.elapsed = max(credit.elapsed, elapsed)
            self.relays.confirm(parent, (job_id, version), credit.nbytes / credit.elapsed)
            if self.on_relay_credit is not None:  # the credit ledger pays what is confirmed here
                self.on_relay_credit(job_id, version, parent, node_id, nbytes)

    def stalled(self, reporter: str, report: b.BadPeerReport) -> None:
        """``reporter`` says its parent ``report.peer_id`` stalled in ``report.version``: that
        parent gets no credit for the reporter's receipt of it (ignored when the version is no
        longer timed or the peer is no parent of the reporter there)."""
        with self._lock:
            timing = self._timings.get((report.job_id, report.version))
        if timing is not None and any(
            p == report.peer_id for p, _ in timing.owed.get(reporter, ())
        ):
            timing.stalled.add((reporter, report.peer_id))

    def forget(self, job_id: str) -> None:
        """Drop a finished job's timings."""
        with self._lock:
            for key in [k for k in self._timings if k[0] == job_id]:
                del self._timings[key]


__all__ = ["TIMED_VERSIONS", "Receipts"]
