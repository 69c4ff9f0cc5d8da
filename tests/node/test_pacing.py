"""The node's pacer keeps each RPC under the coordinator's default admission budget."""

from __future__ import annotations

import trio
import trio.testing

from echo.coordinator.config import AdmissionSection
from echo.coordinator.rpc.budgets import node_limits
from echo.node.pacing import CALL_BURST, CALLS_PER_S, REGISTERS_PER_S, Pacer
from echo.p2p.budget import Bucket, Limit
from echo.protocol import ids


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


def test_registrations_keep_under_the_coordinators_registration_budget() -> None:
    """A node looking for a restarted learner registers again and again: the pacer spaces the
    calls so that a coordinator's default registration bucket admits each of them."""

    async def main() -> None:
        pacer = Pacer()
        limit = node_limits(AdmissionSection())[ids.PROTO_REGISTER]
        server = Bucket(limit, trio.current_time())
        start = trio.current_time()
        for _ in range(10):
            await pacer.wait(ids.PROTO_REGISTER)
            assert server.can(trio.current_time(), 1, 0)
            server.take(1, 0)
        # The burst went at once, the other seven at the pacer's rate.
        assert trio.current_time() - start >= 7 / REGISTERS_PER_S - 0.01

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
