"""A node's own pace towards its coordinator: per RPC, no more requests than a default
coordinator admits.

The coordinator charges every node RPC to a per-(peer, rpc) token bucket (``[admission]``: by
default 20 requests/s with a burst of 60) and answers a peer over it by resetting its streams
and a backoff that doubles with each repeat, up to 5 minutes. A fast honest node went over it:
the tiny model submits about 40 groups/s, one submission each, and a local swarm with dynamic
sampling stalled for minutes at a time in those backoffs. :class:`Pacer` keeps each RPC under
the default budget with the same kind of bucket (:class:`~echo.p2p.budget.Bucket`), and waits
when one is empty; it never refuses. Registration has a budget of its own (12 a minute, a
burst of 3): a node that re-registered to find a restarted learner's address went over it and
was refused the one registration that would have found it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from echo.p2p.budget import Bucket, Limit
from echo.protocol import ids

# Under the coordinator's default budget of 20 requests/s and a burst of 60 per peer and RPC,
# with room for the two clocks drifting apart.
CALLS_PER_S = 16.0
CALL_BURST = 40.0
# Under the coordinator's default of 12 registrations per peer and minute with a burst of 3.
REGISTERS_PER_S = 10.0 / 60.0
REGISTER_BURST = 3.0


class Pacer:
    """One token bucket per RPC name; :meth:`wait` takes a token, sleeping until there is one."""

    def __init__(
        self,
        calls_per_s: float = CALLS_PER_S,
        burst: float = CALL_BURST,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        # Bytes are the coordinator's business (submission sizes vary): a token of 1 is never
        # short of them, since every take asks for 0.
        self.limit = Limit(calls_per_s, burst, bytes_per_s=1.0, burst_bytes=1.0)
        self.limits = {
            ids.PROTO_REGISTER: Limit(REGISTERS_PER_S, REGISTER_BURST, 1.0, 1.0),
        }
        self.clock = clock
        self._buckets: dict[str, Bucket] = {}

    async def wait(self, rpc: str) -> float:
        """Take one of ``rpc``'s tokens, first sleeping until one has refilled; the seconds
        slept. A wait is at most one refill per caller queued on the same RPC."""
        now = self.clock()
        limit = self.limits.get(rpc, self.limit)
        bucket = self._buckets.setdefault(rpc, Bucket(limit, now))
        slept = 0.0
        while not bucket.can(now, 1, 0):
            pause = (1.0 - bucket.requests) / limit.requests_per_s
            await trio.sleep(pause)
            slept += pause
            now = self.clock()
        bucket.take(1, 0)
        return slept
