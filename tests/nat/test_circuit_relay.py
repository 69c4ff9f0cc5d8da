"""Circuit relay v2 (echo.p2p.nat.circuit, echo.p2p.nat.circuit_relay): on loopback, and in the
emulated internet (tools/netem_nat.py).

On loopback (no root needed): the relay reserves only in the authenticated peer's name, a node
accepts relayed connections only from a relay it holds a reservation with, addresses parse.

In the emulated internet: a public relay R, a public dialler A, node B behind an
endpoint-independent router and node C behind a symmetric one, both holding a reservation on R
(limit 2), and a public D that asks for a third. A cannot dial B or C directly; through R it
reaches both and runs an RPC; both ends mark the connection relayed; the reservations are
refreshed before they expire; D's reservation and a dial to D are refused; a transfer over the
relay's per-circuit data limit is cut and the next circuit works.

The emulated internet needs root, iproute2, iptables (nat table) and network namespaces; those
tests are skipped where they are missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

import echo.tools.netem_nat as netem_nat
from echo.p2p.chunkstore import ChunkStore, fetch_chunk
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat.circuit import (
    RelayRefused,
    StatusCode,
    circuit_addr,
    dial_circuit,
    has_direct_connection,
    is_relayed,
    keep_reservation,
    parse_circuit_addr,
)
from echo.p2p.nat.circuit import _acceptors as _acceptors
from echo.p2p.nat.circuit_relay import RelayLimits, offer_relay
from echo.p2p.relay import open_relay
from echo.p2p.relay.peers import Peers
from echo.p2p.rpc import RemoteError, RpcConnectionError, RpcError
from echo.protocol import broadcast as bc
from echo.protocol import messages as m

ECHO = "/echo-test/circuit-echo/1"


async def _echo(peer, req: bytes) -> bytes:
    return b"echo:" + req


# ------------------------------------------------------------------ loopback


def test_circuit_addresses_parse_and_refuse_junk() -> None:
    relay, node = Identity.generate().peer_id_str, Identity.generate().peer_id_str
    ra = f"/ip4/10.0.0.1/tcp/4001/p2p/{relay}"
    addr = circuit_addr(ra, node)
    assert addr == f"{ra}/p2p-circuit/p2p/{node}"
    got = parse_circuit_addr(addr)
    assert (got[0], str(got[1]), str(got[2])) == (ra, relay, node)
    with pytest.raises(ValueError):
        circuit_addr("/ip4/10.0.0.1/tcp/4001", node)  # no relay id
    with pytest.raises(ValueError):
        circuit_addr(ra, relay)  # its own relay
    with pytest.raises(ValueError):
        parse_circuit_addr(ra)  # not a circuit
    with pytest.raises(ValueError):
        parse_circuit_addr(f"{addr}/p2p-circuit/p2p/{node}")


def test_relay_reserves_only_for_the_authenticated_peer_and_nodes_pick_their_relays() -> None:
    """py-libp2p's relay takes the reserving peer from the RESERVE message: a peer M could take
    a slot in B's name (and B, connected for other reasons, would then be reachable through the
    relay without asking). Here M's RESERVE naming B gives M the slot, not B; and B, which holds
    no reservation with M, refuses a STOP stream M opens to it."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as m,
            offer_relay(r, RelayLimits(max_reservations=4)) as relay,
        ):
            ra = r.listen_multiaddrs[0]
            await b.connect(ra)
            await m.connect(ra)
            with trio.fail_after(10):
                s = await m.libp2p.new_stream(r.peer_id, [HOP_PROTOCOL_ID])
                msg = HopMessage(
                    type=HopMessage.RESERVE, peer=CircuitPeerId(id=b.peer_id.to_bytes())
                )
                await write_delimited_msg(s, msg)
                resp = await read_delimited_msg(s, HopMessage)
            assert resp.status == StatusCode.OK
            assert relay.reservations == [m.peer_id]  # not b
            with pytest.raises(RelayRefused) as err:
                await dial_circuit(m, circuit_addr(ra, b.peer_id), timeout=5)
            assert err.value.status == StatusCode.NO_RESERVATION

            # B keeps a reservation on R only; a STOP stream from M is refused, from R taken.
            async with keep_reservation(b, ra) as res:
                assert res.active and res.circuit_addr == circuit_addr(ra, b.peer_id)
                await m.connect(b.listen_multiaddrs[0])
                with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017 (reset)
                    s = await m.libp2p.new_stream(b.peer_id, [STOP_PROTOCOL_ID])
                    await read_delimited_msg(s, HopMessage)
                assert (_acceptors[b.libp2p].refused, _acceptors[b.libp2p].accepted) == (1, 0)
                b.set_handler(ECHO, _echo, max_request=64, max_response=64)
                # M holds a direct connection to B (above): only new=True makes a circuit.
                a_id = await dial_circuit(m, res.circuit_addr, timeout=10, new=True)
                assert a_id == b.peer_id
                reply = await m.request(b.peer_id, ECHO, b"m", timeout=5, max_response=64)
                assert reply == b"echo:m"
                relayed = [
                    c for c in m.libp2p.get_network().connections[b.peer_id] if is_relayed(c)
                ]
                assert len(relayed) == 1
                assert (_acceptors[b.libp2p].refused, _acceptors[b.libp2p].accepted) == (1, 1)

    trio.run(body)


