"""Circuits that lead somewhere (issue 32), on loopback (no root): circuit addresses registered
by a node behind NAT are announced in plans only through relays the coordinator vouches for;
a peer that knows a node only by its circuit address reaches it through the relay for control
messages and, for bulk data, asks it over the relay to dial back (DCUtR, py-libp2p's
implementation) and gets a direct connection; a relay bounds reservations per IP.
In the emulated internet: tests/e2e/test_nat_swarm.py (circuits carried in a NAT swarm)."""

from __future__ import annotations

import pytest
import trio
from multiaddr import Multiaddr

from echo.coordinator.dissemination.circuits import split_addrs, trusted_circuits
from echo.coordinator.dissemination.planning import Dissemination
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat import dcutr
from echo.p2p.nat.circuit import (
    RelayRefused,
    StatusCode,
    circuit_addr,
    has_direct_connection,
    is_relayed,
    keep_reservation,
)
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, RelayLimits, offer_relay
from echo.p2p.relay.peers import Peers


def _ids(n: int) -> list[str]:
    return [Identity.generate().peer_id_str for _ in range(n)]


def test_plans_announce_circuits_only_through_vouched_relays() -> None:
    coord, pub, nat, other = _ids(4)
    relay_addr = f"/ip4/1.2.3.4/tcp/4001/p2p/{coord}"
    pub_addr = f"/ip4/5.6.7.8/tcp/4001/p2p/{pub}"
    via_coord = circuit_addr(relay_addr, nat)
    via_pub = circuit_addr(pub_addr, nat)
    stranger = circuit_addr(f"/ip4/9.9.9.9/tcp/4001/p2p/{other}", nat)
    not_mine = circuit_addr(relay_addr, other)
    direct, circuits = split_addrs(
        nat, ["/ip4/192.168.1.2/tcp/4001", via_coord, not_mine, "junk/p2p-circuit"]
    )
    assert direct == ["/ip4/192.168.1.2/tcp/4001"] and circuits == [via_coord]
    assert trusted_circuits([via_coord, stranger], {coord: {relay_addr}}) == [via_coord]

    d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6, local_addrs=False)
    d.relay_addrs = [relay_addr]
    d.relays.registered(pub, ["/ip4/5.6.7.8/tcp/4001"], 1e6)
    d.relays.set_reachable(
        pub, True, verdict="public", observed_ip="5.6.7.8", dialed="/ip4/5.6.7.8/tcp/4001"
    )
    d.relays.registered(nat, ["/ip4/192.168.1.2/tcp/4001"], 1e6)
    d.relays.set_reachable(nat, False, verdict="nat", observed_ip="7.7.7.7")
    # A circuit address registered later does not cost the node its verdict.
    d.relays.registered(nat, ["/ip4/192.168.1.2/tcp/4001", via_coord, via_pub, stranger], 1e6)
    link = d.relays.links[nat]
    assert link.reachable is False and link.addrs == ["/ip4/192.168.1.2/tcp/4001"]
    ann = d.plan("j", 1, b"m", 1000, source=coord, source_addrs=[relay_addr], nodes=[pub, nat])
    assert ann is not None
    got = {p.peer_id: p.addrs for p in ann.peers}
    # The first two only (MAX_CIRCUITS); both relays are vouched for; the stranger is not.
    assert got[nat] == [via_coord, via_pub]
    assert got[pub] == [pub_addr]
    d.relays.registered(nat, ["/ip4/192.168.1.2/tcp/4001", stranger], 1e6)
    ann = d.plan("j", 2, b"m", 1000, source=coord, source_addrs=[relay_addr], nodes=[pub, nat])
    assert {p.peer_id: p.addrs for p in ann.peers}[nat] == []


