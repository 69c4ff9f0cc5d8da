"""Broadcast tree planner: who pushes which stripe of a version to whom. Pure: no I/O, no clock.

A plan is one or more *stripes*; chunk ``i`` of a version travels down stripe ``i % stripes``,
or, when the plan has ``weights``, down the stripe :func:`echo.protocol.broadcast.stripe_table`
deals it to (stripes then carry shares of the chunks in proportion to their weights).
Each stripe is a tree rooted at the source that reaches every node exactly once, given as a
parent -> children map. Bandwidths are bytes per second.

:func:`plan_tree` builds it from measured upload bandwidth:

- the per-child rate target ``r`` is the highest rate at which every node still finds a parent
  (binary search), unless the caller fixes it;
- a parent gets ``floor(uplink / r)`` children, at most ``max_fanout``; the source's children,
  summed over stripes, also fit its uplink at ``r`` (each stripe takes as few as it needs);
- nodes are placed breadth first in decreasing order of uplink, so fast uploaders sit near the
  root and slow ones end up as leaves;
- with ``stripes = k > 1`` the nodes are split into ``k`` groups of about equal total uplink
  (largest first into the lightest group); group ``s`` forms the interior of stripe ``s`` and
  everyone else is a leaf there. Every uplink then carries one stripe, which is how a striped
  plan approaches the bound ``N * M / (B_s + sum B_i)`` that a single tree (whose leaves never
  upload) cannot.

:func:`plan_weighted` gives each stripe its own rate target and a share of the chunks in
proportion to the rate its tree sustains, so a fast group is not held to a slow group's rate.

:func:`best_plan` tries several stripe counts and keeps the one with the lowest
:meth:`TreePlan.estimate_s`; :func:`star_plan` and :func:`chain_plan` build the two baselines;
:func:`lower_bound_s` is the bound from REFERENCES.md.

:func:`route_for` cuts one node's :class:`~echo.protocol.broadcast.Route` out of a plan and
:func:`plan_record` turns a plan into its wire record; :func:`route_from_record` cuts a route
out of a received record.

Raises ``ValueError`` for bad arguments (negative bandwidths, a source among the nodes, a
stripe count below 1); nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from echo.protocol import broadcast as b

# More children than this per parent costs connections and per-stream CPU for little gain.
DEFAULT_MAX_FANOUT = 32
DEFAULT_MAX_STRIPES = 16
# Binary search on the per-child rate: relative precision 2**-40 is far below any measurement.
_SEARCH_STEPS = 30
# best_plan also tries these fractions of the highest rate target (wider, shallower trees).
_RATE_FRACTIONS = (0.75, 0.5)
# plan_weighted: rounds of raising each stripe's rate in turn (a third rarely adds 1%), each a
# binary search to 2**-14 of the range (far below what bandwidth measurements resolve).
_WEIGHTED_ROUNDS = 2
_WEIGHTED_SEARCH_STEPS = 14
# Stripe weights are integers relative to the fastest stripe's 1000: finer than any estimate.
_WEIGHT_SCALE = 1000


@dataclass(frozen=True)
class Stripe:
    """One tree: ``children[parent]`` in push order; ``rate_bps`` is the target it was sized for."""

    children: Mapping[str, tuple[str, ...]]
    rate_bps: float

    def parents(self) -> dict[str, str]:
        """child -> parent."""
        return {c: p for p, cs in self.children.items() for c in cs}

    def depths(self, source: str) -> dict[str, int]:
        """Hops from ``source`` to every node reached (the source is 0)."""
        depth = {source: 0}
        frontier = [source]
        while frontier:
            nxt = []
            for p in frontier:
                for c in self.children.get(p, ()):
                    depth[c] = depth[p] + 1
                    nxt.append(c)
            frontier = nxt
        return depth


@dataclass(frozen=True)
class TreePlan:
    """Stripes of a broadcast from ``source``; ``ups`` / ``downs`` include the source."""

    source: str
    stripes: tuple[Stripe, ...]
    ups: Mapping[str, float]
    downs: Mapping[str, float] = field(default_factory=dict)
    kind: str = "tree"
    # Each stripe's share of the chunks (b.stripe_table); empty: equal shares.
    weights: tuple[int, ...] = ()

    @property
    def nodes(self) -> list[str]:
        return [n for n in self.ups if n != self.source]

    def children_of(self, node: str) -> list[list[str]]:
        """``node``'s children in each stripe (what its relay pushes to)."""
        return [list(s.children.get(node, ())) for s in self.stripes]

    def parent_of(self, node: str, stripe: int) -> str | None:
        return self.stripes[stripe].parents().get(node)

    def fanout(self, node: str) -> int:
        """Children of ``node`` summed over stripes (its uplink is shared among them)."""
        return sum(len(s.children.get(node, ())) for s in self.stripes)

    def depth(self) -> int:
        return max((max(s.depths(self.source).values()) for s in self.stripes), default=0)

    @functools.cached_property
    def _links(self) -> dict[str, Counter[str]]:
        """parent -> child -> in how many stripes the parent feeds that child."""
        out: dict[str, Counter[str]] = {}
        for stripe in self.stripes:
            for p, cs in stripe.children.items():
                out.setdefault(p, Counter()).update(cs)
        return out

    def edge_rate(self, parent: str, child: str) -> float:
        """Steady rate of one edge: the parent's uplink shared equally by the distinct peers
        it feeds (as a fair-queueing link shares it: per connection, not per stream), then by
        the stripes it feeds this child in; and the child's downlink shared by its parents
        (one per stripe)."""
        links = self._links.get(parent, Counter())
        up = self.ups.get(parent, 0.0) / max(1, len(links)) / max(1, links[child])
        down = self.downs.get(child, math.inf) / len(self.stripes)
        return min(up, down)

    def estimate_s(self, total_bytes: int, chunk_bytes: int) -> float:
        """Analytic time until every node holds all ``total_bytes``.

        Per node and stripe, a pipeline along its path: the first chunk pays one chunk time per
        hop, the remaining chunks of the stripe pass at the path's slowest edge. The answer is the
        worst node's slowest stripe. Assumes every edge is busy for the whole transfer, so it is
        slightly pessimistic once stripes finish at different times.
        """
        if total_bytes <= 0 or not self.nodes:
            return 0.0
        chunk = max(1, min(chunk_bytes, total_bytes))
        n_chunks = math.ceil(total_bytes / chunk)
        sizes = Counter(b.stripe_table(n_chunks, len(self.stripes), self.weights))
        worst = 0.0
        for s, stripe in enumerate(self.stripes):
            n_s = sizes[s]
            if n_s == 0:
                continue
            parents = stripe.parents()
            for node in self.nodes:
                path = []
                c = node
                while c != self.source:
                    p = parents[c]
                    path.append(self.edge_rate(p, c))
                    c = p
                slowest = min(path)
                if slowest <= 0:
                    return math.inf
                t = sum(chunk / r for r in path) + (n_s - 1) * chunk / slowest
                worst = max(worst, t)
        return worst

    def stripe_rate(self, stripe: int) -> float:
        """The slowest edge of ``stripe``: the rate its chunks pipeline through the tree at."""
        return min((self.edge_rate(p, c) for p, cs in self.stripes[stripe].children.items()
                    for c in cs), default=0.0)

    def summary(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "stripes": len(self.stripes),
            "depth": self.depth(),
            "max_fanout": max((self.fanout(n) for n in self.ups), default=0),
            "rate_bps": [s.rate_bps for s in self.stripes],
            "weights": list(self.weights),
        }


