"""EchoHost lifecycle: addresses, dialing errors, Noise-authenticated peer ids, clean shutdown."""

from __future__ import annotations

import pytest
import trio
from libp2p.peer.id import ID

from echo.p2p.host import open_host
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.rpc import RpcConnectionError, RpcTimeout

TEST_DEADLINE = 30.0


def run(fn) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            await fn()

    trio.run(main)


def test_addresses_and_authenticated_peer() -> None:
    ident_a, ident_b = Identity.generate(), Identity.generate()
    seen: list[ID] = []

    async def body() -> None:
        async with open_host(ident_a) as a, open_host(ident_b) as b:
            assert a.peer_id == ident_a.peer_id
            assert b.listen_multiaddrs
            for addr in b.listen_multiaddrs:
                assert addr.startswith("/ip4/127.0.0.1/tcp/")
                assert addr.endswith(f"/p2p/{ident_b.peer_id_str}")

            async def whoami(peer: ID, request: bytes) -> bytes:
                seen.append(peer)
                return public_key_from_peer_id(peer)

            b.set_handler("/echo/test/whoami/1", whoami, max_request=16)
            assert await a.connect(b.listen_multiaddrs[0]) == b.peer_id
            assert b.peer_id in a.connected_peers()
            # The server sees the client's Noise-authenticated id, which embeds its key.
            key = await a.request(b.peer_id, "/echo/test/whoami/1", b"", timeout=5, max_response=32)
            assert key == ident_a.public_key_bytes and seen == [a.peer_id]
            # Connecting twice reuses the connection.
            assert await a.connect(b.listen_multiaddrs[0]) == b.peer_id

    run(body)


def test_bad_listen_addresses() -> None:
    async def body() -> None:
        for addrs in ([], ["/ip4/127.0.0.1/udp/0/quic-v1"], ["not an address"]):
            with pytest.raises(ValueError):
                async with open_host(Identity.generate(), addrs, pubsub=False):
                    pass

    run(body)


def test_connect_errors() -> None:
    async def body() -> None:
        async with open_host(Identity.generate(), pubsub=False) as a:
            with pytest.raises(ValueError):
                await a.connect("/ip4/127.0.0.1/tcp/1")  # no /p2p/ part
            # Nobody listens there: refused quickly.
            other = Identity.generate().peer_id_str
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await a.connect(f"/ip4/127.0.0.1/tcp/1/p2p/{other}", timeout=5)

    run(body)


