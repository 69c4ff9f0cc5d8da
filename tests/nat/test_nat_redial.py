"""A DCUtR dial-back whose address pair is taken (loopback, no root).

DCUtR dials from the listen port, so a dial to a peer is one fixed 4-tuple. The failure seen in
CI (tests/nat/test_nat_circuits.py under load): the exchange's initiator A, which by the spec
upgrades its dial as the Noise *responder*, dialled first, and its SYN reached B's listener (on
loopback nothing drops it); B's listener took it as inbound, so both sides waited as responders
until the 10 s inbound upgrade timeout, and that stalled connection held the pair B's own dial
needs: every one of B's re-dials failed with EADDRNOTAVAIL. Here the stalled connection is made
on purpose, then the exchange must still end with a direct connection, from an ephemeral port.
See docs/results/2026-12-07-nat-redial.md.
"""

from __future__ import annotations

import socket
import time
from contextlib import suppress

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.nat import dcutr
from echo.p2p.nat.circuit import has_direct_connection, is_relayed, keep_reservation
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay
from echo.p2p.relay.peers import Peers

_TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
}


def _held(local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """The state of our socket on the 4-tuple ``local`` -> ``remote`` (IPv4), from
    /proc/net/tcp: looking, unlike a test connect, changes nothing."""

    def enc(ep: tuple[str, int]) -> str:
        return f"{socket.inet_aton(ep[0])[::-1].hex().upper()}:{ep[1]:04X}"

    want = (enc(local), enc(remote))
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if (cols[1], cols[2]) == want:
                return _TCP_STATES.get(int(cols[3], 16), cols[3])
    return None


def _plain(host: EchoHost) -> Multiaddr:
    return Multiaddr(str(host.listen_multiaddrs[0]).split("/p2p/")[0])


async def _stall(a: EchoHost, b: EchoHost) -> None:
    """A's DCUtR-style dial (listen port, upgraded as responder) into B's listener, which
    upgrades it as responder too: it holds the pair until the inbound upgrade times out."""
    with suppress(Exception):  # the upgrade's timeout is the expected end
        await a.libp2p.get_network().dial_addr_as_responder(
            _plain(b), b.peer_id, a.tcp_listen_endpoint
        )


def test_a_dial_back_whose_address_pair_is_held_comes_from_another_port() -> None:
    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as a,
            offer_relay(r, CONTROL_RELAY_LIMITS),
        ):
            dcutr.serve_dcutr(b)
            async with keep_reservation(b, r.listen_multiaddrs[0]) as res:
                peers = Peers(a, 5.0, None)
                bid = str(b.peer_id)
                peers._addrs[bid] = [res.circuit_addr]
                with trio.fail_after(15):
                    await peers.connect(bid)  # control: through the relay
                assert not has_direct_connection(a, b.peer_id)
                b_port, a_port = b.tcp_listen_endpoint, a.tcp_listen_endpoint
                assert _held(b_port, a_port) is None

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_stall, a, b)
                    with trio.fail_after(5):
                        while _held(b_port, a_port) != "ESTABLISHED":
                            await trio.sleep(0.05)
                    held_at = time.monotonic()
                    # What py-libp2p's dial from the listen port says now, and what it says
                    # for a refusal that another port would not cure.
                    net = b.libp2p.get_network()
                    try:
                        await net.dial_addr(_plain(a), a.peer_id, b_port)
                        raise AssertionError("a dial of a held pair succeeded")
                    except Exception as exc:  # noqa: BLE001
                        assert dcutr.pair_taken(exc), repr(exc)
                    closed = socket.socket()
                    closed.bind(("127.0.0.1", 0))
                    try:
                        await net.dial_addr(
                            Multiaddr(f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}"),
                            ID.from_base58(str(r.peer_id)),
                            b_port,
                        )
                        raise AssertionError("a dial of a closed port succeeded")
                    except Exception as exc:  # noqa: BLE001
                        assert not dcutr.pair_taken(exc), repr(exc)
                    finally:
                        closed.close()

                    # Peers.connect's budget for DCUtR is 3 s; the stall holds the pair 10 s.
                    assert await dcutr.upgrade(a, b.peer_id, timeout=5.0)
                    assert time.monotonic() - held_at < 9.0
                    assert _held(b_port, a_port) == "ESTABLISHED"  # still the stalled one
                    # B dialled back from an ephemeral port; A (the initiator) does not fall back.
                    assert dcutr.pair_fallbacks(b) >= 1 and dcutr.pair_fallbacks(a) == 0
                    direct = [
                        c
                        for c in b.libp2p.get_network().connections[a.peer_id]
                        if not is_relayed(c) and c.direction.name == "OUTBOUND"
                    ]
                    assert direct, b.libp2p.get_network().connections[a.peer_id]
                    nursery.cancel_scope.cancel()

    trio.run(body)