def test_chunks_and_pushes_refuse_a_relayed_connection_and_go_direct(tmp_path, caplog) -> None:
    """Bulk data travels on direct connections only. A reaches B only through R: a have-map
    (control) crosses the circuit, a chunk request is answered ``relayed`` and a push stream is
    reset; a puller's Peers.connect(direct=True) refuses a peer reached only through a relay,
    then, given B's address, dials it directly beside the circuit, and the same chunk request
    is served."""
    caplog.set_level(logging.INFO, logger="echo")
    store = ChunkStore(tmp_path / "b")
    data = b"w" * 100_000
    store.put(1, data)
    ref = m.ChunkRef(sha256=hashlib.sha256(data).digest(), size=len(data))

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            open_host(Identity.generate(), pubsub=False) as a,
            offer_relay(r, RelayLimits(max_reservations=4)) as relay,
        ):
            ra = r.listen_multiaddrs[0]
            async with open_relay(b, store, learner_keys={}), keep_reservation(b, ra) as res:
                with trio.fail_after(20):
                    pid = await dial_circuit(a, res.circuit_addr, timeout=10)
                    assert pid == b.peer_id and not has_direct_connection(a, pid)
                    have = bc.encode(bc.HaveRequest(job_id="job-1", version=1))
                    raw = await a.request(
                        pid, bc.PROTO_HAVE, have, timeout=10, max_response=bc.MAX_HAVE_REPLY_BYTES
                    )
                    assert bc.decode(bc.HaveReply, raw).chunks == 0  # control: served
                    with pytest.raises(RemoteError, match="^relayed: "):
                        await fetch_chunk(a, pid, ref, timeout=10)
                    s = await a.libp2p.new_stream(pid, [TProtocol(bc.PROTO_PUSH)])
                    try:
                        await s.write(b"\x00\x00\x00\x04junk")
                        got = await s.read(16)
                    except Exception:  # noqa: BLE001 (reset: what we expect)
                        got = b""
                    assert got == b""
                    assert "came through a relay" in caplog.text
                    carried = relay.bytes_relayed
                    assert carried > 0

                    peers = Peers(a, 0.5, None)
                    with pytest.raises(RpcError, match="only through a relay"):
                        await peers.connect(str(pid), direct=True)
                    peers._addrs[str(pid)] = [b.listen_multiaddrs[0]]
                    await peers.connect(str(pid), direct=True)
                    assert has_direct_connection(a, pid)
                    assert await fetch_chunk(a, pid, ref, timeout=10) == data
                    # The chunk took the direct connection: the relay carried far less than it
                    # (only what still goes over the circuit: identify, yamux window updates).
                    assert relay.bytes_relayed - carried < len(data) // 10

    trio.run(body)


# ------------------------------------------------------------------ in the emulated internet

PREFIX = "crn"
_OK, _WHY = netem_nat.available(prefix="crq")
needs_nat = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")

PORT = 4401
RESERVATION_TTL_S = 4  # short, so that the module sees refreshes
DATA_LIMIT = 256 * 1024
DIRECT_TIMEOUT_S = 2.0

