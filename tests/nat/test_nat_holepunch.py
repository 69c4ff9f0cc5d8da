"""TCP hole punching (echo.p2p.nat.holepunch): on loopback, and in the emulated internet
(tools/netem_nat.py).

On loopback (no root needed): the roles and the listener path -- a responder that starts late
finds the initiator's connection already accepted by its listener. In the emulated internet, two
real EchoHosts, each behind its own endpoint-independent router, punch at the same start
time and exchange RPCs over the direct connection; behind a symmetric router the punch fails
within its timeout with a clear error and leaves no socket or connection behind.

The emulated internet needs root, iproute2, iptables (nat table) and network namespaces; those
tests are skipped where they are missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import trio

import echo.tools.netem_nat as netem_nat
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat.circuit import dial_circuit, is_relayed, keep_reservation
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay
from echo.p2p.nat.holepunch import HolePunchFailed, is_initiator, punch

ECHO = "/echo-test/holepunch-echo/1"


async def _echo(peer, req: bytes) -> bytes:
    return b"echo:" + req


def test_loopback_late_responder_takes_the_connection_its_listener_accepted() -> None:
    """No NAT drops the initiator's early SYN: it reaches the responder's listener, which
    upgrades it as inbound (the responder's role); the responder's own punch, a second later,
    cannot dial the same 4-tuple and picks up that connection instead."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as x,
            open_host(Identity.generate(), pubsub=False) as y,
        ):
            ini, res = (x, y) if is_initiator(x.peer_id, y.peer_id) else (y, x)
            for h in (ini, res):
                h.set_handler(ECHO, _echo, max_request=1024, max_response=1024)
            start = time.time() + 0.2
            got = {}

            async def one(me, other, late: float) -> None:
                addr = f"/ip4/127.0.0.1/tcp/{other.tcp_listen_endpoint[1]}"
                got[me] = await punch(me, other.peer_id, addr, start_at=start + late, timeout=5)

            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    n.start_soon(one, ini, res, 0.0)
                    n.start_soon(one, res, ini, 1.0)
                assert (got[ini].initiator, got[ini].via) == (True, "dial")
                assert (got[res].initiator, got[res].via) == (False, "listener")
                reply = await res.request(ini.peer_id, ECHO, b"r", timeout=5, max_response=64)
                assert reply == b"echo:r"
                reply = await ini.request(res.peer_id, ECHO, b"i", timeout=5, max_response=64)
                assert reply == b"echo:i"

    trio.run(body)


def test_a_relayed_connection_that_comes_up_during_a_punch_is_not_its_path() -> None:
    """While A punches towards a port where nobody answers, B reaches A through a relay (a
    plan's control connection): that circuit is not the direct path, and the punch fails. It
    used to count (CI: a pair with the symmetric router reported "ok via listener")."""

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as r,
            open_host(Identity.generate(), pubsub=False) as a,
            open_host(Identity.generate(), pubsub=False) as b,
            offer_relay(r, CONTROL_RELAY_LIMITS),
            keep_reservation(a, r.listen_multiaddrs[0]) as res,
        ):
            with trio.socket.socket() as closed:  # a port bound and never listened on
                await closed.bind(("127.0.0.1", 0))
                nowhere = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}"

                async def through_the_relay() -> None:
                    await trio.sleep(0.5)
                    got = await dial_circuit(b, res.circuit_addr, timeout=10)
                    assert str(got) == str(a.peer_id)

                with trio.fail_after(20):
                    async with trio.open_nursery() as n:
                        n.start_soon(through_the_relay)
                        with pytest.raises(HolePunchFailed):
                            await punch(a, b.peer_id, nowhere, timeout=3)
            conns = a.libp2p.get_network().connections.get(b.peer_id, [])
            assert conns and all(is_relayed(c) for c in conns), conns

    trio.run(body)


def test_punch_refuses_bad_arguments() -> None:
    async def body() -> None:
        async with open_host(Identity.generate(), pubsub=False) as h:
            other = Identity.generate().peer_id_str
            with pytest.raises(ValueError, match="ourselves"):
                await punch(h, h.peer_id, "/ip4/127.0.0.1/tcp/1")
            with pytest.raises(ValueError, match="/ip4/<ip>/tcp/<port>"):
                await punch(h, other, "/dns4/example.org/tcp/1")
            with pytest.raises(ValueError, match="another peer"):
                await punch(h, other, f"/ip4/127.0.0.1/tcp/1/p2p/{h.peer_id}")
            with pytest.raises(ValueError, match="start_at"):
                await punch(h, other, "/ip4/127.0.0.1/tcp/1", start_at=time.time() + 3600)

    trio.run(body)


# ------------------------------------------------------------------ in the emulated internet

PREFIX = "ecnh"
_OK, _WHY = netem_nat.available(prefix="ecnq")
needs_nat = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")

# Each test listens on its own port: the routers' conntrack outlives a test, and an entry the
# previous pair left on the same 4-tuple (half-closed, or closed by a reset) can make the router
# drop the next pair's SYN from outside as INVALID until a later SYN replaces it. Our best
# explanation of the one CI failure (a 3 s-skew punch done at 7.1 s, at a's SYN retransmit,
# not at b's first SYN); 16 local runs on one port, 8 of them beside 3 CPU hogs, did not repeat it.
PORTS = {"eim-skew-0.0": 4301, "eim-skew-3.0": 4302, "sym": 4303}
PUNCH_TIMEOUT_S = 8.0
# Both children must be listening and have read their job before the start: python + libp2p
# import takes ~2 s per process on a busy 2-core machine, and the jobs are sent after both
# printed their ids, so 2 s of lead is plenty.
START_LEAD_S = 2.0

