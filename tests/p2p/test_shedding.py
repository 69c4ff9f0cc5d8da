"""Shedding strangers while the loop lags (echo.p2p.shedding), on real hosts over loopback.

The server caps loopback (each loopback address its own prefix, as the attack benchmark's
``loopback_is_network``), so strangers are from capped prefixes; the lag is a real one (the
loop blocked) or set by observing a late turn.
"""

from __future__ import annotations

import socket as stdlib_socket
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
from libp2p.peer.id import ID

from echo.p2p.conn_guard import GuardPolicy
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcConnectionError, RpcTimeout
from echo.p2p.shedding import READMIT_BURST, READMIT_PER_S, RELAPSE_S, LoopLag, install_shedder
from tests.conftest import Clock
from tests.p2p.test_conn_guard import dial_from

TEST_DEADLINE = 20.0
PING = "/echo/test/ping/1"
POLICY = GuardPolicy(loopback_cap=16, handshake_refill_s=None)


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            await fn()

    trio.run(main)


async def raw_dial_reply(source_ip: str, server) -> bytes:
    """What the server sends first to a TCP connection from ``source_ip`` (b"": it closed it)."""
    sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
    with sock:
        await sock.bind((source_ip, 0))
        await sock.connect(server.tcp_listen_endpoint)
        with trio.fail_after(5):
            return await sock.recv(64)


class HandLag(LoopLag):
    """A lag set by the test alone (observe), not measured: the test's own handshakes keep its
    loop busy."""

    async def run(self, probe_s: float = 0.0) -> None:
        await trio.sleep_forever()


def test_loop_lag_sees_a_blocked_loop_and_holds() -> None:
    clock = Clock()
    lag = LoopLag(0.2, 5.0, clock=clock)
    lag.observe(0.01)
    assert not lag.lagging
    lag.observe(0.3)
    assert lag.lagging and lag.late_turns == 1
    clock.t += 4.9
    assert lag.lagging
    clock.t += 0.2
    assert not lag.lagging
    # A relapse right after a hold holds twice as long; a calm spell starts again from one hold.
    clock.t += 1.0
    lag.observe(0.3)
    clock.t += 9.9
    assert lag.lagging
    clock.t += 10.0
    assert not lag.lagging
    clock.t += RELAPSE_S + 1.0
    lag.observe(0.3)
    clock.t += 5.1
    assert not lag.lagging
    with pytest.raises(ValueError):
        LoopLag(0.0)

    async def body() -> None:  # the probe on a real loop: quiet, then blocked for 0.4 s
        probe = LoopLag(0.2, 5.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe.run, 0.02)
            await trio.sleep(0.3)
            assert not probe.lagging
            time.sleep(0.4)  # a synchronous stall of the whole loop
            await trio.sleep(0.1)
            assert probe.lagging and probe.worst_s >= 0.3
            nursery.cancel_scope.cancel()

    run(body)


def test_loop_lag_sees_a_saturated_loop_whose_turns_are_all_quick() -> None:
    """Ready tasks all the time, each turn short: no turn is late, but the loop never idles in
    its I/O wait (the attack benchmark's coordinator: lease calls at 1.7 s, no turn 0.2 s late)."""

    async def body() -> None:
        probe = LoopLag(0.2, 5.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe.run, 0.02)
            await trio.sleep(1.2)  # quiet: idle most of each window
            assert not probe.lagging and probe.busy_windows == 0

            async def spin() -> None:
                while True:
                    t = time.perf_counter()
                    while time.perf_counter() - t < 0.002:
                        pass
                    await trio.lowlevel.checkpoint()

            for _ in range(4):
                nursery.start_soon(spin)
            await trio.sleep(2.5)
            assert probe.lagging and probe.busy_windows >= 1 and probe.worst_s < 0.2
            nursery.cancel_scope.cancel()

    run(body)


def test_a_lagging_host_serves_protected_peers_and_sheds_strangers() -> None:
    """While the loop lags: the protected peer is answered, the stranger's stream is reset
    unread and its connection closed, a newcomer from a prefix without a protected peer is
    refused before its handshake. Once the lag is gone, strangers are served again."""
    served: list[ID] = []

    async def ping(peer: ID, request: bytes) -> bytes:
        served.append(peer)
        return b"pong"

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as server,
            open_host(Identity.generate(), pubsub=False) as proven,
            open_host(Identity.generate(), pubsub=False) as stranger,
            open_host(Identity.generate(), pubsub=False) as newcomer,
            trio.open_nursery() as nursery,
        ):
            clock = Clock()
            lag = HandLag(0.2, 5.0, clock=clock)
            shedder = install_shedder(server, lag)
            nursery.start_soon(shedder.run)
            server.set_handler(PING, ping, max_request=16)
            await proven.connect(server.listen_multiaddrs[0])  # from 127.0.0.1
            await dial_from("127.0.0.2", stranger, server)
            server.guard.protect(proven.peer_id)

            async def ask(who) -> bytes:
                return await who.request(server.peer_id, PING, b"", timeout=3, max_response=16)

            assert await ask(stranger) == b"pong"  # no lag: everybody is served
            lag.observe(1.0)
            assert await ask(proven) == b"pong"
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await ask(stranger)
            assert served.count(stranger.peer_id) == 1 and shedder.streams >= 1
            with trio.fail_after(3):  # the sweep closes the stranger's connection
                while stranger.peer_id in server.connected_peers():
                    await trio.sleep(0.05)
            assert proven.peer_id in server.connected_peers()
            # A newcomer's socket is closed before the server says a byte of any handshake.
            assert await raw_dial_reply("127.0.0.3", server) == b""
            assert shedder.refused == 1
            assert not shedder.refuses_newcomer("127.0.0.1")  # the proven peer's prefix

            clock.t += 6.0  # the lag is gone
            await dial_from("127.0.0.3", newcomer, server)
            assert await ask(newcomer) == b"pong"
            nursery.cancel_scope.cancel()

    run(body)


