"""The learner's link to its coordinator (echo.learner.link) rides out a shedding hold, on real
hosts over loopback: the coordinator's host caps loopback (as benchmarks/attack.py's
``loopback_is_network``, or an external learner's public network) and its loop lags by the
test's word (:class:`HandLag`), so it refuses the learner's handshake until the hold ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio

from echo.learner.link import CoordinatorLink
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcError
from echo.p2p.shedding import install_shedder
from tests.conftest import Clock
from tests.p2p.test_shedding import POLICY, HandLag

TEST_DEADLINE = 30.0
HOLD_S = 5.0


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            await fn()

    trio.run(main)


async def _refused(shedder, times: int) -> None:
    with trio.fail_after(10):
        while shedder.refused < times:
            await trio.sleep(0.05)


def test_the_learner_dials_again_while_a_lagging_coordinator_refuses_it() -> None:
    """Dialling once, the learner exited at the first refused handshake and was restarted,
    building its model again each time (benchmarks/attack.py at load 6-12: two runs of three
    never attached)."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as coordinator,
            open_host(Identity.generate(), pubsub=False) as learner_host,
        ):
            clock = Clock()
            shedder = install_shedder(coordinator, HandLag(0.2, HOLD_S, clock=clock))
            shedder.lag.observe(1.0)  # the coordinator's loop lags: a hold begins
            link = CoordinatorLink(Identity.generate(), "job", 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.connect, learner_host, coordinator.listen_multiaddrs[0])
                # One dial is 4 handshakes (py-libp2p's own retries, 0.7 s): more are dials again.
                await _refused(shedder, 6)
                assert link.peer is None
                clock.t += HOLD_S + 0.1  # the hold is over
            assert link.peer == coordinator.peer_id
            assert coordinator.peer_id in learner_host.connected_peers()

    run(body)


def test_the_learner_gives_up_after_its_patience() -> None:
    """A coordinator that keeps refusing: the learner stops dialling after ``patience_s`` and
    raises, as before (its supervisor restarts it)."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as coordinator,
            open_host(Identity.generate(), pubsub=False) as learner_host,
        ):
            shedder = install_shedder(coordinator, HandLag(0.2, 3600.0, clock=Clock()))
            shedder.lag.observe(1.0)
            link = CoordinatorLink(Identity.generate(), "job", 1)
            started = trio.current_time()
            with pytest.raises(RpcError):
                await link.connect(learner_host, coordinator.listen_multiaddrs[0], patience_s=2.0)
            assert trio.current_time() - started < 2.0 + 5.0  # at most one dial after it
            assert shedder.refused >= 2 and link.peer is None

    run(body)