# One host in a namespace: listens, punches to the peer named on stdin, then both ways an RPC
# over the connection, and reports what stayed open. Stays up until told (the peer may still
# be using the connection).
PEER = """
import json, subprocess, sys, time, trio
from echo.p2p.nat.holepunch import HolePunchFailed, punch
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
PROTO = "/echo-test/holepunch-echo/1"
async def main():
    async with open_host(Identity.generate(), [sys.argv[1]], pubsub=False) as h:
        async def echo(peer, req):
            return b"echo:" + req
        h.set_handler(PROTO, echo, max_request=1024, max_response=1024)
        print(json.dumps({"peer": str(h.peer_id)}), flush=True)
        job = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        out = {}
        t0 = time.time()
        try:
            got = await punch(h, job["peer"], job["addr"], start_at=job["start_at"],
                              timeout=job["timeout"])
            out.update(ok=True, via=got.via, initiator=got.initiator, elapsed_s=got.elapsed_s)
            conns = h.libp2p.get_network().connections.get(got.peer_id, [])
            out["remote"] = [list(c.muxed_conn.get_remote_address()) for c in conns]
            reply = await h.request(job["peer"], PROTO, str(h.peer_id).encode(), timeout=10.0,
                                    max_response=1024)
            out["rpc"] = reply.decode()
        except HolePunchFailed as exc:
            out.update(ok=False, error=str(exc), failed_after_s=time.time() - job["start_at"])
        out["connected"] = [str(p) for p in h.connected_peers()]
        ss = subprocess.run(["ss", "-tanH", "dst", job["addr"].split("/")[2]],
                            capture_output=True, text=True)
        out["sockets_to_peer"] = [ln for ln in ss.stdout.splitlines() if ln.strip()]
        print(json.dumps(out), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
trio.run(main)
"""


@pytest.fixture(scope="module")
def inet():
    net = netem_nat.up(
        [
            netem_nat.RouterSpec("home1", "eim"),
            netem_nat.RouterSpec("home2", "eim"),
            netem_nat.RouterSpec("home3", "sym"),
        ],
        [
            netem_nat.NatHostSpec("a", "home1"),
            netem_nat.NatHostSpec("b", "home2"),
            netem_nat.NatHostSpec("c", "home3"),
        ],
        prefix=PREFIX,
        public_subnet="10.70.0.0/24",
        quiet=True,
    )
    yield net
    netem_nat.down(PREFIX, quiet=True)


def _punch_pair(
    inet: netem_nat.Internet, x: str, y: str, port: int, skew_s: float = 0.0
) -> dict[str, dict]:
    """Run a host in ``x`` and one in ``y``, both listening on ``port``, and let them punch
    (``y`` starting ``skew_s`` later, as when a go signal reaches it late); their reports."""
    procs = {
        n: subprocess.Popen(
            netem_nat.exec_argv(
                n, [sys.executable, "-c", PEER, f"/ip4/{inet.hosts[n].ip}/tcp/{port}"], PREFIX
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (x, y)
    }
    try:
        ids = {n: json.loads(p.stdout.readline())["peer"] for n, p in procs.items()}  # type: ignore[union-attr]
        start_at = time.time() + START_LEAD_S
        for n, p in procs.items():
            other = y if n == x else x
            job = {
                "peer": ids[other],
                "addr": f"/ip4/{inet.hosts[other].public_ip}/tcp/{port}",
                "start_at": start_at + (skew_s if n == y else 0.0),
                "timeout": PUNCH_TIMEOUT_S,
            }
            p.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        reports = {}
        for n, p in procs.items():
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line, f"{n} died: {p.stderr.read()[-3000:]}"  # type: ignore[union-attr]
            reports[n] = json.loads(line)
            reports[n]["self"] = ids[n]
        return reports
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


@pytest.mark.slow
@needs_nat
@pytest.mark.parametrize("skew_s", [0.0, 3.0])
def test_two_eim_nodes_punch_a_direct_connection(inet, skew_s):
    port = PORTS[f"eim-skew-{skew_s}"]
    r = _punch_pair(inet, "a", "b", port, skew_s)
    a, b = r["a"], r["b"]
    assert a["ok"] and b["ok"], (a, b)
    assert a["initiator"] != b["initiator"]  # exactly one Noise initiator
    assert a["rpc"] == f"echo:{a['self']}" and b["rpc"] == f"echo:{b['self']}"
    # Direct: each sees the other's router WAN address (with the listen port it punched from),
    # not a relay's and not a LAN address.
    assert a["remote"] == [[inet.routers["home2"].public_ip, port]]
    assert b["remote"] == [[inet.routers["home1"].public_ip, port]]
    # The later side's first SYN completes it: a skew delays only the earlier side.
    assert a["elapsed_s"] < skew_s + 2.0 and b["elapsed_s"] < 2.0, (a, b)


@pytest.mark.slow
@needs_nat
def test_punch_through_a_symmetric_nat_fails_cleanly(inet):
    r = _punch_pair(inet, "a", "c", PORTS["sym"])
    for name in ("a", "c"):
        rep = r[name]
        assert rep["ok"] is False, rep
        assert "no direct connection" in rep["error"] and "symmetric NAT" in rep["error"]
        # Within the timeout (plus the start lead's rounding and a slow scheduler).
        assert PUNCH_TIMEOUT_S - 0.5 < rep["failed_after_s"] < PUNCH_TIMEOUT_S + 3.0
        assert rep["connected"] == []
        assert rep["sockets_to_peer"] == []  # no SYN-SENT socket left behind
