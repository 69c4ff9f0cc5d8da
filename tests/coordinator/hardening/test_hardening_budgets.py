"""Per-peer budgets (issue 13, item 2): rate and bytes per (peer, rpc) and per network prefix.

The Gate is tested on its own with a fake clock, then on the real coordinator: a flooding peer
is refused and serves a backoff, its connection left unread meanwhile, while an honest node on
the same address keeps its service; an announced body over the byte budget is refused before
it is read.
"""

from __future__ import annotations

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError

from echo.p2p.budget import Gate, Limit, network_prefix
from echo.p2p.conn_guard import PUBLIC_PREFIX_CAP
from echo.p2p.rpc import RpcConnectionError, RpcTimeout
from echo.protocol import ids
from echo.tools.peer_kit import lease_request
from tests.conftest import Clock, make_coordinator, run_with_coordinator
from tests.coordinator.test_coordinator import start_job

LIMIT = Limit(requests_per_s=1.0, burst_requests=3.0, bytes_per_s=100.0, burst_bytes=300.0)


def test_prefixes() -> None:
    assert network_prefix("203.0.113.77") == "203.0.113.0/24"
    assert network_prefix("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert network_prefix("not an ip") is None and network_prefix(None) is None
    assert network_prefix("127.0.0.1") is None and network_prefix("::1") is None


def test_gate_rate_bytes_and_refill() -> None:
    clock = Clock()
    gate = Gate({"rpc": LIMIT}, prefix_factor=100, clock=clock)
    assert all(gate.admit("a", "198.51.100.1", "rpc") for _ in range(3))
    assert not gate.admit("a", "198.51.100.1", "rpc")  # burst spent
    assert gate.admit("b", "198.51.100.2", "rpc")  # another peer has its own
    clock.t = 1.0
    assert gate.admit("a", "198.51.100.1", "rpc")  # one token refilled
    assert not gate.admit_bytes("a", "198.51.100.1", "rpc", 301)
    assert gate.admit_bytes("a", None, "rpc", 300)  # its address remembered
    assert not gate.admit_bytes("a", None, "rpc", 1)
    assert gate.refused["rpc"] == 3


def test_gate_prefix_is_shared_by_every_identity_in_it() -> None:
    clock = Clock()
    gate = Gate({"rpc": LIMIT}, prefix_factor=2, clock=clock)
    admitted = sum(gate.admit(f"sybil-{i}", "192.0.2.9", "rpc") for i in range(50))
    assert admitted == 6  # 2 peers' worth of burst, however many identities
    assert gate.admit("elsewhere", "203.0.113.9", "rpc")


def test_loopback_addresses_can_each_be_a_network() -> None:
    """Off by default (a local swarm is one trusted machine); on, 127.0.0.2's identities share
    one budget and leave 127.0.0.1's alone (benchmarks/attack.py's attackers and honest nodes)."""
    assert network_prefix("127.0.0.2", loopback_is_network=True) == "127.0.0.2/32"
    assert network_prefix("::1", loopback_is_network=True) == "::1/128"
    clock = Clock()
    gate = Gate({"rpc": LIMIT}, prefix_factor=2, clock=clock)
    assert sum(gate.admit(f"s-{i}", "127.0.0.2", "rpc") for i in range(50)) == 50
    gate = Gate({"rpc": LIMIT}, prefix_factor=2, clock=clock)
    gate.loopback_is_network = True
    assert sum(gate.admit(f"s-{i}", "127.0.0.2", "rpc") for i in range(50)) == 6
    assert all(gate.admit("honest", "127.0.0.1", "rpc") for _ in range(3))


@pytest.mark.parametrize("on", [False, True])
def test_coordinator_counts_loopback_as_networks_when_configured(tmp_path, on) -> None:
    async def body(coord, client) -> None:
        assert coord.host.gate.loopback_is_network is on
        assert coord.host.guard.policy.loopback_cap == (PUBLIC_PREFIX_CAP if on else None)
        node = await client()
        await node.register()  # 127.0.0.1 is served either way

    run_with_coordinator(tmp_path, body, admission={"loopback_is_network": on})


def test_gate_backoff_doubles_and_expires() -> None:
    clock = Clock()
    gate = Gate(backoff_base_s=2.0, backoff_max_s=5.0, clock=clock)
    assert gate.punish("p") == 2.0
    assert gate.in_backoff("p") and not gate.admit("p", None, "rpc")
    assert gate.punish("p") == 4.0 and gate.punish("p") == 5.0  # capped
    clock.t = 5.1
    assert not gate.in_backoff("p") and gate.admit("p", None, "rpc")


def test_gate_maps_are_bounded() -> None:
    gate = Gate({"rpc": LIMIT}, max_keys=1000, clock=Clock())
    for i in range(20_000):
        gate.admit(f"peer-{i}", f"10.{i % 250}.{i // 250 % 250}.1", "rpc")
        gate.punish(f"peer-{i}")
    assert all(n <= 1000 for n in gate.sizes().values())


def test_coordinator_takes_limits_from_config(tmp_path) -> None:
    coord = make_coordinator(tmp_path)
    assert coord.config.admission.requests_per_s > 0
    coord.store.close()


def test_flooding_peer_is_backed_off_and_left_unread_honest_node_is_not(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        flooder, honest = await client(), await client()
        await flooder.register()
        await honest.register()
        gate, me = coord.host.gate, str(flooder.host.peer_id)
        served = 0
        with trio.fail_after(20):
            while True:
                try:
                    await flooder.leases(job_id, 0, 1)
                    served += 1
                except RpcConnectionError:  # over budget: reset, and a backoff begins
                    break
        assert 5 <= served <= 7  # the burst, and what refilled meanwhile
        assert gate.in_backoff(me)
        # While it serves its backoff its connection is left unread: its next request is
        # neither answered nor refused (no stream was even opened on our side).
        refused = dict(gate.refused)
        with pytest.raises(RpcTimeout):
            await flooder.host.request(
                flooder.coord, ids.PROTO_LEASE, lease_request(flooder.identity, job_id),
                timeout=1.0, max_response=1 << 20,
            )
        assert gate.refused == refused and gate.in_backoff(me)
        # The honest node, on the same machine, is still served.
        for _ in range(3):
            assert (await honest.leases(job_id, 0, 1)).current_version == 0

    run_with_coordinator(tmp_path, body, admission={"requests_per_s": 1.0, "burst_requests": 5.0})


def test_announced_body_over_byte_budget_is_refused_unread(tmp_path) -> None:
    async def body(coord, client) -> None:
        await start_job(coord, client)
        node = await client()
        await node.register()
        me = str(node.host.peer_id)
        frame = (3 << 20).to_bytes(4, "big")  # announces 3 MiB, over the 2 MiB burst

        stream = await node.host.libp2p.new_stream(node.coord, [TProtocol(ids.PROTO_SUBMIT)])
        await stream.write(frame + b"x" * 1024)
        with trio.move_on_after(5):
            while not coord.host.gate.in_backoff(me):
                await trio.sleep(0.02)
        assert coord.host.gate.in_backoff(me)
        with pytest.raises(BaseLibp2pError):  # the coordinator reset the stream
            for _ in range(100):
                await stream.write(b"x" * 65536)
                await trio.sleep(0.01)

    run_with_coordinator(
        tmp_path, body, admission={"submit_bytes_per_s": 1e6, "submit_burst_bytes": 2e6}
    )
