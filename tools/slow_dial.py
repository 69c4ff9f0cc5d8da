"""A slow first dial, the NAT swarm's circuit drill (issue 32): inside a host's network namespace,
the first TCP connection the host opens to each of some addresses loses its SYNs for
:data:`LOSS_S`, so it comes up only at the kernel's next SYN retransmission after that: 3-4 s
after the first try where SYNs are retried every second (``tcp_syn_linear_timeouts``, Linux
6.5+), 3 or 7 s where the wait doubles (1, 2, 4 s). Later connections to the same address are
not touched.

Why a drill: a node behind NAT lets its relay parents reach it by dialling them itself
(``Peers.reach_out`` in :mod:`echo.p2p.relay.peers`). A parent that sees no connection from it
within ``_REVERSAL_GRACE_S`` (2 s) reaches it through a circuit relay at the address its plan
announces, and asks it over that circuit to dial back (DCUtR). Delaying the first dials makes
that fallback likelier in a swarm run (``nat_swarm --slow-first-dial``), not certain: whether a
parent's first push to a node finds it unconnected still depends on what connected the two
before (the node relaying to that parent, pulling from it) and on when the plan reached each,
and a swarm's relays log their circuit counts only every 10 s (docs/results/2026-12-07-circuits.md).
The fallback itself is tested deterministically in tests/nat/test_nat_circuit_push.py; CI runs
no drilled swarm.

Uses iptables' ``recent`` match keyed on the destination (one list per namespace). Owns nothing:
the rules live in the namespace and go with it (``netem_nat.down``).

:raises subprocess.CalledProcessError: from :func:`slow_first_dials` when iptables refuses a rule.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import echo.tools.netem_nat as netem_nat

# SYNs to a new address are dropped for this long after the first one: the connection then
# comes up past the relay's 2 s grace (with 2, SYNs retried every second got through at 2.03 s)
# and well within the 10 s connect timeouts. Whole seconds: iptables' recent match counts so.
LOSS_S = 3
_LIST = "echo_first_dial"


def rules(addresses: Sequence[str]) -> list[list[str]]:
    """The iptables arguments (OUTPUT chain) that slow the first dial to each of ``addresses``:
    a SYN to an address first seen under :data:`LOSS_S` ago is dropped, one seen earlier goes
    through, and one never seen is remembered and dropped.

    :raises ValueError: no addresses.
    """
    if not addresses:
        raise ValueError("no addresses to slow the first dial to")
    out = []
    for ip in addresses:
        syn = [
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "--syn",
            "-d",
            ip,
            "-m",
            "recent",
            "--name",
            _LIST,
            "--rdest",
        ]
        out += [
            [*syn, "--rcheck", "--seconds", str(LOSS_S), "-j", "DROP"],
            [*syn, "--rcheck", "-j", "ACCEPT"],
            [*syn, "--set", "-j", "DROP"],
        ]
    return out


def slow_first_dials(host: str, addresses: Sequence[str], prefix: str) -> None:
    """Install :func:`rules` in ``host``'s namespace of the internet ``prefix``."""
    for r in rules(addresses):
        subprocess.run(
            netem_nat.exec_argv(host, ["iptables", *r], prefix),
            check=True,
            capture_output=True,
            text=True,
        )


__all__ = ["LOSS_S", "rules", "slow_first_dials"]
