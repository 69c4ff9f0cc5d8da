"""The node's pacer keeps each RPC under the coordinator's default admission budget."""

from __future__ import annotations

import trio
import trio.testing

from echo.coordinator.config import AdmissionSection
from echo.node.pacing import CALL_BURST, CALLS_PER_S, Pacer
from echo.p2p.budget import Bucket, Limit


def test_the_pace_is_under_the_coordinators_default_budget() -> None:
    default = AdmissionSection()
    assert default.requests_per_s > CALLS_PER_S and default.burst_requests > CALL_BURST


def test_a_burst_goes_at_once_then_calls_are_spaced() -> None:
    """100 calls in a row: the burst at once, the rest at the pace, and a coordinator's bucket
    of the default budget, charged at each call's moment, admits every one of them."""

    async def main() -> None:
        pacer = Pacer()
        default = AdmissionSection()
        server = Bucket(
            Limit(default.requests_per_s, default.burst_requests, 1.0, 1.0), trio.current_time()
        )
        start = trio.current_time()
        for _ in range(100):
            await pacer.wait("submit")
            assert server.can(trio.current_time(), 1, 0)  # never over the coordinator's budget
            server.take(1, 0)
        elapsed = trio.current_time() - start
        expected = (100 - CALL_BURST) / CALLS_PER_S
        assert expected - 0.01 <= elapsed <= expected + 0.1, elapsed
        # Another RPC has its own bucket: its first call does not wait.
        assert await pacer.wait("lease") == 0.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
