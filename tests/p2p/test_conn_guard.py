"""ConnectionGuard: a per-prefix cap on inbound connections, idle reaping under pressure.

Live tests run real hosts on loopback. Loopback is uncapped by default (every local node runs on
127.0.0.1), so they set a loopback cap, under which each loopback address is its own prefix: a
stranger dialling from 127.0.0.2 (a socket bound there) is "another network".
"""

from __future__ import annotations

import contextlib
import socket as stdlib_socket
from collections.abc import Awaitable, Callable

import pytest
import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID

import echo.p2p.host as host_mod
from echo.p2p.conn_guard import ConnectionGuard, GuardPolicy
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.prefixes import Prefix, prefix_of
from echo.p2p.rpc import RpcConnectionError, RpcTimeout
from tests.conftest import Clock

TEST_DEADLINE = 10.0
PING = "/echo/test/ping/1"


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            await fn()

    trio.run(main)


async def dial_from(source_ip: str, client: EchoHost, server: EchoHost) -> None:
    """Connect ``client`` to ``server`` from a socket bound to ``source_ip`` (py-libp2p's own
    dial cannot choose its source address)."""
    sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
    try:
        await sock.bind((source_ip, 0))
        await sock.connect(server.tcp_listen_endpoint)
    except BaseException:
        sock.close()
        raise
    raw = RawConnection(TrioTCPStream(trio.SocketStream(sock)), True)
    await client.libp2p.get_network().upgrade_outbound_raw_conn(raw, server.peer_id)  # type: ignore[attr-defined]


def inbound_from(server: EchoHost, peer: ID) -> bool:
    return peer in server.connected_peers()


# -- pure parts ----------------------------------------------------------------------------------


def test_prefix_of() -> None:
    assert prefix_of("203.0.114.7") == Prefix("public", "203.0.114.0/24")
    assert prefix_of("203.0.114.200") == prefix_of("203.0.114.7")
    assert prefix_of("203.0.115.7") != prefix_of("203.0.114.7")
    assert prefix_of("2a00:1450:4001:81a::200e") == Prefix("public", "2a00:1450:4001::/48")
    assert prefix_of("2a00:1450:4001:ffff::1") == prefix_of("2a00:1450:4001:81a::200e")
    assert prefix_of("::ffff:203.0.114.9") == prefix_of("203.0.114.7")  # IPv4-mapped
    assert prefix_of("192.168.1.20") == Prefix("private", "192.168.1.0/24")
    assert prefix_of("10.1.2.3") == Prefix("private", "10.1.2.0/24")
    assert prefix_of("fe80::1%eth0") is not None and prefix_of("fe80::1%eth0").kind == "private"
    # Loopback: each address its own prefix.
    assert prefix_of("127.0.0.1") == Prefix("loopback", "127.0.0.1/32")
    assert prefix_of("127.0.0.2") != prefix_of("127.0.0.1")
    assert prefix_of("::1") == Prefix("loopback", "::1/128")
    assert prefix_of("not an ip") is None and prefix_of("") is None


def test_policy_caps_and_validation() -> None:
    default = GuardPolicy()
    assert default.cap_for(Prefix("loopback", "127.0.0.1/32")) is None  # local swarms uncapped
    assert default.cap_for(Prefix("public", "1.2.3.0/24")) == 16
    assert default.cap_for(Prefix("private", "10.0.0.0/24")) == 64
    assert GuardPolicy(loopback_cap=3).cap_for(Prefix("loopback", "127.0.0.1/32")) == 3
    for bad in (
        {"public_cap": 0},
        {"loopback_cap": -1},
        {"idle_timeout_s": 0},
        {"reap_interval_s": -1},
        {"pressure_fraction": 0},
        {"pressure_fraction": 1.5},
        {"handshake_refill_s": 0},
    ):
        with pytest.raises(ValueError):
            GuardPolicy(**bad)


# -- admission ------------------------------------------------------------------------------------