def test_a_peer_known_by_its_circuit_is_reached_for_control_and_asked_to_dial_back() -> None:
    """A knows B only by its circuit address: a control connection goes through the relay;
    DCUtR over it makes B dial A (B's side of the direct connection is outbound); and
    Peers.connect(direct=True), the push path, ends with a direct connection too."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as a,
            offer_relay(r, CONTROL_RELAY_LIMITS) as relay,
        ):
            dcutr.serve_dcutr(b)
            async with keep_reservation(b, r.listen_multiaddrs[0]) as res:
                peers = Peers(a, 5.0, None)
                bid = str(b.peer_id)
                peers._addrs[bid] = [res.circuit_addr]  # all a plan tells A of B
                with trio.fail_after(30):
                    await peers.connect(bid)  # control: through the relay
                    assert peers.connected(bid) and not has_direct_connection(a, b.peer_id)
                    conns = a.libp2p.get_network().connections[b.peer_id]
                    assert all(is_relayed(c) for c in conns)
                    assert relay.circuits_opened == 1
                    assert await dcutr.upgrade(a, b.peer_id)
                assert dcutr.upgrades(a) == 1 and has_direct_connection(a, b.peer_id)
                direct = [
                    c for c in b.libp2p.get_network().connections[a.peer_id] if not is_relayed(c)
                ]
                assert direct and all(c.direction.name == "OUTBOUND" for c in direct)
                # The push path: B's direct connection dropped, A asks again and gets one.
                for c in direct:
                    await c.close()
                with trio.fail_after(30):
                    while has_direct_connection(a, b.peer_id):
                        await trio.sleep(0.05)
                    await peers.connect(bid, direct=True)
                assert has_direct_connection(a, b.peer_id)

    trio.run(body)


@pytest.mark.parametrize("per_ip, per_net", [(1, 0), (0, 1)])
def test_a_relay_bounds_reservations_per_ip_and_network(per_ip: int, per_net: int) -> None:
    """Both hosts dial from 127.0.0.1 (one IP, one loopback prefix): the second is refused."""
    with pytest.raises(ValueError):
        RelayLimits(max_reservations_per_ip=-1)
    limits = RelayLimits(
        max_reservations=8, max_reservations_per_ip=per_ip, max_reservations_per_network=per_net
    )

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as c,
            offer_relay(r, limits) as relay,
        ):
            ra = r.listen_multiaddrs[0]
            async with keep_reservation(b, ra) as res:
                assert res.active
                with pytest.raises(RelayRefused) as err:
                    async with keep_reservation(c, ra):
                        pass
                assert err.value.status == StatusCode.RESOURCE_LIMIT_EXCEEDED
                assert relay.reservations == [b.peer_id]
            await b.disconnect(r.peer_id)  # its slot goes with its connection
            async with keep_reservation(c, ra):
                assert relay.reservations == [c.peer_id]

    trio.run(body)


def test_dcutr_answers_only_over_a_relay_and_dials_few_addresses() -> None:
    """A DCUtR CONNECT makes the responder dial what it names: only over a relayed connection,
    and at most MAX_DIAL_ADDRS of the named addresses."""
    from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID
    from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
    from libp2p.relay.circuit_v2.utils import write_delimited_msg

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as a,
        ):
            dcutr.serve_dcutr(b)
            await a.connect(b.listen_multiaddrs[0])  # direct: no DCUtR there
            with trio.fail_after(10):
                try:
                    s = await a.libp2p.new_stream(b.peer_id, [PROTOCOL_ID])
                    msg = HolePunch(type=HolePunch.CONNECT)
                    await write_delimited_msg(s, msg)
                    got = await s.read(100)
                except Exception:  # noqa: BLE001 (reset, or refused at once: what we expect)
                    got = b""
            assert got == b""
            many = [Multiaddr(f"/ip4/10.0.0.{i}/tcp/4001").to_bytes() for i in range(20)]
            assert len(dcutr._proto(b)._decode_observed_addrs(many)) == dcutr.MAX_DIAL_ADDRS

    trio.run(body)
