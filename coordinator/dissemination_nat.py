"""Direct paths between nodes behind NAT, for the planner: which pairs to punch, and relays
over the paths that came up.

A node no dial-back reached is planned as a leaf (:class:`~echo.coordinator.dissemination
.Dissemination`): nobody can dial it. Two such nodes can still get a direct connection when the
coordinator tells both to open one at the same moment -- a TCP hole punch across two
endpoint-independent routers, a plain dial on their LAN behind one router
(:mod:`echo.node.punching`, :mod:`echo.coordinator.punching`). :func:`punch_pairs` says which
pairs to try; :func:`with_punched_relays` takes a plan whose NAT'd nodes are leaves and makes
some of them relays for the NAT'd peers they have a confirmed path to (both ends reported the
connection), stripe by stripe, where that shortens the plan's estimated time-to-all.

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
# Candidate plans with_punched_relays estimates at most. It runs for every announced version;
# an estimate walks every stripe once (about 0.2 ms at 16 nodes, 0.8 ms at 128 here), so this
# keeps it near 0.1 s at 128 nodes: it is on the path of the learner's report.
MAX_PLAN_EVALS = 120


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
    total_bytes: int,
    chunk_bytes: int,
) -> TreePlan:
    """``plan`` with NAT'd leaves fed, where that is faster, by NAT'd relays they have a path to.

    ``paths[n]``: the plan's nodes ``n`` has a confirmed direct connection to (both are planned
    as leaves because no dial-back reached them); ``relay_upload(n)`` is the uplink a relay
    ``n`` is planned with. A move puts one such leaf, in one stripe, under a peer it has a path
    to. Moves are taken best first and only while they shorten the plan's estimated
    time-to-all for ``total_bytes`` in ``chunk_bytes`` chunks (its worst finish time, then the
    sum of all finish times: one move cannot lower the worst of several equal stripes). An
    earlier version moved a relay's path peers in every stripe at once: at N = 16 with half
    behind NAT (benchmarks/nat.py's uplinks) that took the estimate from 5.0 s to 24.6 s, one
    slow home uplink carrying whole copies. A moved node is a leaf in that stripe, so a relay
    is never below its own child and no cycle can form; a relay has at most ``max_fanout``
    children per stripe. At most :data:`MAX_PLAN_EVALS` candidate plans are estimated.
    Returns ``plan`` itself when nothing helps.
    """
    nat = {n for n in paths if n in plan.ups and n != plan.source}
    pairs = sorted((r, k) for r in nat for k in paths[r] if k in nat and k != r)
    if not pairs or total_bytes <= 0:
        return plan

    def score(p: TreePlan) -> tuple[float, float]:
        times = p.finish_times(total_bytes, chunk_bytes)
        return (max(times, default=0.0), sum(times))

    best, best_score, evals = plan, score(plan), 0
    while evals < MAX_PLAN_EVALS:
        found: tuple[tuple[float, float], TreePlan] | None = None
        for s, stripe in enumerate(best.stripes):
            parent_of = stripe.parents()
            for relay, kid in pairs:
                if evals >= MAX_PLAN_EVALS:
                    break
                if stripe.children.get(kid) or parent_of.get(kid) == relay:
                    continue  # the kid relays in this stripe, or is already there
                if len(stripe.children.get(relay, ())) >= max_fanout:
                    continue
                evals += 1
                cand = _move(best, s, kid, relay, relay_upload(relay))
                sc = score(cand)
                if _better(sc, found[0] if found else best_score):
                    found = (sc, cand)
        if found is None:
            break
        best_score, best = found
    if best is plan:
        return plan
    kind = plan.kind if plan.kind.endswith("+punched") else f"{plan.kind}+punched"
    return TreePlan(best.source, best.stripes, best.ups, best.downs, kind, best.weights)


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` beats ``b``: a lower worst finish time, or the same one and a lower sum (1e-9
    relative: float noise is not an improvement)."""
    if a[0] < b[0] * (1 - 1e-9):
        return True
    return a[0] <= b[0] * (1 + 1e-9) and a[1] < b[1] * (1 - 1e-9)


def _move(plan: TreePlan, stripe: int, kid: str, relay: str, relay_up: float) -> TreePlan:
    """``plan`` with ``kid`` fed by ``relay`` in ``stripe`` (its last child there)."""
    stripes = list(plan.stripes)
    old = stripes[stripe]
    children = {p: tuple(c for c in cs if c != kid) for p, cs in old.children.items()}
    children[relay] = children.get(relay, ()) + (kid,)
    stripes[stripe] = Stripe({p: cs for p, cs in children.items() if cs}, old.rate_bps)
    ups = {**plan.ups, relay: relay_up}
    return TreePlan(plan.source, tuple(stripes), ups, plan.downs, plan.kind, plan.weights)


__all__ = [
    "MAX_CONCURRENT_PER_NODE",
    "MAX_PLAN_EVALS",
    "MAX_PATHS_PER_NODE",
    "MAX_TRIES_PER_NODE",
    "NatInfo",
    "PunchPair",
    "pair_key",
    "punch_pairs",
    "with_punched_relays",
]
