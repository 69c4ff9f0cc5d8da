"""The emulated internet (tools/netem_nat.py): public hosts, NAT routers of both kinds, LANs.

Needs root, iproute2, iptables (nat table) and network namespaces; skipped where they are missing.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import echo.tools.netem_nat as netem_nat

PREFIX = "ecnt"
_OK, _WHY = netem_nat.available(prefix="ecnq")
needs_nat = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8); s.settimeout(10)
for _ in range(int(sys.argv[2])):
    c, a = s.accept(); print(a[0], a[1], flush=True); c.close()
"""
CLIENT = """
import socket, sys
c = socket.socket(); c.settimeout(2)
if len(sys.argv) > 3: c.bind(("0.0.0.0", int(sys.argv[3])))
try:
    c.connect((sys.argv[1], int(sys.argv[2]))); print("ok")
except OSError as e:
    print("fail", type(e).__name__)
"""


def _client(host: str, ip: str, port: int, bind: int = 0) -> str:
    argv = [sys.executable, "-c", CLIENT, ip, str(port)] + ([str(bind)] if bind else [])
    out = subprocess.run(
        netem_nat.exec_argv(host, argv, PREFIX), capture_output=True, text=True, timeout=20
    )
    return out.stdout.strip()


def _observed(inet: netem_nat.Internet, server: str, clients: list[tuple[str, int]]) -> list:
    """(ip, port) the server saw for each (client host, bound source port)."""
    port = 7100
    srv = subprocess.Popen(
        netem_nat.exec_argv(
            server, [sys.executable, "-c", SERVER, str(port), str(len(clients))], PREFIX
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        for host, bind in clients:
            assert _client(host, inet.hosts[server].ip, port, bind) == "ok", host
        out, _ = srv.communicate(timeout=15)
    finally:
        srv.kill()
    return [(ln.split()[0], int(ln.split()[1])) for ln in out.splitlines()]


@pytest.fixture(scope="module")
def inet():
    net = netem_nat.up(
        [netem_nat.RouterSpec("home1", "eim"), netem_nat.RouterSpec("home2", "sym")],
        [
            netem_nat.NatHostSpec("pub"),
            netem_nat.NatHostSpec("a", "home1"),
            netem_nat.NatHostSpec("b", "home1"),
            netem_nat.NatHostSpec("c", "home2"),
        ],
        prefix=PREFIX,
        public_subnet="10.74.0.0/24",
        quiet=True,
    )
    yield net
    netem_nat.down(PREFIX, quiet=True)


@needs_nat
def test_outbound_is_masqueraded_and_mapping_kinds_differ(inet):
    seen = _observed(inet, "pub", [("a", 5555), ("c", 5555), ("c", 5556)])
    home1, home2 = inet.routers["home1"].public_ip, inet.routers["home2"].public_ip
    assert seen[0] == (home1, 5555)  # endpoint-independent: the source port kept
    assert [ip for ip, _ in seen[1:]] == [home2, home2]
    assert {p for _, p in seen[1:]} != {5555, 5556}  # symmetric: ports randomised


@needs_nat
def test_nobody_outside_can_dial_in_but_lan_neighbours_can(inet):
    srv = subprocess.Popen(
        netem_nat.exec_argv("a", [sys.executable, "-c", SERVER, "7200", "1"], PREFIX),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        a = inet.hosts["a"]
        assert _client("pub", a.ip, 7200).startswith("fail")  # its LAN address: no route
        assert _client("pub", a.public_ip, 7200).startswith("fail")  # the router: no forward
        assert _client("c", a.public_ip, 7200).startswith("fail")  # another home: same
        assert _client("b", a.ip, 7200) == "ok"  # same router, same LAN
        out, _ = srv.communicate(timeout=15)
    finally:
        srv.kill()
    assert out.split()[0] == inet.hosts["b"].ip  # no NAT between LAN neighbours


def test_spec_errors_name_the_bad_part():
    with pytest.raises(ValueError, match="kind 'cone'"):
        netem_nat.RouterSpec.parse("r1:cone")
    with pytest.raises(ValueError, match="unknown router 'nowhere'"):
        netem_nat.up([], [netem_nat.NatHostSpec("x", "nowhere")], prefix="ecnz")
    assert netem_nat.NatHostSpec.parse("n1@r1:2e6:2e7") == netem_nat.NatHostSpec(
        "n1", "r1", 2e6, 2e7
    )