# One host per namespace, driven by JSON lines on stdin (one reply line per command).
AGENT = r"""
import json, os, sys, time, trio
from echo.p2p.nat.circuit import (RelayRefused, dial_circuit, has_direct_connection, is_relayed,
                              keep_reservation)
from echo.p2p.nat.circuit_relay import RelayLimits, offer_relay
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcError
PROTO = "/echo-test/circuit-echo/1"
async def echo(peer, req):
    return b"echo:" + req[:16]
def err(exc):
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
            "status": getattr(getattr(exc, "status", None), "name", None)}
async def main():
    state = {}
    async with open_host(Identity.generate(), [sys.argv[1]], pubsub=False) as h:
        h.set_handler(PROTO, echo, max_request=4 << 20, max_response=1024)
        hello = {"peer": str(h.peer_id), "addr": h.listen_multiaddrs[0]}
        print("@@", json.dumps(hello), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        async def relay_task(limits, task_status):
            async with offer_relay(h, RelayLimits(**limits)) as relay:
                state["relay"] = relay
                task_status.started()
                await trio.sleep_forever()
        async def reserve_task(addr, task_status):
            try:
                async with keep_reservation(h, addr) as res:
                    state["res"] = res
                    task_status.started({"ok": True, "reserved_in_s": res.reserved_in_s,
                                         "circuit_addr": res.circuit_addr,
                                         "ttl_s": res.info.ttl_s})
                    await trio.sleep_forever()
            except (RpcError, ValueError) as exc:
                task_status.started(err(exc))
        async with trio.open_nursery() as n:
            while True:
                while b"\n" not in buf:
                    chunk = await stdin.receive_some(65536)
                    if not chunk:
                        n.cancel_scope.cancel(); return
                    buf += chunk
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                op, out = cmd["op"], {"ok": True}
                if op == "quit":
                    n.cancel_scope.cancel(); return
                try:
                    if op == "relay":
                        await n.start(relay_task, cmd["limits"])
                    elif op == "reserve":
                        out = await n.start(reserve_task, cmd["addr"])
                    elif op == "direct":
                        t0 = time.monotonic()
                        await h.connect(cmd["addr"], timeout=cmd["timeout"])
                        out["s"] = time.monotonic() - t0
                    elif op == "dial":
                        t0 = time.monotonic()
                        pid = await dial_circuit(h, cmd["addr"], timeout=10,
                                                 new=cmd.get("new", False))
                        out["dial_s"] = time.monotonic() - t0
                        t1 = time.monotonic()
                        rep = await h.request(pid, PROTO, cmd.get("payload", "hi").encode(),
                                              timeout=10, max_response=1024)
                        out["rpc_s"] = time.monotonic() - t1
                        out["rpc"] = rep.decode()
                        out["direct"] = has_direct_connection(h, pid)
                    elif op == "send":
                        await h.request(cmd["peer"], PROTO, b"x" * cmd["size"], timeout=10,
                                        max_response=1024)
                    elif op == "state":
                        net = h.libp2p.get_network()
                        out["conns"] = {str(p): [is_relayed(c) for c in cs]
                                        for p, cs in net.connections.items()}
                        if "res" in state:
                            r = state["res"]
                            out["res"] = {"active": r.active, "refreshes": r.refreshes,
                                          "failures": r.failures, "last_error": r.last_error}
                        if "relay" in state:
                            r = state["relay"]
                            out["relay"] = {"reservations": [str(p) for p in r.reservations],
                                            "circuits_opened": r.circuits_opened,
                                            "circuits_limited": r.circuits_limited,
                                            "refused": dict(r.refused)}
                except (RpcError, ValueError) as exc:
                    out = err(exc)
                print("@@", json.dumps(out), flush=True)
trio.run(main)
"""


