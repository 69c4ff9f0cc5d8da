"""The NAT swarm's circuit drill (tools/slow_dial.py): a host's first TCP connection to an address
comes up 3-4 s late (its first SYNs are lost), later ones at once; other addresses are untouched.

The rules themselves need nothing; the timing needs root, iproute2 and iptables (its ``recent``
match) in network namespaces, and is skipped where they are missing.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import echo.tools.netem_nat as netem_nat
from echo.tools import slow_dial

PREFIX = "ecsd"
_OK, _WHY = netem_nat.available(prefix="ecnq")

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8); s.settimeout(20)
for _ in range(int(sys.argv[2])):
    c, _ = s.accept(); c.close()
"""
# Connects to (ip, port) once per argument after them and prints each connect's seconds.
CLIENT = """
import socket, sys, time
for _ in range(int(sys.argv[3])):
    c = socket.socket(); c.settimeout(8); t = time.monotonic()
    c.connect((sys.argv[1], int(sys.argv[2]))); print(round(time.monotonic() - t, 2)); c.close()
"""


def test_rules_drop_only_a_new_address_for_the_loss_window() -> None:
    got = slow_dial.rules(["10.0.0.1"])
    assert [r[r.index("recent") + 4 :] for r in got] == [
        ["--rcheck", "--seconds", str(slow_dial.LOSS_S), "-j", "DROP"],
        ["--rcheck", "-j", "ACCEPT"],
        ["--set", "-j", "DROP"],
    ]
    assert all(r[:2] == ["-A", "OUTPUT"] and "--syn" in r and "10.0.0.1" in r for r in got)
    assert len(slow_dial.rules(["10.0.0.1", "10.0.0.2"])) == 6
    with pytest.raises(ValueError, match="no addresses"):
        slow_dial.rules([])


@pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")
def test_the_first_dial_to_a_slowed_address_is_late_and_the_next_is_not() -> None:
    inet = netem_nat.up(
        [netem_nat.RouterSpec("home", "eim")],
        [
            netem_nat.NatHostSpec("pub"),
            netem_nat.NatHostSpec("pub2"),
            netem_nat.NatHostSpec("a", "home"),
        ],
        prefix=PREFIX,
        public_subnet="10.75.0.0/24",
        quiet=True,
    )
    servers = []
    try:
        slow_dial.slow_first_dials("a", [inet.hosts["pub"].ip], PREFIX)
        for host in ("pub", "pub2"):
            servers.append(
                subprocess.Popen(
                    netem_nat.exec_argv(host, [sys.executable, "-c", SERVER, "7300", "2"], PREFIX)
                )
            )
        time.sleep(0.5)

        def dials(host: str) -> list[float]:
            out = subprocess.run(
                netem_nat.exec_argv(
                    "a", [sys.executable, "-c", CLIENT, inet.hosts[host].ip, "7300", "2"], PREFIX
                ),
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            return [float(x) for x in out.stdout.split()]

        first, second = dials("pub")
        # SYNs lost for 3 s: the connection comes up past the relay's 2 s grace, and before
        # the 10 s connect timeouts (3-4 s with SYNs retried every second, 3 or 7 s doubling).
        assert 2.5 <= first < 8.0 and second < 0.5, (first, second)
        assert max(dials("pub2")) < 0.5  # an address not listed is not slowed
    finally:
        for s in servers:
            s.kill()
        netem_nat.down(PREFIX, quiet=True)