def lower_bound_s(
    total_bytes: float, source_up: float, downs: Sequence[float], ups: Sequence[float]
) -> float:
    """``max(M / B_s, M / min D_i, N * M / (B_s + sum B_i))`` (REFERENCES.md)."""
    if total_bytes <= 0 or not downs:
        return 0.0
    if source_up <= 0 or min(downs) <= 0:
        return math.inf
    n = len(downs)
    return max(
        total_bytes / source_up,
        total_bytes / min(downs),
        n * total_bytes / (source_up + sum(ups)),
    )


# ------------------------------------------------------------------------------ building


def _check(source: str, source_up: float, nodes: Mapping[str, float]) -> None:
    if source in nodes:
        raise ValueError(f"the source {source!r} is also listed as a node")
    if source_up <= 0 or not math.isfinite(source_up):
        raise ValueError("the source needs a positive, finite uplink")
    for n, up in nodes.items():
        if up < 0 or not math.isfinite(up):
            raise ValueError(f"node {n!r} has a bad uplink {up!r}")


def _by_uplink(nodes: Mapping[str, float]) -> list[str]:
    """Fastest first; ties broken by name so plans are deterministic."""
    return sorted(nodes, key=lambda n: (-nodes[n], n))


def _place(
    source: str,
    source_slots: int,
    caps: Mapping[str, float],
    order: Sequence[str],
    rate: float,
    max_fanout: int,
) -> dict[str, list[str]] | None:
    """Breadth-first placement of ``order``: the source offers ``source_slots`` slots, every
    placed node ``floor(cap / rate)`` (at most ``max_fanout``).

    Parents offer their slots in the order they were placed (source first), so the earliest
    (fastest) nodes end up nearest the root. ``None`` when some node finds no free slot.
    """
    children: dict[str, list[str]] = {source: []}
    open_parents = [source]
    slots = {source: source_slots}
    head = 0
    for node in order:
        while head < len(open_parents) and slots[open_parents[head]] == 0:
            head += 1
        if head == len(open_parents):
            return None
        p = open_parents[head]
        children[p].append(node)
        slots[p] -= 1
        children[node] = []
        slots[node] = min(max_fanout, int(caps.get(node, 0.0) / rate + 1e-9))
        if slots[node] > 0:
            open_parents.append(node)
    return children


