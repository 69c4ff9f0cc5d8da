"""Which addresses of a node a plan may hand to the others.

A plan hands every node the addresses of the others, and honest relays dial them, so it carries
only what a dial-back verified (:func:`verified_addrs`: the address that answered, or those it
dialled, all on the IP the coordinator saw the node connect from) -- never a declared one. A node
not yet probed, or not dialable, is announced without addresses: it dials its parents itself when
it joins the plan and they push over that connection
(:meth:`echo.p2p.relay.peers.Peers.reach_out`).

Loopback, private and link-local addresses are handed out only when the operator allows them
(``local_addrs=True``) or, by default, when every announced address of the plan is one (a swarm
on one machine or one LAN: the demo and the tests); in a swarm that also has public nodes, a node
seen on a local address is announced without addresses, so no volunteer is told to dial into its
own LAN (issue 26, finding 6). A node announced without direct addresses is announced with its
trusted circuit addresses (:func:`with_circuits`): peers reach it through a relay for control
messages.

Pure functions: no state, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from echo.coordinator.dissemination.circuits import trusted_circuits
from echo.p2p.nat.dialback import candidates
from echo.p2p.prefixes import prefix_of
from echo.protocol import broadcast as b

_IP_ADDR = re.compile(r"^/ip[46]/([^/]+)/")


def is_local_addr(addr: str) -> bool:
    """Whether ``addr`` (a multiaddr) points at a loopback, private or link-local IP -- or at
    something that is not an IP address at all (treated as local: never handed out blindly)."""
    found = _IP_ADDR.match(addr)
    prefix = prefix_of(found.group(1)) if found else None
    return prefix is None or prefix.kind != "public"


def network_of(ip: str) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) ``ip`` is counted in (loopback: the address itself)."""
    prefix = prefix_of(ip) if ip else None
    return prefix.network if prefix is not None else None


def verified_addrs(
    node_id: str, declared: Sequence[str], observed_ip: str, verdict: str, dialed: str
) -> list[str]:
    """The addresses of ``node_id`` a dial-back vouches for, ``/p2p/<node_id>`` appended: the one
    that answered (``dialed``), else every candidate it dialled for that ``verdict``
    (:func:`echo.p2p.nat.dialback.candidates`: always on ``observed_ip``, the IP the coordinator
    saw the node connect from). Nothing without an observed IP: a declared address is never
    vouched for by itself."""
    if not observed_ip:
        return []
    if dialed:
        found = _IP_ADDR.match(dialed)
        if found is None or found.group(1) != observed_ip:
            return []
        dialed_ones = [dialed.split("/p2p/", 1)[0]]
    else:
        bare = [a.split("/p2p/", 1)[0] for a in declared]  # the dial-back dials them so
        dialed_ones = [a for a, v in candidates(bare, observed_ip) if not verdict or v == verdict]
    return [f"{a}/p2p/{node_id}" for a in dialed_ones][: b.MAX_ADDRS]


def direct_addrs(
    verified: Mapping[str, Sequence[str]], local_addrs: bool | None
) -> dict[str, list[str]]:
    """The direct addresses each member is announced with, from what a dial-back ``verified``
    of it ([] for a node not probed or not dialable): local ones only where ``local_addrs``
    allows (None: only when every verified address is local)."""
    allow = local_addrs
    if allow is None:  # a swarm on one machine or one LAN: nothing but local addresses
        allow = all(is_local_addr(a) for addrs in verified.values() for a in addrs)
    return {n: [a for a in addrs if allow or not is_local_addr(a)] for n, addrs in verified.items()}


def with_circuits(
    announced: Mapping[str, list[str]],
    circuits: Mapping[str, Sequence[str]],
    relays: Mapping[str, set[str]],
    local_addrs: bool | None,
) -> dict[str, list[str]]:
    """``announced`` (from :func:`direct_addrs`) with the trusted circuit addresses
    (:func:`~echo.coordinator.dissemination.circuits.trusted_circuits`) of the members announced
    without direct ones. ``circuits``: each member's declared circuit addresses; ``relays``:
    relay peer -> the addresses it is known by (the coordinator's own, and every dialable
    node's verified ones)."""
    out = dict(announced)
    allow_local = local_addrs is not False and (
        local_addrs or all(is_local_addr(a) for v in announced.values() for a in v)
    )
    for n, addrs in announced.items():
        if not addrs and circuits.get(n):
            ok = trusted_circuits(circuits[n], relays)
            out[n] = [a for a in ok if allow_local or not is_local_addr(a)]
    return out


__all__ = ["direct_addrs", "is_local_addr", "network_of", "verified_addrs", "with_circuits"]