def test_handshake_rate_refuses_a_prefix_that_keeps_coming_back() -> None:
    """A prefix may start its cap of handshakes at once, then one per refill_s / cap, however
    quickly each connection goes away again (a junk submitter's fresh identities); another
    prefix keeps its own allowance, and an uncapped prefix has no rate."""
    clock = Clock()
    guard = ConnectionGuard(
        GuardPolicy(public_cap=4, handshake_refill_s=2.0), connection_cap=100, clock=clock
    )

    def handshake(ip: str, port: int) -> bool:
        ok = guard._reserve((ip, port))
        guard._pending.pop((ip, port), None)  # the connection is done and gone at once
        return ok

    assert [handshake("5.6.7.9", p) for p in range(6)] == [True] * 4 + [False] * 2
    assert handshake("9.9.9.1", 1)  # another /24
    clock.t += 0.4  # 0.8 of a handshake back
    assert not handshake("5.6.7.77", 7)  # same /24, another address
    clock.t += 0.2
    assert handshake("5.6.7.9", 8) and not handshake("5.6.7.9", 9)
    clock.t += 60.0  # refilled, but never past the cap
    assert [handshake("5.6.7.9", p) for p in range(10, 16)] == [True] * 4 + [False] * 2
    assert all(handshake("127.0.0.1", p) for p in range(50))  # loopback: uncapped, no rate


def test_prefix_cap_refuses_the_next_connection_from_a_full_prefix() -> None:
    """Cap 2 per prefix: two strangers from 127.0.0.1 connect, a third from there is refused
    before any stream is served, while a stranger from 127.0.0.2 still connects. A stranger that
    leaves frees its slot."""
    served: list[ID] = []

    async def ping(peer: ID, request: bytes) -> bytes:
        served.append(peer)
        return b"pong"

    async def body() -> None:
        # The cap alone: with the handshake rate too, s3's late reconnect would wait for it.
        policy = GuardPolicy(loopback_cap=2, handshake_refill_s=None)
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server,
            open_host(Identity.generate(), pubsub=False) as s1,
            open_host(Identity.generate(), pubsub=False) as s2,
            open_host(Identity.generate(), pubsub=False) as s3,
            open_host(Identity.generate(), pubsub=False) as other,
        ):
            server.set_handler(PING, ping, max_request=16)
            addr = server.listen_multiaddrs[0]
            await s1.connect(addr)
            await s2.connect(addr)
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await s3.connect(addr, timeout=3)
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await s3.request(server.peer_id, PING, b"", timeout=3, max_response=16)
            assert not inbound_from(server, s3.peer_id)
            assert server.guard.refused >= 1
            # Another prefix is not affected.
            await dial_from("127.0.0.2", other, server)
            assert await other.request(server.peer_id, PING, b"", timeout=3, max_response=16)
            assert inbound_from(server, other.peer_id)
            assert s3.peer_id not in served
            # A slot comes back when its holder leaves.
            await s1.disconnect(server.peer_id)
            with trio.fail_after(3):
                while inbound_from(server, s1.peer_id):
                    await trio.sleep(0.05)
            s3.forget_dial_failures(server.peer_id)  # py-libp2p waits 60 s after a failed dial
            await s3.connect(addr)
            assert inbound_from(server, s3.peer_id)

    run(body)


def test_each_connections_address_is_looked_up_once_and_forgotten_with_it() -> None:
    """Admission scans every connection per handshake: the address lookups are kept per
    connection (not per handshake), and dropped when the connection goes."""

    async def body() -> None:
        policy = GuardPolicy(loopback_cap=8, handshake_refill_s=None)
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server,
            open_host(Identity.generate(), pubsub=False) as client,
        ):
            await client.connect(server.listen_multiaddrs[0])
            (conn,) = server.libp2p.get_network().connections[client.peer_id]
            lookups = 0
            real = conn.muxed_conn.get_remote_address

            def counted():
                nonlocal lookups
                lookups += 1
                return real()

            conn.muxed_conn.get_remote_address = counted
            prefix = prefix_of("127.0.0.1")
            for _ in range(5):
                assert server.guard.inbound_count(prefix) == 1
            assert lookups <= 1
            await client.disconnect(server.peer_id)
            with trio.fail_after(3):
                while conn in server.guard._where:
                    await trio.sleep(0.05)

    run(body)