def _min_source_slots(
    source: str,
    caps: Mapping[str, float],
    order: Sequence[str],
    rate: float,
    max_fanout: int,
) -> tuple[int, dict[str, list[str]]]:
    """The fewest source children with which every node of ``order`` finds a parent at ``rate``
    (placement succeeds for any larger count too, so the search is binary)."""
    lo, hi = 1, max(1, len(order))
    best = _place(source, hi, caps, order, rate, max_fanout)
    assert best is not None  # the source alone can take everyone
    while lo < hi:
        mid = (lo + hi) // 2
        placed = _place(source, mid, caps, order, rate, max_fanout)
        if placed is None:
            lo = mid + 1
        else:
            hi, best = mid, placed
    return hi, best


def _stripes_at(
    source: str,
    source_up: float,
    orders: Sequence[Sequence[str]],
    caps: Sequence[Mapping[str, float]],
    rate: float,
    max_fanout: int,
) -> list[dict[str, list[str]]] | None:
    """Every stripe at per-child ``rate``, the source's children summed over stripes within its
    uplink; ``None`` if the source cannot feed them all at that rate.

    Each stripe first takes the fewest source children it needs; source slots left over are
    then handed out round-robin (shallower trees, and the source's uplink is not left idle).
    """
    budget = int(source_up / rate + 1e-9)
    slots = []
    for order, stripe_caps in zip(orders, caps, strict=True):
        used = _min_source_slots(source, stripe_caps, order, rate, max_fanout)[0] if order else 0
        slots.append(used)
    if sum(slots) > budget:
        return None
    spare = min(budget, max(max_fanout, sum(slots))) - sum(slots)
    while spare > 0:
        grew = False
        for s, order in enumerate(orders):
            if spare > 0 and slots[s] < len(order):
                slots[s] += 1
                spare -= 1
                grew = True
        if not grew:
            break
    built = []
    for order, stripe_caps, n in zip(orders, caps, slots, strict=True):
        placed = _place(source, n, stripe_caps, order, rate, max_fanout) if order else None
        built.append(placed if placed is not None else {source: []})
    return built


def _groups(nodes: Mapping[str, float], k: int) -> list[list[str]]:
    """``k`` groups of about equal total uplink (longest-processing-time greedy)."""
    groups: list[list[str]] = [[] for _ in range(k)]
    load = [0.0] * k
    for n in _by_uplink(nodes):
        g = min(range(k), key=lambda i: (load[i], len(groups[i]), i))
        groups[g].append(n)
        load[g] += nodes[n]
    return groups


