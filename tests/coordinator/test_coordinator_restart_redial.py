"""A node's calls reach a coordinator that restarted after a crash at once (found by
tests/e2e/test_chaos.py): libp2p refuses to dial a peer for 60 s after all its addresses failed,
which held every node off a coordinator back within seconds for a minute after each crash."""

from __future__ import annotations

import socket

import trio
from multiaddr import Multiaddr
from rich.console import Console

from echo.node.display import Display
from echo.node.session import CoordinatorSession
from echo.p2p.host import open_host
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.rpc import RpcError

PROTO = "/echo/test/ping/1"


async def _pong(peer, request: bytes) -> bytes:
    return b"pong"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_reaches_its_restarted_coordinator_without_waiting_a_minute() -> None:
    coord = Identity.generate()
    addr = f"/ip4/127.0.0.1/tcp/{_free_port()}"

    async def body() -> None:
        async with open_host(Identity.generate(), pubsub=False) as node_host:
            session = CoordinatorSession(Identity.generate(), Display(Console()), lambda: None)
            # The node knows its coordinator (it was registered), which is down: a crash.
            session.host, session.peer = node_host, coord.peer_id
            session.key = public_key_from_peer_id(coord.peer_id)
            node_host.libp2p.get_peerstore().add_addrs(coord.peer_id, [Multiaddr(addr)], 3600)
            failed = ""
            try:
                await session.call(PROTO, b"", timeout=5)
            except RpcError as exc:
                failed = str(exc)
            assert "unable to connect" in failed, failed  # every address failed: remembered
            async with open_host(coord, [addr], pubsub=False) as back:  # restarted, same port
                back.set_handler(PROTO, _pong, max_request=16)
                # The node's next try gets through (was: "recently failed all addresses
                # (negative cache)" for 60 s).
                with trio.fail_after(10):
                    assert await session.call(PROTO, b"", timeout=5) == b"pong"
                await node_host.disconnect(coord.peer_id)  # a quiet shutdown of both hosts

    trio.run(body)
