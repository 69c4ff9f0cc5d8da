"""Lease terms by record: how long a node has for its leases, and how much of a window it may hold.

:class:`LeaseTerms` owns three answers that depend on what a node has delivered before, both
against hoarding by identities with a thin record (issue 26, finding 2 and "Done means"):

- **The term.** A lease's deadline is sized to its node's own measured delivery time (issue to
  accepted group, its slowest of the last :data:`DELIVERIES_SAMPLED` accepted groups) times
  ``lease_term_factor``, never under ``min_lease_s`` nor over ``lease_timeout_s``. A node with
  no delivered group gets the job's full ``lease_timeout_s`` (its speed is unknown, and nodes
  without an accepted group already share a small part of the window). A node that delivers in
  2 s and turns to hoarding holds each grant for ``min_lease_s`` (20 s), not the job's 30 s.
- **The share of the unproven.** Nodes with fewer than ``proven_groups`` accepted groups share
  ``fresh_lease_share`` of a job's lease window while a proven node is active: identities are
  free and a few honest groups are cheap, so a handful of them must never hold the window of a
  node with a record ("buffer full" for the node doing the work). With no proven node active
  (a swarm just started) there is nobody to protect, and the unproven share the window.

- **The share of the delivered.** A node holds at most its share of the job's window in
  proportion to its share of the job's :data:`SHARE_SAMPLE_WINDOWS` windows' worth of newest
  accepted groups, rounded up and at least one. A node that takes leases and returns stale groups
  or nothing delivers none of the recent groups, so its window shrinks to one lease within a few
  windows of work, whatever record it bought before; honest nodes' shares add up to the whole
  window; a newcomer (or a node back from a slow patch) keeps one lease and grows with what it
  delivers. Unlike the unproven share it needs no proven node: in a quick swarm nobody had
  ``proven_groups`` yet, and three hoarders with 3 groups each held 5 of the window of 8.

All three read the store through indexed queries only (a node's newest rollouts; the open leases of
one job; active nodes' index range, stopped at the first proven one).
"""

from __future__ import annotations

import math
import time

from echo.coordinator.config import VerificationSection
from echo.coordinator.store import Store

# How many of a node's newest accepted groups its delivery time is measured over: enough that
# one fast grant does not shorten the term of a node that is often slow.
DELIVERIES_SAMPLED = 8
# A node heard from within this long counts as active (as in
# echo.coordinator.rpc.common.NODE_ACTIVE_S).
ACTIVE_S = 60.0
# A node's share of the window is measured over the job's newest accepted groups, this many
# windows' worth: a few versions of work, so that a node which stopped delivering loses its share
# within seconds to a minute, and one lucky grant does not make a share.
SHARE_SAMPLE_WINDOWS = 4


class LeaseTerms:
    """Deadlines and the unproven nodes' share of a window; see the module docstring."""

    def __init__(self, store: Store, verification: VerificationSection) -> None:
        self.store = store
        self.verification = verification

    def term_s(self, node_id: str) -> float:
        """Seconds the node gets for a lease issued now (see the module docstring)."""
        cfg = self.verification
        took = self.store.delivery_times(node_id, DELIVERIES_SAMPLED)
        if not took:
            return cfg.lease_timeout_s
        sized = max(cfg.min_lease_s, cfg.lease_term_factor * max(took))
        return min(cfg.lease_timeout_s, sized)

    def unproven_room(self, job_id: str, accepted: int, window: int) -> int | None:
        """How many more leases of the job's ``window`` a node with ``accepted`` groups may
        take as one of the unproven (None: no such limit applies to it now)."""
        cfg = self.verification
        if not cfg.lease_quota_ramp or accepted >= cfg.proven_groups:
            return None  # a ramp of 0: the operator trusts identities at once
        if not self.store.proven_node_active(time.time() - ACTIVE_S, cfg.proven_groups):
            return None
        allowance = max(1, int(window * cfg.fresh_lease_share))
        return allowance - self.store.open_lease_count_unproven(job_id, cfg.proven_groups)

    def share_cap(self, job_id: str, node_id: str, window: int) -> int | None:
        """The most open leases of the job's ``window`` the node may hold by its share of the
        job's recent deliveries (None: too few yet to judge anyone, or no ramp configured)."""
        if not self.verification.lease_quota_ramp:
            return None  # a ramp of 0: the operator trusts identities at once
        recent = self.store.recent_deliveries(job_id, SHARE_SAMPLE_WINDOWS * window)
        total = sum(recent.values())
        if total < window:  # a job just started: nothing to compare with
            return None
        return max(1, math.ceil(window * recent.get(node_id, 0) / total))