def _stripe_orders(
    nodes: Mapping[str, float], k: int
) -> tuple[list[list[str]], list[dict[str, float]]]:
    """Per stripe: the placement order and the uplinks that count in it."""
    fast_first = _by_uplink(nodes)
    orders, caps = [], []
    for group in _groups(nodes, k):
        # Interior candidates (this stripe's group, fastest first), then everyone else as leaves
        # (no capacity in this stripe: their uplink carries their own group's stripe), slowest
        # first: source slots beyond the group then go to nodes the source does not already
        # feed in their own stripe (a fair-queued uplink shares per peer, not per stream).
        members = set(group)
        orders.append(group + [n for n in reversed(fast_first) if n not in members])
        caps.append({n: float(nodes[n]) for n in group})
    return orders, caps


def plan_tree(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    stripes: int = 1,
    rate_bps: float | None = None,
    downs: Mapping[str, float] | None = None,
    max_fanout: int = DEFAULT_MAX_FANOUT,
) -> TreePlan:
    """Plan ``stripes`` trees from ``source`` to every node in ``nodes`` (id -> uplink B/s).

    ``rate_bps`` fixes the per-child rate target (default: the highest that reaches everyone);
    ``downs`` (id -> downlink B/s, optional) only feeds :meth:`TreePlan.estimate_s`.
    """
    _check(source, source_up_bps, nodes)
    if stripes < 1:
        raise ValueError("stripes must be at least 1")
    if max_fanout < 1:
        raise ValueError("max_fanout must be at least 1")
    k = max(1, min(stripes, len(nodes)))
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    orders, caps = _stripe_orders(nodes, k)
    if rate_bps is not None:
        built = _stripes_at(source, source_up_bps, orders, caps, rate_bps, max_fanout)
        if built is None:
            raise ValueError(f"no plan reaches all {len(nodes)} nodes at {rate_bps:.0f} B/s")
        rate = rate_bps
    else:
        # At source_up / (k * N) the source alone can feed every node in every stripe.
        rate = source_up_bps / (k * max(1, len(nodes)))
        built = _stripes_at(source, source_up_bps, orders, caps, rate, max_fanout=len(nodes) + 1)
        assert built is not None
        lo, hi = rate, max(ups.values())
        for _ in range(_SEARCH_STEPS):
            mid = (lo + hi) / 2
            got = _stripes_at(source, source_up_bps, orders, caps, mid, max_fanout)
            if got is None:
                hi = mid
            else:
                lo, rate, built = mid, mid, got
    stripes_ = tuple(
        Stripe({p: tuple(cs) for p, cs in placed.items() if cs}, rate) for placed in built
    )
    return TreePlan(source, stripes_, ups, dict(downs or {}), kind=f"tree/{k}")


def plan_weighted(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    stripes: int,
    downs: Mapping[str, float] | None = None,
    max_fanout: int = DEFAULT_MAX_FANOUT,
) -> TreePlan:
    """Like :func:`plan_tree`, but every stripe gets its own rate target and a share of the
    chunks in proportion to the rate it then sustains (``TreePlan.weights``).

    One rate for all stripes leaves a fast group's uplinks partly idle whenever a slower group
    sets the common rate (with few nodes, groups differ a lot). Starting from the common rate,
    each stripe's rate is raised in turn as far as its group and the source's uplink allow
    (the source's children, summed over stripes at their rates, within its uplink), a few rounds;
    source slots left over go round-robin to the stripes that can afford them. The weights are
    each stripe's slowest edge (:meth:`TreePlan.stripe_rate`), so shares follow what the trees
    deliver, the source's uplink shared equally among its children as fair queueing does.
    """
    base = plan_tree(source, source_up_bps, nodes, stripes=stripes, downs=downs,
                     max_fanout=max_fanout)
    k = len(base.stripes)
    if k == 1:
        return base
    orders, caps = _stripe_orders(nodes, k)
    best: TreePlan | None = None
    best_rate = 0.0
    # Raising one stripe takes source budget from the next, so the order matters: try both ways
    # and keep the plan that delivers more in all (sum of the stripes' sustained rates).
    for order in (range(k), range(k - 1, -1, -1)):
        built = _raise_stripes(source, source_up_bps, orders, caps, base.stripes[0].rate_bps,
                               list(order), max_fanout)
        shaped = replace(base, stripes=built, kind=f"tree/{k}w")
        thr = [shaped.stripe_rate(s) for s in range(k)]
        if min(thr) <= 0 or sum(thr) <= best_rate:
            continue
        weights = tuple(max(1, round(_WEIGHT_SCALE * r / max(thr))) for r in thr)
        best = replace(shaped, weights=weights)
        best_rate = sum(thr)
    return best if best is not None else base


