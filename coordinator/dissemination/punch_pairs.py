"""Direct paths between nodes behind NAT: which pairs to ask for one.

A node no dial-back reached cannot be dialled, so two such nodes can be parent and child in a
plan only over a direct connection set up for them: the coordinator tells both to open one at
the same moment -- a TCP hole punch across two endpoint-independent routers, a plain dial on
their LAN behind one router (:mod:`echo.node.punching`,
:mod:`echo.coordinator.dissemination.punching`).
:func:`punch_pairs` says which pairs to try; the paths that came up (both ends reported the
connection) go into the plan's :class:`~echo.coordinator.dissemination.planner.reach.Reach`.

A node behind a symmetric router fails every punch (its router gives each remote a new port);
it keeps no path and relays to dialable nodes only. Pure functions: no I/O, no clock.

What a node is told to dial is never simply what its peer declared: across routers it is the
peer's router ip as the coordinator saw it; behind one router it is the peer's declared LAN
addresses, but only those in a LAN range (:func:`lan_addrs`) -- a "LAN address" on a public ip
would be a stranger's host, and a node is not to be steered at it (issue 26, finding 6).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from echo.p2p.prefixes import prefix_of
from echo.protocol.nat import MAX_PUNCH_ADDRS, PunchMethod

_TCP_PORT = re.compile(r"^/ip4/[^/]+/tcp/(\d{1,5})(?:/|$)")
_IP = re.compile(r"^/ip[46]/([^/]+)/tcp/")

# A failed punch costs both nodes and the coordinator a task for the punch timeout (10 s): each
# node is paired this many times at most while its addresses stay the same. Enough to find
# partners among a few routers; keeps the n^2 pairs of a large swarm out of reach.
MAX_TRIES_PER_NODE = 8
# Punches one node runs at once. Each has its own dial socket (another remote, so another
# 4-tuple from the same listen port); running them side by side keeps a peer behind a
# symmetric NAT, whose punches all fail after the timeout, from delaying the ones that work.
MAX_CONCURRENT_PER_NODE = 4
# Paths a node needs at most: beyond a relay's fanout more children cannot be given to it.
MAX_PATHS_PER_NODE = 8


@dataclass(frozen=True)
class NatInfo:
    """What the punch planning needs of one node no dial-back reached."""

    observed_ip: str  # its router's public address, as the coordinator saw it
    addrs: tuple[str, ...]  # what it advertised (its LAN addresses, /p2p/ included)

    @property
    def port(self) -> int | None:
        """The TCP port it listens on (an eim router maps it to the same public port)."""
        for addr in self.addrs:
            # The registered text as is: it was validated when the node registered.
            found = _TCP_PORT.search(addr)
            if found and 0 < int(found.group(1)) < 65536:
                return int(found.group(1))
        return None


@dataclass(frozen=True)
class PunchPair:
    """Two nodes to connect, and what each is told about the other."""

    a: str
    b: str
    method: PunchMethod
    addrs_for_a: tuple[str, ...]  # where ``a`` connects to ``b``
    addrs_for_b: tuple[str, ...]
    # What the pair was planned from: an outcome booked for other addresses would be stale.
    info_a: NatInfo
    info_b: NatInfo


def lan_addrs(addrs: Sequence[str], observed_ip: str) -> tuple[str, ...]:
    """The declared TCP addresses of a node behind the router at ``observed_ip`` that its LAN
    peers may dial: private or link-local ones, and loopback ones only when the router's ip is
    loopback itself (nodes on the coordinator's own machine: the tests)."""
    shared = prefix_of(observed_ip)
    allowed = {"private"} | (
        {"loopback"} if shared is not None and shared.kind == "loopback" else set()
    )
    out = []
    for addr in addrs:
        found = _IP.match(addr)
        prefix = prefix_of(found.group(1)) if found else None
        if prefix is not None and prefix.kind in allowed:
            out.append(addr)
    return tuple(out[:MAX_PUNCH_ADDRS])


def pair_key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def _public(node: str, info: NatInfo) -> str | None:
    port = info.port
    return None if port is None else f"/ip4/{info.observed_ip}/tcp/{port}/p2p/{node}"


def punch_pairs(
    nat: Mapping[str, NatInfo],
    tried: Mapping[frozenset[str], bool],
    busy: Mapping[str, int] | None = None,
    in_flight: Set[frozenset[str]] = frozenset(),
) -> list[PunchPair]:
    """Pairs of ``nat`` nodes worth connecting now: neither tried nor ``in_flight``, each node
    in at most :data:`MAX_CONCURRENT_PER_NODE` punches at once (``busy``: its punches in
    flight) and below its :data:`MAX_TRIES_PER_NODE` and :data:`MAX_PATHS_PER_NODE`.

    Two nodes seen from one public ip are behind one router: they dial each other's LAN
    addresses. Across routers they punch to ``/ip4/<observed ip>/tcp/<listen port>``; of the
    nodes behind one router that listen on the same port only the first (by id) punches: their
    public endpoints would be the same, so a peer's SYN could reach only one of them.
    """
    busy = busy or {}
    tries: dict[str, int] = {}
    paths: dict[str, int] = {}
    for key in [*tried, *in_flight]:
        for n in key:
            tries[n] = tries.get(n, 0) + 1
            paths[n] = paths.get(n, 0) + int(tried.get(key, False))
    owner: dict[tuple[str, int | None], str] = {}
    for node in sorted(nat):
        owner.setdefault((nat[node].observed_ip, nat[node].port), node)
    slots = {
        n: MAX_CONCURRENT_PER_NODE - busy.get(n, 0)
        for n in nat
        if tries.get(n, 0) < MAX_TRIES_PER_NODE and paths.get(n, 0) < MAX_PATHS_PER_NODE
    }
    free = sorted(n for n, k in slots.items() if k > 0)
    out: list[PunchPair] = []
    for i, a in enumerate(free):
        for b in free[i + 1 :]:
            if slots[a] <= 0:
                break
            key = pair_key(a, b)
            if slots[b] <= 0 or key in tried or key in in_flight:
                continue
            ia, ib = nat[a], nat[b]
            if ia.observed_ip == ib.observed_ip:
                lan_b, lan_a = (
                    lan_addrs(ib.addrs, ib.observed_ip),
                    lan_addrs(ia.addrs, ia.observed_ip),
                )
                if not lan_a or not lan_b:  # nothing in a LAN range to dial
                    continue
                pair = PunchPair(a, b, "lan", lan_b, lan_a, ia, ib)
            else:
                if owner[(ia.observed_ip, ia.port)] != a or owner[(ib.observed_ip, ib.port)] != b:
                    continue
                pa, pb = _public(a, ia), _public(b, ib)
                if pa is None or pb is None:
                    continue
                pair = PunchPair(a, b, "punch", (pb,), (pa,), ia, ib)
            out.append(pair)
            slots[a] -= 1
            slots[b] -= 1
    return out


__all__ = [
    "MAX_CONCURRENT_PER_NODE",
    "MAX_PATHS_PER_NODE",
    "MAX_TRIES_PER_NODE",
    "NatInfo",
    "PunchPair",
    "lan_addrs",
    "pair_key",
    "punch_pairs",
]
