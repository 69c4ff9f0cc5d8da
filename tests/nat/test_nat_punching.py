"""The punch go signal on loopback (no root): the coordinator's side
(echo.coordinator.dissemination.punching) asks two nodes (echo.node.punching) for a direct
connection, both answer, the pair is booked in Dissemination and the nodes hold the connection; a
request from anyone but a node's coordinator is refused. Two nodes "behind one router" (the same
observed ip) connect by a LAN dial, as the coordinator pairs them; the hole punch itself is tested
in tests/nat/test_nat_holepunch.py."""

from __future__ import annotations

import pytest
import trio

from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.dissemination.punching import punch_pair
from echo.node.punching import Punches
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError
from echo.protocol import messages as m
from echo.protocol.nat import PROTO_PUNCH, PunchRequest

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.slow
def test_the_coordinator_connects_two_nodes_and_books_the_path() -> None:
    async def body() -> None:
        ids = [Identity.generate() for _ in range(4)]
        async with (
            open_host(ids[0], LOOPBACK, pubsub=False) as coord,
            open_host(ids[1], LOOPBACK, pubsub=False) as a,
            open_host(ids[2], LOOPBACK, pubsub=False) as b,
            open_host(ids[3], LOOPBACK, pubsub=False) as stranger,
        ):
            for node in (a, b):
                await node.connect(coord.listen_multiaddrs[0])
                Punches(node, coord.peer_id).serve()
            d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
            for node in (a, b):
                name = str(node.peer_id)
                d.relays.registered(name, node.listen_multiaddrs, 1e6)
                d.relays.set_reachable(name, False, verdict="nat", observed_ip="127.0.0.1")
            (pair,) = d.relays.punch_pairs()
            assert pair.method == "lan"  # one public ip: behind one router
            with trio.fail_after(30):
                assert await punch_pair(coord, d, pair)
            assert d.relays.paths_of(str(a.peer_id)) == {str(b.peer_id)}
            assert d.relays.punch_pairs() == []  # booked: not asked again
            assert b.peer_id in a.connected_peers() and a.peer_id in b.connected_peers()

            # Only the node's coordinator may aim it at a peer.
            await stranger.connect(a.listen_multiaddrs[0])
            req = PunchRequest(
                peer_id=str(stranger.peer_id),
                method="lan",
                peer_addrs=stranger.listen_multiaddrs[:1],
                start_in_s=0.0,
                timeout_s=1.0,
            )
            try:
                await stranger.request(
                    a.peer_id, PROTO_PUNCH, m.encode(req), timeout=10, max_response=1024
                )
            except RemoteError as exc:
                assert "coordinator" in str(exc)
            else:
                raise AssertionError("a stranger's punch request was answered")

            # A node that does not answer (no handler): the pair fails, nothing is booked as ok.
            d2 = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
            for node in (a, stranger):
                d2.relays.registered(str(node.peer_id), node.listen_multiaddrs, 1e6)
                d2.relays.set_reachable(
                    str(node.peer_id), False, verdict="nat", observed_ip="127.0.0.1"
                )
            await stranger.connect(coord.listen_multiaddrs[0])
            (pair2,) = d2.relays.punch_pairs()
            with trio.fail_after(30):
                assert not await punch_pair(coord, d2, pair2)
            assert d2.relays.paths_of(str(a.peer_id)) == set() and d2.relays.punch_pairs() == []

    trio.run(body)