def _raise_stripes(
    source: str,
    source_up_bps: float,
    orders: Sequence[Sequence[str]],
    caps: Sequence[Mapping[str, float]],
    rate: float,
    order: Sequence[int],
    max_fanout: int,
) -> tuple[Stripe, ...]:
    """From a common ``rate``, raise each stripe's rate in turn (``order``) as far as its group
    and the source's remaining uplink allow; spare source slots then go round-robin."""
    k = len(orders)

    def slots(s: int, r: float) -> int:
        return _min_source_slots(source, caps[s], orders[s], r, max_fanout)[0]

    rates = [rate] * k
    used = [slots(s, rate) for s in range(k)]
    top = max((max(c.values(), default=0.0) for c in caps), default=0.0) + source_up_bps
    for _ in range(_WEIGHTED_ROUNDS):
        for s in order:
            others = sum(used[j] * rates[j] for j in range(k) if j != s)
            lo, hi = rates[s], top
            for _ in range(_WEIGHTED_SEARCH_STEPS):
                mid = (lo + hi) / 2
                if others + slots(s, mid) * mid <= source_up_bps * (1 + 1e-9):
                    lo = mid
                else:
                    hi = mid
            rates[s], used[s] = lo, slots(s, lo)
    spare = source_up_bps - sum(n * r for n, r in zip(used, rates, strict=True))
    grew = True
    while grew:
        grew = False
        for s in order:
            if used[s] < len(orders[s]) and rates[s] <= spare * (1 + 1e-9):
                used[s] += 1
                spare -= rates[s]
                grew = True
    built = []
    for s in range(k):
        placed = _place(source, used[s], caps[s], orders[s], rates[s], max_fanout)
        assert placed is not None  # more source slots than the minimum always place
        built.append(Stripe({p: tuple(cs) for p, cs in placed.items() if cs}, rates[s]))
    return tuple(built)


def best_plan(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    total_bytes: int,
    chunk_bytes: int,
    downs: Mapping[str, float] | None = None,
    max_stripes: int = DEFAULT_MAX_STRIPES,
    max_fanout: int = DEFAULT_MAX_FANOUT,
) -> TreePlan:
    """:func:`plan_tree` for 1..``max_stripes`` stripes, each at its highest rate target and a
    few lower ones (wider, shallower trees fill the pipeline sooner, which wins for payloads of
    few chunks), and :func:`plan_weighted` for each stripe count above 1; the plan with the
    lowest :meth:`TreePlan.estimate_s`.

    More stripes are also capped by the chunk count (a stripe without chunks is wasted).
    """
    n_chunks = max(1, math.ceil(max(total_bytes, 1) / max(chunk_bytes, 1)))
    top = max(1, min(max_stripes, len(nodes), n_chunks))
    best: TreePlan | None = None
    best_t = math.inf
    for k in range(1, top + 1):
        fastest = plan_tree(source, source_up_bps, nodes, stripes=k, downs=downs,
                            max_fanout=max_fanout)
        candidates = [fastest]
        if k > 1:
            candidates.append(plan_weighted(source, source_up_bps, nodes, stripes=k,
                                            downs=downs, max_fanout=max_fanout))
        for f in _RATE_FRACTIONS:
            try:
                candidates.append(plan_tree(source, source_up_bps, nodes, stripes=k,
                                            rate_bps=fastest.stripes[0].rate_bps * f,
                                            downs=downs, max_fanout=max_fanout))
            except ValueError:  # a fan-out cap can make lower rates infeasible
                continue
        for plan in candidates:
            t = plan.estimate_s(total_bytes, chunk_bytes)
            if best is None or t < best_t * (1 - 1e-9):
                best, best_t = plan, t
    assert best is not None
    return best


def star_plan(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    downs: Mapping[str, float] | None = None,
) -> TreePlan:
    """The baseline: the source sends to every node itself."""
    _check(source, source_up_bps, nodes)
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    kids = tuple(_by_uplink(nodes))
    stripe = Stripe({source: kids} if kids else {}, source_up_bps / max(1, len(kids)))
    return TreePlan(source, (stripe,), ups, dict(downs or {}), kind="star")


