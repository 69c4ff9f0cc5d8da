"""What a misbehaving node costs itself: a per-node submission rate limit, and exclusion.

:class:`Penalties` owns the sliding one-minute window of each node's submissions and the rule
that excludes a node once its verification failures reach ``exclude_after_failures`` and
``exclude_failure_share`` of its results
(:meth:`Store.set_excluded <echo.coordinator.store.nodes.NodeTables.set_excluded>` then expires
its leases and drops its untrained work). Framing violations on any stream count as failures of a
registered node. Nothing here raises for a node id the store does not know.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from libp2p.peer.id import ID

from echo.coordinator.config import VerificationSection
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import Store
from echo.p2p.budget import LruMap
from echo.p2p.conn_guard import ConnectionGuard
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError

log = logging.getLogger("echo.coordinator")

# The rate limit's window; ``submissions_per_minute`` counts submissions within it.
RATE_WINDOW_S = 60.0
# Nodes whose submission windows are kept at once (only registered nodes with a lease get one).
MAX_TRACKED_NODES = 20_000


class Penalties:
    """Rate limits and exclusion over the store's node records; see the module docstring."""

    def __init__(self, store: Store, metrics: Metrics, verification: VerificationSection) -> None:
        self.store = store
        self.metrics = metrics
        self.verification = verification
        # Bounded: a flood of identities cannot grow it (the least recently seen are dropped).
        self._submit_times: LruMap[str, deque[float]] = LruMap(MAX_TRACKED_NODES)
        # The host's connection guard (set by NodeRPC.install): an excluded node loses the
        # protection from idle reaping that its accepted work gave it.
        self.guard: ConnectionGuard | None = None

    def rate_ok(self, node_id: str) -> bool:
        """Count one submission of the node; False (and not counted) when over its rate."""
        window = self._submit_times.setdefault(node_id, deque)
        now = time.monotonic()
        while window and now - window[0] > RATE_WINDOW_S:
            window.popleft()
        if len(window) >= self.verification.submissions_per_minute:
            return False
        window.append(now)
        return True

    def maybe_exclude(self, node_id: str) -> None:
        """Exclude the node (once) if its verification failures reached the limit and are at
        least ``exclude_failure_share`` of its results. A count alone excluded honest nodes:
        3 of 3 in one long run, each after ~1,100 accepted groups and 5 false rejections."""
        node = self.store.node(node_id)
        if (
            node is not None
            and not node.excluded
            and node.failures >= self.verification.exclude_after_failures
            and node.failures
            >= self.verification.exclude_failure_share * (node.accepted + node.failures)
        ):
            self.store.set_excluded(node_id, True)
            self.metrics.nodes_excluded.inc()
            if self.guard is not None:  # reaped like any stranger from now on
                self.guard.unprotect(node_id)
            log.warning("node %s excluded after %d failures", node_id[-8:], node.failures)

    def on_violation(self, peer_id: ID, error: ProtocolError) -> None:
        """The host's listener for framing violations: a failure of a registered node that is
        not excluded yet (an excluded one's junk is not worth a row; the host's gate already
        put it in backoff)."""
        node_id = str(peer_id)
        self.metrics.violations.labels(code=error.code).inc()
        node = self.store.node(node_id)
        if node is not None and not node.excluded:
            self.store.record_rejection(
                "", node_id, "", R.MALFORMED, str(error), counts_against=True
            )
            self.maybe_exclude(node_id)
        log.info("framing violation from %s: %s", node_id, error)