class Agent:
    def __init__(self, inet: netem_nat.Internet, name: str) -> None:
        self.name = name
        self.ip = inet.hosts[name].ip
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(
                name, [sys.executable, "-c", AGENT, f"/ip4/{self.ip}/tcp/{PORT}"], PREFIX
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.peer = ""
        self.addr = ""

    def ready(self) -> None:
        hello = self._line()
        self.peer, self.addr = hello["peer"], hello["addr"]

    def _line(self) -> dict:
        # Our replies start with "@@ "; anything else on stdout (a library's print) is skipped.
        while True:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                self.proc.wait(timeout=10)
                raise AssertionError(f"{self.name} died: {self.proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()

    def stop(self) -> None:
        try:
            self.proc.stdin.write('{"op": "quit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def swarm():
    inet = netem_nat.up(
        [netem_nat.RouterSpec("home1", "eim"), netem_nat.RouterSpec("home2", "sym")],
        [
            netem_nat.NatHostSpec("r"),
            netem_nat.NatHostSpec("a"),
            netem_nat.NatHostSpec("d"),
            netem_nat.NatHostSpec("b", "home1"),
            netem_nat.NatHostSpec("c", "home2"),
        ],
        prefix=PREFIX,
        public_subnet="10.71.0.0/24",
        quiet=True,
    )
    agents: dict[str, Agent] = {}
    try:
        for n in ("r", "a", "d", "b", "c"):
            agents[n] = Agent(inet, n)
        for ag in agents.values():
            ag.ready()
        limits = {
            "max_reservations": 2,
            "reservation_ttl_s": RESERVATION_TTL_S,
            "circuit_data_bytes": DATA_LIMIT,
        }
        assert agents["r"]("relay", limits=limits)["ok"]
        reserved = {n: agents[n]("reserve", addr=agents["r"].addr) for n in ("b", "c")}
        yield inet, agents, reserved
    finally:
        for ag in agents.values():
            ag.stop()
        netem_nat.down(PREFIX, quiet=True)


@needs_nat
def test_nat_nodes_are_reached_only_through_the_relay(swarm):
    inet, ag, reserved = swarm
    a, r = ag["a"], ag["r"]
    for name in ("b", "c"):
        res = reserved[name]
        assert res["ok"], res
        node = ag[name]
        assert res["circuit_addr"] == f"{r.addr}/p2p-circuit/p2p/{node.peer}"
        # Not directly: the LAN address has no route from the internet, and the router drops
        # a SYN to its WAN address (no port forwarded).
        for ip in (node.ip, inet.hosts[name].public_ip):
            got = a("direct", addr=f"/ip4/{ip}/tcp/{PORT}/p2p/{node.peer}", timeout=2.0)
            assert not got["ok"], (name, ip, got)
        got = a("dial", addr=res["circuit_addr"], payload=f"to-{name}")
        assert got["ok"], (name, got)
        assert got["rpc"] == f"echo:to-{name}"
        assert got["direct"] is False
        print(
            f"\n{name} ({inet.hosts[name].nat}): reserved in {res['reserved_in_s']:.3f} s, "
            f"circuit dial {got['dial_s']:.3f} s, first rpc {got['rpc_s']:.3f} s"
        )
        # Both ends see one connection between them, marked relayed.
        assert a("state")["conns"][node.peer] == [True]
        assert node("state")["conns"][a.peer] == [True]
        # A second dial uses that connection, without a new circuit.
        opened = r("state")["relay"]["circuits_opened"]
        got = a("dial", addr=res["circuit_addr"], payload="again")
        assert got["ok"] and got["rpc"] == "echo:again", got
        assert r("state")["relay"]["circuits_opened"] == opened
        assert a("state")["conns"][node.peer] == [True]
    # The relay saw the two circuits and holds both reservations.
    rs = r("state")["relay"]
    assert rs["circuits_opened"] >= 2
    assert sorted(rs["reservations"]) == sorted([ag["b"].peer, ag["c"].peer])


@pytest.mark.slow
@needs_nat
def test_reservations_are_refreshed_and_the_relay_limit_holds(swarm):
    _, ag, reserved = swarm
    a, d, r = ag["a"], ag["d"], ag["r"]
    assert reserved["b"]["ok"] and reserved["c"]["ok"]
    # A third reservation is over the relay's limit of 2.
    got = d("reserve", addr=r.addr)
    assert not got["ok"] and got["status"] == "RESOURCE_LIMIT_EXCEEDED", got
    # A dial to a peer without a reservation is refused by the relay.
    got = a("dial", addr=f"{r.addr}/p2p-circuit/p2p/{d.peer}")
    assert not got["ok"] and got["status"] == "NO_RESERVATION", got
    # Past the TTL: refreshed (at half of it), still held, still reachable.
    time.sleep(RESERVATION_TTL_S + 1.0)
    for name in ("b", "c"):
        st = ag[name]("state")["res"]
        assert st["active"] and st["refreshes"] >= 2 and st["failures"] == 0, (name, st)
    assert sorted(r("state")["relay"]["reservations"]) == sorted([ag["b"].peer, ag["c"].peer])
    got = a("dial", addr=reserved["c"]["circuit_addr"], payload="after-ttl", new=True)
    assert got["ok"] and got["rpc"] == "echo:after-ttl", got


@needs_nat
def test_a_transfer_over_the_circuit_data_limit_is_cut(swarm):
    _, ag, reserved = swarm
    a, b, r = ag["a"], ag["b"], ag["r"]
    got = a("dial", addr=reserved["b"]["circuit_addr"], payload="before")
    assert got["ok"], got
    assert a("state")["conns"][b.peer] == [True]
    limited = r("state")["relay"]["circuits_limited"]
    got = a("send", peer=b.peer, size=DATA_LIMIT + 64 * 1024)
    assert not got["ok"], got
    # The relay reset the circuit and the swarm let go of it. (B may dial A directly right
    # after: py-libp2p's auto-connector redials known peers when a connection drops, and A's
    # address reached B by identify over the circuit. A direct connection is not a relayed one.)
    deadline = time.monotonic() + 5
    while True in a("state")["conns"].get(b.peer, []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert True not in a("state")["conns"].get(b.peer, [])
    assert r("state")["relay"]["circuits_limited"] == limited + 1
    # Small messages under the limit still pass on a new circuit.
    got = a("dial", addr=reserved["b"]["circuit_addr"], payload="after", new=True)
    assert got["ok"] and got["rpc"] == "echo:after", got
    assert True in a("state")["conns"][b.peer]


def test_keep_reservation_raises_when_the_relay_refuses() -> None:
    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as b,
            offer_relay(r, admit=lambda peer: False),
        ):
            with pytest.raises(RelayRefused) as err:
                async with keep_reservation(b, r.listen_multiaddrs[0]):
                    pass
            assert err.value.status == StatusCode.PERMISSION_DENIED
            with pytest.raises(RpcConnectionError):
                async with keep_reservation(b, f"/ip4/127.0.0.1/tcp/1/p2p/{r.peer_id}"):
                    pass

    trio.run(body)
