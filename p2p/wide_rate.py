"""Handshakes a wide network (/16, IPv6 /32) may start while none of its peers is protected.

:class:`~echo.p2p.conn_guard.ConnectionGuard` caps each /24 (/48): its open connections and its
handshake rate (its cap at once, then its cap's worth every 8 s). A churn of identities that
moves on to the next /24 of its /16 gets each new /24's full allowance: ``benchmarks/attack.py``'s
churner, spread over 127.1.0.0/16, reached 2-4.5 identities a second, and each cost the
coordinator ~17 ms of CPU for the connection alone (TCP, Noise, yamux, multiselect, identify) and
~30-40 ms with its requests (``benchmarks/churn_cost.py``), all before any budget of ours could
see who it was. :class:`WideRate` adds one token bucket per wide network, spent only while that
network holds no connection of a protected peer (a node with accepted work, the learner): a
wide network that has proven nothing starts :data:`WIDE_BURST` handshakes at once and then one
every :data:`WIDE_REFILL_S` / :data:`WIDE_BURST` seconds. Honest volunteers share a /16 only
with their ISP's other customers, and one that is refused retries; the networks that carry
proven work are never slowed, and private networks (an operator's lab, whose 64 nodes on one
/24 start at once) have only their /24's rate.

Owns the buckets (bounded: least recently seen dropped, which costs only a burst). Raises
nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from echo.p2p.budget import LruMap
from echo.p2p.prefixes import wide_of

# A wide network without a protected peer: this many handshakes at once, then this many again
# every WIDE_REFILL_S (1 a second). Far above what honest newcomers from one ISP's /16 ask, far
# below a churner's 5 a second.
WIDE_BURST = 16
WIDE_REFILL_S = 16.0
# Wide networks whose bucket is kept at once (a dropped one starts again with a full burst).
MAX_TRACKED_WIDE = 20_000


class WideRate:
    """One token bucket per wide network (see the module docstring); ``clock`` is monotonic
    seconds (injectable for tests)."""

    def __init__(
        self,
        burst: int = WIDE_BURST,
        refill_s: float = WIDE_REFILL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or refill_s <= 0:
            raise ValueError(f"burst must be >= 1 and refill_s > 0, got {burst}, {refill_s}")
        self.burst, self.refill_s, self._clock = burst, refill_s, clock
        self._buckets: LruMap[str, tuple[float, float]] = LruMap(MAX_TRACKED_WIDE)
        self.refused = 0  # handshakes refused over a wide network's rate, ever

    def take(self, address: str, vouched: Callable[[str], bool]) -> bool:
        """Whether a handshake from ``address`` may start now, spending one of its wide
        network's tokens unless ``vouched(network)`` (a protected peer is connected from
        there). Addresses that are not IPs pass."""
        network = wide_of(address)
        if network is None or vouched(network):
            return True
        now = self._clock()
        left, at = self._buckets.get(network) or (float(self.burst), now)
        left = min(float(self.burst), left + (now - at) * self.burst / self.refill_s)
        if left < 1.0:
            self._buckets.put(network, (left, now))
            self.refused += 1
            return False
        self._buckets.put(network, (left - 1.0, now))
        return True


__all__ = ["MAX_TRACKED_WIDE", "WIDE_BURST", "WIDE_REFILL_S", "WideRate"]
