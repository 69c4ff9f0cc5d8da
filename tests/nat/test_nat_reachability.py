"""Dial-backs (echo.p2p.nat.dialback): on loopback, in the emulated internet, and why not
py-libp2p's own AutoNAT (it answers "OK" without dialling)."""

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
from echo.p2p.nat.dialback import ask_dialback, candidates, open_dialback, serve_dialback

DEADLINE = 60.0


def run(fn) -> None:
    async def main() -> None:
        with trio.fail_after(DEADLINE):
            await fn()

    trio.run(main)


def test_candidates_only_on_the_observed_ip() -> None:
    me = Identity.generate().peer_id_str
    addrs = [f"/ip4/192.168.1.5/tcp/4001/p2p/{me}", "/ip4/10.0.0.7/tcp/4002", "/dns4/a.b/tcp/1"]
    assert candidates(addrs, "10.0.0.7") == [
        ("/ip4/10.0.0.7/tcp/4002", "public"),
        ("/ip4/10.0.0.7/tcp/4001", "forwarded"),
    ]
    # Behind NAT: only the router's address with the advertised ports (a port forward).
    assert candidates(addrs[:1], "203.0.113.9") == [("/ip4/203.0.113.9/tcp/4001", "forwarded")]
    assert candidates(["/ip4/1.2.3.4/udp/5"], "1.2.3.4") == []


def test_loopback_node_is_reachable_and_a_dead_address_is_not() -> None:
    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as server,
            open_dialback() as dialback,
            open_host(Identity.generate(), pubsub=False) as node,
        ):
            serve_dialback(server, dialback)
            await node.connect(server.listen_multiaddrs[0])
            reply = await ask_dialback(node, server.peer_id)
            assert (reply.verdict, reply.reachable, reply.observed_ip) == (
                "public",
                True,
                "127.0.0.1",
            )
            assert node.listen_multiaddrs[0].startswith(reply.dialed)
            # A port nobody listens on, on the right IP: dialled, refused, not reachable -- the
            # connection the request came on does not count.
            reply = await ask_dialback(node, server.peer_id, ["/ip4/127.0.0.1/tcp/1"])
            assert (reply.verdict, reply.reachable) == ("unreachable", False)
            # Addresses elsewhere are never dialled (no dial-back amplification).
            reply = await ask_dialback(node, server.peer_id, ["/ip4/192.0.2.1/tcp/4001"])
            assert reply.reachable is False and "192.0.2.1" not in reply.dialed

    run(body)


def test_libp2p_autonat_says_ok_without_dialling() -> None:
    """Why we do not use py-libp2p 0.8.1's AutoNAT: its server "dials back" with host.connect,
    which returns at once over the connection the request came on, so a node whose only
    advertised address is dead is told it is reachable. (If this starts failing, upstream fixed
    it and host/autonat may be worth a second look.)"""
    from libp2p.host.autonat.autonat import AutoNATService
    from libp2p.host.autonat.pb.autonat_pb2 import Message
    from multiaddr import Multiaddr

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as server,
            open_host(Identity.generate(), pubsub=False) as node,
        ):
            AutoNATService(server.libp2p, serve=True)
            client = AutoNATService(node.libp2p, serve=False)
            await node.connect(server.listen_multiaddrs[0])
            status, _ = await client.query_server(
                server.peer_id, [Multiaddr("/ip4/127.0.0.1/tcp/1").to_bytes()]
            )
            assert status == Message.OK

    run(body)


# ------------------------------------------------------------------ in the emulated internet

PREFIX = "ecnr"
_OK, _WHY = netem_nat.available(prefix="ecnq")
needs_nat = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")

SERVER = """
import sys, trio
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat.dialback import open_dialback, serve_dialback
async def main():
    async with open_host(Identity.generate(), [sys.argv[1]], pubsub=False) as h, \\
            open_dialback() as d:
        serve_dialback(h, d)
        print(h.listen_multiaddrs[0], flush=True)
        await trio.sleep(120)
trio.run(main)
"""
CLIENT = """
import json, sys, trio
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat.dialback import ask_dialback
async def main():
    async with open_host(Identity.generate(), [sys.argv[2]], pubsub=False) as h:
        peer = await h.connect(sys.argv[1])
        print(json.dumps((await ask_dialback(h, peer)).to_obj()), flush=True)
trio.run(main)
"""


@pytest.mark.slow
@needs_nat
def test_dialback_in_the_emulated_internet() -> None:
    """A public node is reachable; a node behind either kind of NAT is not; with a port
    forwarded on its router, a node behind NAT is reachable ("forwarded")."""
    routers = [
        netem_nat.RouterSpec("eim", "eim"),
        netem_nat.RouterSpec("sym", "sym"),
        netem_nat.RouterSpec("fwd", "eim", forward_port=4001),
    ]
    hosts = [
        netem_nat.NatHostSpec("coord"),
        netem_nat.NatHostSpec("pub"),
        netem_nat.NatHostSpec("a", "eim"),
        netem_nat.NatHostSpec("b", "sym"),
        netem_nat.NatHostSpec("c", "fwd"),
    ]
    inet = netem_nat.up(routers, hosts, prefix=PREFIX, public_subnet="10.73.0.0/24", quiet=True)
    srv = None
    try:
        srv = subprocess.Popen(
            netem_nat.exec_argv(
                "coord",
                [sys.executable, "-c", SERVER, f"/ip4/{inet.hosts['coord'].ip}/tcp/4001"],
                PREFIX,
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert srv.stdout is not None
        coord_addr = srv.stdout.readline().strip()
        verdicts = {}
        for name in ("pub", "a", "b", "c"):
            listen = f"/ip4/{inet.hosts[name].ip}/tcp/4001"
            out = subprocess.run(
                netem_nat.exec_argv(
                    name, [sys.executable, "-c", CLIENT, coord_addr, listen], PREFIX
                ),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            verdicts[name] = json.loads(out.stdout.strip().splitlines()[-1])
        assert (verdicts["pub"]["verdict"], verdicts["pub"]["reachable"]) == ("public", True)
        for name, router in (("a", "eim"), ("b", "sym")):
            assert (verdicts[name]["verdict"], verdicts[name]["reachable"]) == ("nat", False)
            assert verdicts[name]["observed_ip"] == inet.routers[router].public_ip
        assert (verdicts["c"]["verdict"], verdicts["c"]["reachable"]) == ("forwarded", True)
    finally:
        if srv is not None:
            srv.kill()
            srv.wait(timeout=10)
        time.sleep(0.2)
        netem_nat.down(PREFIX, quiet=True)