def test_uncapped_prefixes_are_never_shed() -> None:
    """Loopback uncapped (tests, local swarms): a lagging host still serves everybody."""

    async def ping(peer: ID, request: bytes) -> bytes:
        return b"pong"

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as server,
            open_host(Identity.generate(), pubsub=False) as stranger,
        ):
            clock = Clock()
            lag = LoopLag(0.2, 5.0, clock=clock)
            shedder = install_shedder(server, lag)
            server.set_handler(PING, ping, max_request=16)
            lag.observe(1.0)
            await stranger.connect(server.listen_multiaddrs[0])
            reply = await stranger.request(server.peer_id, PING, b"", timeout=3, max_response=16)
            assert reply == b"pong" and shedder.streams == 0 and shedder.refused == 0

    run(body)


def test_private_networks_are_never_shed_public_ones_are() -> None:
    """A lagging coordinator still takes a newcomer from a private network (the operator's LAN,
    the NAT emulation's routers) but refuses one from a capped public network."""

    async def body() -> None:
        async with open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as server:
            clock = Clock()
            shedder = install_shedder(server, HandLag(0.2, 5.0, clock=clock))
            shedder.lag.observe(1.0)
            assert shedder.lag.lagging
            assert not shedder.refuses_newcomer("10.78.0.5")
            assert not shedder.refuses_newcomer("192.168.1.20")
            assert not shedder.sheds_stream(Identity.generate().peer_id, "10.78.0.5")
            assert shedder.refuses_newcomer("1.2.3.4")
            assert shedder.sheds_stream(Identity.generate().peer_id, "1.2.3.4")

    run(body)


def test_strangers_come_back_at_a_bounded_rate_after_a_hold() -> None:
    """Every stranger shut out during a hold retried when it ended: the loop saturated again
    within 2 s and honest calls of those seconds were the attack phase's slowest. After a hold
    their handshakes are admitted at READMIT_PER_S until a relapse would no longer count; a
    prefix with a protected peer's connection is never paced."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as server,
            open_host(Identity.generate(), pubsub=False) as proven,
        ):
            clock = Clock()
            shedder = install_shedder(server, HandLag(0.2, 5.0, clock=clock))
            await proven.connect(server.listen_multiaddrs[0])  # from 127.0.0.1
            server.guard.protect(proven.peer_id)
            shedder.lag.observe(1.0)
            assert shedder.refuses_newcomer("1.2.3.4")
            clock.t += 5.1  # the hold is over: a burst, then one a second
            assert not shedder.lag.lagging and shedder.lag.readmitting
            admitted = [not shedder.refuses_newcomer(f"1.2.3.{i}") for i in range(10)]
            assert admitted == [True] * READMIT_BURST + [False] * (10 - READMIT_BURST)
            assert shedder.paced == 10 - READMIT_BURST
            assert not shedder.refuses_newcomer("127.0.0.1")  # the protected peer's prefix
            clock.t += 1.0 / READMIT_PER_S
            assert not shedder.refuses_newcomer("5.6.7.8")
            assert shedder.refuses_newcomer("5.6.7.9")
            clock.t += RELAPSE_S  # a relapse would no longer count: everybody at once again
            assert not shedder.lag.readmitting
            assert not any(shedder.refuses_newcomer(f"9.9.9.{i}") for i in range(10))

    run(body)


def test_the_readmission_lasts_while_its_rate_turns_strangers_away() -> None:
    """Ended on the clock, the readmission let every stranger still queued in at once: the loop
    saturated again ~1 s after each one ended, 11 s after the hold, never a relapse, so every
    hold stayed 10 s (benchmarks/attack.py). It lasts while its rate turns strangers away, and
    a saturation meanwhile is a relapse (the next hold twice as long)."""

    async def body() -> None:
        async with open_host(Identity.generate(), pubsub=False, guard_policy=POLICY) as server:
            clock = Clock()
            shedder = install_shedder(server, HandLag(0.2, 5.0, clock=clock))
            shedder.lag.observe(1.0)
            clock.t += 5.1  # the hold is over: readmission for RELAPSE_S
            for _ in range(int(RELAPSE_S) + 2):  # a herd that knocks 3 times a second
                for i in range(3):
                    shedder.refuses_newcomer(f"1.2.3.{i}")
                clock.t += 1.0
            assert clock.t - 5.1 > RELAPSE_S and shedder.lag.readmitting
            # Still paced (one a second), not everybody at once.
            assert [shedder.refuses_newcomer(f"1.2.4.{i}") for i in range(3)] == [
                False,
                True,
                True,
            ]
            shedder.lag.observe(1.0)  # the loop saturates meanwhile: a relapse
            assert shedder.lag.lagging
            clock.t += 5.1
            assert shedder.lag.lagging  # the second hold is twice as long
            clock.t += 5.0
            assert not shedder.lag.lagging and shedder.lag.readmitting
            clock.t += 2 * RELAPSE_S + 0.1  # nobody knocked: the readmission is over
            assert not shedder.lag.readmitting
            assert not any(shedder.refuses_newcomer(f"9.9.9.{i}") for i in range(10))

    run(body)
