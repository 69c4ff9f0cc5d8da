"""Reachability at the real coordinator: it dials nodes with accepted work back for the planner,
and ``echo-node doctor`` tells a volunteer what it gets (whom it relays to) and what to change."""

from __future__ import annotations

import pytest
import trio

from echo.node.config import NodeConfig
from echo.node.doctor import network_checks, reachability_check, relay_offered
from echo.p2p.nat.circuit import RelayRefused, StatusCode, reserve
from echo.p2p.nat.dialback import ask_dialback
from echo.protocol.nat import DialBackReply
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import start_job


def test_coordinator_judges_a_registered_node_and_answers_dial_backs(tmp_path) -> None:
    async def body(coord, client) -> None:
        node = await client()
        await node.register()
        # Dial-backs wait for a node's first accepted group (test_hardening_dialbacks).
        coord.node_rpc.probes.earned(node.identity.peer_id_str)
        with trio.fail_after(10):
            while coord.dissemination.relays.links[node.identity.peer_id_str].reachable is None:
                await trio.sleep(0.05)
        assert coord.dissemination.relays.links[node.identity.peer_id_str].reachable is True
        reply = await ask_dialback(node.host, coord.identity.peer_id)
        assert (reply.verdict, reply.observed_ip) == ("public", "127.0.0.1")
        # Doctor, with its own throwaway identity, on loopback: reachable, can relay.
        cfg = NodeConfig(coordinator=coord.multiaddrs[0], data_dir=tmp_path / "node")
        checks = {c.name: c for c in await network_checks(cfg)}
        assert checks["coordinator"].ok
        assert checks["reachability"].detail.startswith("public: peers can dial you")

    run_with_coordinator(tmp_path, body)


def test_coordinator_relays_for_its_registered_nodes_and_running_learners_only(tmp_path) -> None:
    """The coordinator offers circuit relay v2 reservations to registered nodes and to the
    learner of a running job; a stranger (doctor's throwaway identity) is refused, which tells
    doctor the relay is there."""

    async def body(coord, client) -> None:
        stranger = await client()
        with pytest.raises(RelayRefused) as err:
            await reserve(stranger.host, coord.identity.peer_id)
        assert err.value.status == StatusCode.PERMISSION_DENIED
        assert await relay_offered(stranger.host, coord.identity.peer_id) == "offered"
        node = await client()
        await node.register()
        info = await reserve(node.host, coord.identity.peer_id)
        assert info.ttl_s > 60 and info.circuit_data_bytes == 1 << 20
        assert coord.relay.reservations == [node.host.peer_id]
        # The learner of a running job dials nodes behind NAT through it (to ask for DCUtR).
        _, learner = await start_job(coord, client)
        await reserve(learner.host, coord.identity.peer_id)
        assert set(coord.relay.reservations) == {node.host.peer_id, learner.host.peer_id}
        with pytest.raises(RelayRefused):  # still a stranger
            await reserve(stranger.host, coord.identity.peer_id)

    run_with_coordinator(tmp_path, body)


def test_doctor_tells_a_node_behind_nat_whom_it_relays_to_and_what_to_forward() -> None:
    nat = DialBackReply(verdict="nat", reachable=False, observed_ip="203.0.113.7")
    check = reachability_check(nat, ["/ip4/192.168.1.5/tcp/4001/p2p/x"])
    assert check.ok and "203.0.113.7" in check.detail
    assert "relay them only to peers you can dial" in check.detail
    assert "forward TCP port 4001" in check.detail
    with_relay = reachability_check(nat, [], relay="offered")
    assert "reservation on the coordinator's relay" in with_relay.detail
    assert "weights never cross a relay" in with_relay.detail
    assert "offers no relay" in reachability_check(nat, [], relay="none").detail
    fwd = DialBackReply(verdict="forwarded", reachable=True, dialed="/ip4/203.0.113.7/tcp/4001")
    assert "relay" in reachability_check(fwd, []).detail
    assert "unknown" in reachability_check(None, [], "no such protocol").detail