def chain_plan(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    downs: Mapping[str, float] | None = None,
) -> TreePlan:
    """The other baseline: source -> fastest -> ... -> slowest (the last node's uplink idles)."""
    _check(source, source_up_bps, nodes)
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    order = [source, *_by_uplink(nodes)]
    kids = {order[i]: (order[i + 1],) for i in range(len(order) - 1)}
    rate = min([ups[p] for p in order[:-1]], default=source_up_bps)
    return TreePlan(source, (Stripe(kids, rate),), ups, dict(downs or {}), kind="chain")


# ------------------------------------------------------------------------------ wire forms


def plan_record(plan: TreePlan, job_id: str, version: int) -> b.BroadcastPlan:
    """The whole plan as a wire record (parent -> children edges per stripe)."""
    return b.BroadcastPlan(
        job_id=job_id,
        version=version,
        source=plan.source,
        stripes=[
            [b.PlanEdge(parent=p, children=list(cs)) for p, cs in s.children.items()]
            for s in plan.stripes
        ],
        weights=list(plan.weights),
    )


def route_for(
    plan: TreePlan,
    node: str,
    addrs: Mapping[str, Sequence[str]],
    job_id: str,
    version: int,
    *,
    max_sources: int = 32,
) -> b.Route:
    """``node``'s slice of ``plan``: its children per stripe, pull sources, the origin.

    Sources are the other nodes in an order that differs per node (a hash of both ids), so that
    pulls after a failure spread over the swarm instead of hitting the same few peers; the
    source of the plan is the origin, asked last.
    """

    def peer(p: str) -> b.PeerAddr:
        return b.PeerAddr(peer_id=p, addrs=list(addrs.get(p, ()))[: b.MAX_ADDRS])

    others = [n for n in plan.nodes if n != node]
    others.sort(key=lambda n: hashlib.sha256(f"{node}/{n}".encode()).digest())
    return b.Route(
        job_id=job_id,
        version=version,
        stripes=len(plan.stripes),
        children=[[peer(c) for c in kids] for kids in plan.children_of(node)],
        sources=[peer(n) for n in others[:max_sources]],
        origin=peer(plan.source) if node != plan.source else None,
        weights=list(plan.weights),
    )


def route_from_record(
    plan: b.BroadcastPlan,
    addrs: Mapping[str, Sequence[str]],
    node: str,
    *,
    max_sources: int = 32,
) -> b.Route | None:
    """``node``'s route in a plan received as a wire record (as :func:`route_for` cuts it from a
    :class:`TreePlan`); None when the plan does not reach ``node``."""
    children: list[list[str]] = []
    members: set[str] = set()
    for edges in plan.stripes:
        kids: list[str] = []
        for e in edges:
            members.update(e.children)
            if e.parent == node:
                kids.extend(e.children)
        children.append(kids)
    if node not in members and node != plan.source:
        return None

    def peer(p: str) -> b.PeerAddr:
        return b.PeerAddr(peer_id=p, addrs=list(addrs.get(p, ()))[: b.MAX_ADDRS])

    others = sorted(
        (n for n in members if n != node and n != plan.source),
        key=lambda n: hashlib.sha256(f"{node}/{n}".encode()).digest(),
    )
    return b.Route(
        job_id=plan.job_id,
        version=plan.version,
        stripes=len(plan.stripes),
        children=[[peer(c) for c in kids] for kids in children],
        sources=[peer(n) for n in others[:max_sources]],
        origin=peer(plan.source) if node != plan.source else None,
        weights=list(plan.weights),
    )


def route_from_announcement(ann: b.PlanAnnouncement, node: str) -> b.Route | None:
    """``node``'s route in an announced plan, with the addresses the announcement carries."""
    return route_from_record(ann.plan, {p.peer_id: list(p.addrs) for p in ann.peers}, node)


__all__ = [
    "DEFAULT_MAX_FANOUT",
    "Stripe",
    "TreePlan",
    "best_plan",
    "chain_plan",
    "lower_bound_s",
    "plan_record",
    "plan_tree",
    "plan_weighted",
    "route_for",
    "route_from_announcement",
    "route_from_record",
    "star_plan",
]