def test_wrong_peer_id_is_rejected() -> None:
    """Noise refuses a listener whose key does not match the /p2p/ id we dialed."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as a,
            open_host(Identity.generate(), pubsub=False) as b,
        ):
            addr = b.listen_multiaddrs[0].rsplit("/p2p/", 1)[0]
            impostor = Identity.generate().peer_id_str
            with pytest.raises((RpcConnectionError, RpcTimeout)):
                await a.connect(f"{addr}/p2p/{impostor}", timeout=5)

    run(body)


def test_close_with_active_streams_and_subscriptions() -> None:
    """Leaving the context with a request in flight and a subscription open returns promptly."""

    async def body() -> None:
        start = trio.current_time()
        async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b:

            async def hang(peer: ID, request: bytes) -> bytes:
                await trio.sleep_forever()
                return b""

            b.set_handler("/echo/test/hang/1", hang, max_request=16)
            await a.connect(b.listen_multiaddrs[0])
            await b.subscribe("echo/test/topic")
            await a.subscribe("echo/test/topic")
            async with trio.open_nursery() as nursery:

                async def pending() -> None:
                    with pytest.raises(RpcTimeout):
                        await a.request(
                            b.peer_id, "/echo/test/hang/1", b"", timeout=0.5, max_response=16
                        )

                nursery.start_soon(pending)
        assert trio.current_time() - start < 10

    run(body)


def test_leaving_open_host_closes_its_connections() -> None:
    """A host that leaves its block closes its connections, so the peer at the other end is
    not left holding them (py-libp2p kept them open: a coordinator takes 250 inbound ones, and
    a churn of short-lived peers shut every later peer out)."""

    async def main() -> None:
        with trio.fail_after(30):
            async with open_host(Identity.generate(), pubsub=False) as a:
                addr = a.listen_multiaddrs[0]
                for _ in range(5):
                    async with open_host(Identity.generate(), pubsub=False) as b:
                        await b.connect(addr)
                        assert a.peer_id in b.connected_peers()
                with trio.fail_after(5):
                    while a.connected_peers():
                        await trio.sleep(0.05)

    trio.run(main)


def test_inbound_cap_counts_open_connections_not_a_lifetime(monkeypatch) -> None:
    """py-libp2p kept a slot per inbound connection until its host stopped, so a coordinator
    took 250 connections in its life and refused every later one. The cap (3 here) now
    counts open connections: peers that come and go never run out of slots, and a fourth
    peer while three stay connected is refused."""
    import echo.p2p.host as host_mod

    monkeypatch.setattr(host_mod, "INBOUND_CONNECTION_CAP", 3)

    async def main() -> None:
        with trio.fail_after(60):
            async with open_host(Identity.generate(), pubsub=False) as a:
                addr = a.listen_multiaddrs[0]
                for _ in range(6):  # twice the cap, one after another
                    async with open_host(Identity.generate(), pubsub=False) as b:
                        await b.connect(addr)
                with trio.fail_after(5):
                    while a.connected_peers():
                        await trio.sleep(0.05)
                async with (
                    open_host(Identity.generate(), pubsub=False) as c1,
                    open_host(Identity.generate(), pubsub=False) as c2,
                    open_host(Identity.generate(), pubsub=False) as c3,
                    open_host(Identity.generate(), pubsub=False) as c4,
                ):
                    for c in (c1, c2, c3):
                        await c.connect(addr)
                    with pytest.raises((RpcConnectionError, RpcTimeout)):
                        await c4.connect(addr, timeout=5)

    trio.run(main)


def test_own_keys_survive_peerstore_eviction() -> None:
    """py-libp2p's peerstore keeps 1,000 peers and evicted the host's own entry first (it has
    no addresses): the coordinator died on its next get_public_key after ~1,000 churned peers."""

    async def main() -> None:
        with trio.fail_after(30):
            async with open_host(Identity.generate(), pubsub=False) as a:
                store = a.libp2p.get_peerstore()
                key = a.libp2p.get_public_key()
                for _ in range(store.max_peers + 50):  # strangers' keys, as handshakes add them
                    other = Identity.generate()
                    store.add_pubkey(
                        ID.from_base58(other.peer_id_str), other.libp2p_keypair().public_key
                    )
                    store._enforce_peer_limit()
                assert len(store.peer_data_map) <= store.max_peers + 1
                assert a.libp2p.get_public_key() == key

    trio.run(main)


def _inbound_handler_tasks() -> int:
    """trio listener handler tasks (py-libp2p runs one per inbound connection)."""
    stack, n = [trio.lowlevel.current_root_task()], 0
    while stack:
        task = stack.pop()
        n += task.name.endswith("serve_listeners._run_handler")
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return n


def test_inbound_handler_tasks_end_with_their_connections() -> None:
    """py-libp2p parked each inbound connection's handler task until the host stopped, so a
    host's memory grew with every connection it ever accepted; now the task ends when its
    connection closes (and lives while it is open)."""

    async def main() -> None:
        with trio.fail_after(60):
            async with open_host(Identity.generate(), pubsub=False) as a:
                addr = a.listen_multiaddrs[0]
                async with open_host(Identity.generate(), pubsub=False) as b:
                    await b.connect(addr)
                    assert _inbound_handler_tasks() == 1  # b's connection, alive
                    for _ in range(8):
                        async with open_host(Identity.generate(), pubsub=False) as c:
                            await c.connect(addr)
                    with trio.fail_after(10):
                        while len(a.connected_peers()) > 1:
                            await trio.sleep(0.05)
                    await trio.sleep(0.2)
                    assert _inbound_handler_tasks() == 1  # 8 came and went: only b's is left

    trio.run(main)
