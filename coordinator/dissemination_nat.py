"""Direct paths between nodes behind NAT, for the planner: which pairs to punch, and relays
over the paths that came up.

A node no dial-back reached is planned as a leaf (:class:`~echo.coordinator.dissemination
.Dissemination`): nobody can dial it. Two such nodes can still get a direct connection when the
coordinator tells both to open one at the same moment -- a TCP hole punch across two
endpoint-independent routers, a plain dial on their LAN behind one router
(:mod:`echo.node.punching`, :mod:`echo.coordinator.punching`). :func:`punch_pairs` says which
pairs to try; :func:`with_punched_relays` takes a plan whose NAT'd nodes are leaves and makes
some of them relays for the NAT'd peers they have a confirmed path to (both ends reported the
connection): each such child moves, in every stripe, from its parent to the NAT'd relay.

A node behind a symmetric router fails every punch (its router gives each remote a new port);
it keeps no path and stays a leaf fed by a dialable parent. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from echo.p2p.tree_plan import Stripe, TreePlan
from echo.protocol.reachability import MAX_PUNCH_ADDRS, PunchMethod

_TCP_PORT = re.compile(r"^/ip4/[^/]+/tcp/(\d{1,5})(?:/|$)")

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
                lan_b, lan_a = ib.addrs[:MAX_PUNCH_ADDRS], ia.addrs[:MAX_PUNCH_ADDRS]
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


def with_punched_relays(
    plan: TreePlan,
    paths: Mapping[str, set[str]],
    relay_upload: Callable[[str], float],
    max_fanout: int,
) -> TreePlan:
    """``plan`` with NAT'd leaves made relays for the NAT'd leaves they have a path to.

    ``paths[n]``: the plan's nodes ``n`` has a confirmed direct connection to (both are planned
    as leaves because no dial-back reached them). Greedily, the node with the most paths (then
    the smallest id) becomes a relay for its unassigned path peers (at most ``max_fanout``); a
    node given a NAT'd parent is never a relay itself, so each moved child is one hop deeper
    than its NAT'd relay and no cycle can form. ``relay_upload(n)`` is the uplink a relay ``n``
    is planned with. Returns ``plan`` itself when nothing changes.
    """
    has_kids = {p for s in plan.stripes for p, cs in s.children.items() if cs}
    leaves = {n for n in paths if n in plan.ups and n != plan.source and n not in has_kids}
    kids_of: dict[str, list[str]] = {}
    assigned: set[str] = set()
    order = sorted(leaves, key=lambda n: (-len(paths[n] & leaves), n))
    for relay in order:
        if relay in assigned:
            continue
        kids = sorted(p for p in paths[relay] & leaves if p not in assigned and p not in kids_of)
        kids = kids[:max_fanout]
        if kids:
            kids_of[relay] = kids
            assigned.update(kids)
    if not kids_of:
        return plan
    moved = {c: r for r, cs in kids_of.items() for c in cs}
    stripes = []
    for s in plan.stripes:
        children = {p: tuple(c for c in cs if c not in moved) for p, cs in s.children.items()}
        for relay, kids in kids_of.items():
            children[relay] = children.get(relay, ()) + tuple(kids)
        stripes.append(Stripe({p: cs for p, cs in children.items() if cs}, s.rate_bps))
    ups = dict(plan.ups)
    for relay in kids_of:
        ups[relay] = relay_upload(relay)
    kind = plan.kind if plan.kind.endswith("+punched") else f"{plan.kind}+punched"
    return TreePlan(plan.source, tuple(stripes), ups, plan.downs, kind, plan.weights)


__all__ = [
    "MAX_CONCURRENT_PER_NODE",
    "MAX_PATHS_PER_NODE",
    "MAX_TRIES_PER_NODE",
    "NatInfo",
    "PunchPair",
    "pair_key",
    "punch_pairs",
    "with_punched_relays",
]