def test_prefix_cap_holds_under_concurrent_handshakes() -> None:
    """Five strangers from one prefix dial at once: exactly the cap (2) get in (a count of
    established connections alone would let all five through their handshakes)."""

    async def body() -> None:
        policy = GuardPolicy(loopback_cap=2)
        async with open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server:
            addr = server.listen_multiaddrs[0]
            ok: list[ID] = []
            tried: list[bool] = []
            all_tried = trio.Event()

            async def stranger() -> None:
                async with open_host(Identity.generate(), pubsub=False) as s:
                    with contextlib.suppress(RpcConnectionError, RpcTimeout):
                        ok.append(await s.connect(addr, timeout=4))
                    tried.append(True)
                    if len(tried) == 5:
                        all_tried.set()
                    await all_tried.wait()  # hold the connection while the others try

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(stranger)
            assert len(ok) == 2, (len(ok), server.guard.refused)
            assert server.guard.refused >= 3  # py-libp2p retries a failed dial: maybe more

    run(body)


# -- reaping --------------------------------------------------------------------------------------

FAST_REAP = GuardPolicy(idle_timeout_s=1.0, reap_interval_s=0.2)


def test_idle_connection_is_reaped_under_pressure_active_and_protected_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Host cap 4, pressure above a quarter of it (one connection), three strangers: the idle
    one is closed after the idle timeout; the one that keeps opening streams and the protected
    one stay, though the host stays under pressure."""
    monkeypatch.setattr(host_mod, "INBOUND_CONNECTION_CAP", 4)
    policy = GuardPolicy(idle_timeout_s=1.0, reap_interval_s=0.2, pressure_fraction=0.25)

    async def ping(peer: ID, request: bytes) -> bytes:
        return b"pong"

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server,
            open_host(Identity.generate(), pubsub=False) as idle,
            open_host(Identity.generate(), pubsub=False) as active,
            open_host(Identity.generate(), pubsub=False) as kept,
        ):
            server.set_handler(PING, ping, max_request=16)
            addr = server.listen_multiaddrs[0]
            for peer in (idle, active, kept):
                await peer.connect(addr)
            server.guard.protect(str(kept.peer_id))
            assert server.guard.under_pressure()
            async with trio.open_nursery() as nursery:

                async def keep_busy() -> None:
                    while True:
                        await active.request(server.peer_id, PING, b"", timeout=3, max_response=16)
                        await trio.sleep(0.3)

                nursery.start_soon(keep_busy)
                with trio.fail_after(4):
                    while inbound_from(server, idle.peer_id):
                        await trio.sleep(0.1)
                await trio.sleep(1.5)  # past another idle timeout: nobody else goes
                assert server.guard.under_pressure()
                assert inbound_from(server, active.peer_id)
                assert inbound_from(server, kept.peer_id)
                assert server.guard.reaped == 1
                # Not dialled back by py-libp2p's AutoConnector (it dials peers with addresses).
                assert not server.libp2p.get_peerstore().addrs(idle.peer_id)
                assert server.libp2p.get_peerstore().addrs(kept.peer_id)
                nursery.cancel_scope.cancel()

    run(body)


def test_idle_connection_is_kept_without_pressure() -> None:
    """Under half the cap (default 250) an idle connection costs nobody anything: it stays."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=FAST_REAP) as server,
            open_host(Identity.generate(), pubsub=False) as idle,
        ):
            await idle.connect(server.listen_multiaddrs[0])
            assert not server.guard.under_pressure()
            await trio.sleep(2.0)
            assert inbound_from(server, idle.peer_id)
            assert server.guard.reaped == 0

    run(body)


def test_idle_connections_in_a_full_prefix_are_reaped() -> None:
    """A prefix at its cap is under pressure of its own: its idle holders are reaped (until it is
    below its cap) even when the host is not, so a newcomer from that network gets in after the
    idle timeout."""

    async def body() -> None:
        policy = GuardPolicy(
            loopback_cap=2, handshake_refill_s=None, idle_timeout_s=2.0, reap_interval_s=0.2
        )
        async with (
            open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server,
            open_host(Identity.generate(), pubsub=False) as h1,
            open_host(Identity.generate(), pubsub=False) as h2,
            open_host(Identity.generate(), pubsub=False) as newcomer,
        ):
            addr = server.listen_multiaddrs[0]
            await h1.connect(addr)
            await h2.connect(addr)
            assert not server.guard.under_pressure()
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await newcomer.connect(addr, timeout=1)
            assert server.guard.refused >= 1
            with trio.fail_after(4):  # one holder goes: the prefix is below its cap again
                while len(server.connected_peers()) >= 2:
                    await trio.sleep(0.1)
            newcomer.forget_dial_failures(server.peer_id)
            await newcomer.connect(addr)
            assert inbound_from(server, newcomer.peer_id)

    run(body)
