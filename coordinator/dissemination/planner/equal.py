"""The equal-rate planner, :func:`plan_tree`, and the breadth-first placement every planner builds
on. Pure: no I/O, no clock.

:func:`plan_tree` builds a plan from measured upload bandwidth:

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

The placement helpers (:func:`place`, :func:`slots_needed`, :func:`stripe_orders`,
:func:`by_uplink`, :func:`check_inputs`) are shared with
:mod:`echo.coordinator.dissemination.planner.weighted` and the baselines in
:mod:`echo.coordinator.dissemination.planner.best`.

Raises ``ValueError`` for bad arguments (negative bandwidths, a source among the nodes, a
stripe count below 1); nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from echo.coordinator.dissemination.planner.plan import Stripe, TreePlan
from echo.coordinator.dissemination.planner.reach import Reach, place_reach, source_slots_reach

# More children than this per parent costs connections and per-stream CPU for little gain.
DEFAULT_MAX_FANOUT = 32
# From this many nodes on, source_slots_needed counts with numpy; below, its per-call overhead
# costs more than a plain loop (measured: 16 nodes, 2x slower with numpy).
_VECTOR_FROM = 256
# Binary search on the per-child rate: relative precision 2**-40 is far below any measurement.
_SEARCH_STEPS = 30


def check_inputs(source: str, source_up: float, nodes: Mapping[str, float]) -> None:
    """Refuse what no planner can plan for.

    :raises ValueError: the source is among ``nodes``, its uplink is not positive and finite, or
        a node's uplink is negative or not finite.
    """
    if source in nodes:
        raise ValueError(f"the source {source!r} is also listed as a node")
    if source_up <= 0 or not math.isfinite(source_up):
        raise ValueError("the source needs a positive, finite uplink")
    for n, up in nodes.items():
        if up < 0 or not math.isfinite(up):
            raise ValueError(f"node {n!r} has a bad uplink {up!r}")


def by_uplink(nodes: Mapping[str, float]) -> list[str]:
    """Fastest first; ties broken by name so plans are deterministic."""
    return sorted(nodes, key=lambda n: (-nodes[n], n))


def place(
    source: str,
    source_slots: int,
    caps: Mapping[str, float],
    order: Sequence[str],
    rate: float,
    max_fanout: int,
    reach: Reach | None = None,
) -> dict[str, list[str]] | None:
    """Breadth-first placement of ``order``: the source offers ``source_slots`` slots, every
    placed node ``floor(cap / rate)`` (at most ``max_fanout``).

    Parents offer their slots in the order they were placed (source first), so the earliest
    (fastest) nodes end up nearest the root. ``None`` when some node finds no free slot. With
    ``reach``, only parents that can feed a node offer it a slot
    (:func:`~echo.coordinator.dissemination.planner.reach.place_reach`).
    """
    if reach is not None and reach.constrains(order):
        return place_reach(source, source_slots, caps, order, rate, max_fanout, reach)
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


def uplinks_in_order(caps: Mapping[str, float], order: Sequence[str]) -> list[float] | np.ndarray:
    """The uplinks of ``order``'s nodes, in order (0 for nodes without one): what
    :func:`source_slots_needed` reads, built once per planning pass instead of once per rate.
    An array from :data:`_VECTOR_FROM` nodes on, a list below."""
    ups = [caps.get(n, 0.0) for n in order]
    return np.asarray(ups, dtype=np.float64) if len(ups) >= _VECTOR_FROM else ups


def source_slots_needed(uplinks: list[float] | np.ndarray, rate: float, max_fanout: int) -> int:
    """The fewest source children with which :func:`place` finds every node a parent at ``rate``
    (``uplinks`` from :func:`uplinks_in_order`), without placing anyone.

    Breadth-first placement never leaves a slot unused while a node waits, so node ``j`` (0-based)
    finds a parent exactly when the source's ``s`` slots plus those of the ``j`` nodes before it
    cover ``j + 1`` nodes: ``s >= j + 1 - P_j`` with ``P_j`` their slots. The answer is the
    largest such bound (at least 1).
    """
    if isinstance(uplinks, np.ndarray):
        slots = np.minimum(max_fanout, np.floor(uplinks / rate + 1e-9))
        before = np.cumsum(slots) - slots  # P_j: slots offered by the nodes before node j
        return max(1, int((np.arange(1, len(uplinks) + 1) - before).max()))
    need, offered = 1, 0
    for j, up in enumerate(uplinks):
        need = max(need, j + 1 - offered)
        offered += min(max_fanout, int(up / rate + 1e-9))
    return need


def slots_needed(
    source: str,
    order: Sequence[str],
    caps: Mapping[str, float],
    need: int,
    rate: float,
    max_fanout: int,
    reach: Reach | None,
) -> int:
    """The fewest source children one stripe needs at ``rate``, given ``need``, the count
    without ``reach`` (:func:`source_slots_needed`, which callers check against the source's
    budget first: it is cheap, and reach only ever adds children): ``need`` itself, or with
    ``reach`` constraining the order,
    :func:`~echo.coordinator.dissemination.planner.reach.source_slots_reach`."""
    if not len(order) or reach is None or not reach.constrains(order):
        return need
    return source_slots_reach(source, caps, order, rate, max_fanout, reach, need)[0]


def _source_slots(
    source_up: float,
    orders: Sequence[Sequence[str]],
    uplinks: Sequence[np.ndarray],
    rate: float,
    max_fanout: int,
    source: str = "",
    caps: Sequence[Mapping[str, float]] = (),
    reach: Reach | None = None,
) -> list[int] | None:
    """Per stripe, the source's children at per-child ``rate``, summed over stripes within its
    uplink; ``None`` if the source cannot feed them all at that rate. ``uplinks``: per stripe,
    :func:`uplinks_in_order` of its order; ``caps`` and ``reach`` (optional) as in
    :func:`slots_needed`.

    Each stripe first takes the fewest source children it needs; source slots left over are
    then handed out round-robin (shallower trees, and the source's uplink is not left idle).
    """
    budget = int(source_up / rate + 1e-9)
    slots = [
        source_slots_needed(ups, rate, max_fanout) if len(order) else 0
        for order, ups in zip(orders, uplinks, strict=True)
    ]
    if reach is not None and sum(slots) <= budget:  # reach only ever adds source children
        slots = [
            slots_needed(source, order, caps[s], need, rate, max_fanout, reach)
            for s, (order, need) in enumerate(zip(orders, slots, strict=True))
        ]
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
    return slots


def _build(
    source: str,
    orders: Sequence[Sequence[str]],
    caps: Sequence[Mapping[str, float]],
    slots: Sequence[int],
    rate: float,
    max_fanout: int,
    reach: Reach | None = None,
) -> list[dict[str, list[str]]]:
    """The stripes placed with the source slots :func:`_source_slots` chose."""
    built = []
    for order, stripe_caps, n in zip(orders, caps, slots, strict=True):
        placed = place(source, n, stripe_caps, order, rate, max_fanout, reach) if order else None
        built.append(placed if placed is not None else {source: []})
    return built


def _groups(nodes: Mapping[str, float], k: int) -> list[list[str]]:
    """``k`` groups of about equal total uplink (longest-processing-time greedy)."""
    groups: list[list[str]] = [[] for _ in range(k)]
    load = [0.0] * k
    for n in by_uplink(nodes):
        g = min(range(k), key=lambda i: (load[i], len(groups[i]), i))
        groups[g].append(n)
        load[g] += nodes[n]
    return groups


def stripe_orders(
    nodes: Mapping[str, float], k: int
) -> tuple[list[list[str]], list[dict[str, float]]]:
    """Per stripe: the placement order and the uplinks that count in it."""
    fast_first = by_uplink(nodes)
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
    reach: Reach | None = None,
) -> TreePlan:
    """Plan ``stripes`` trees from ``source`` to every node in ``nodes`` (id -> uplink B/s).

    ``rate_bps`` fixes the per-child rate target (default: the highest that reaches everyone);
    ``downs`` (id -> downlink B/s, optional) only feeds :meth:`TreePlan.estimate_s`; ``reach``
    (optional) says which nodes cannot be dialled: no edge of the plan needs such a dial.
    """
    check_inputs(source, source_up_bps, nodes)
    if stripes < 1:
        raise ValueError("stripes must be at least 1")
    if max_fanout < 1:
        raise ValueError("max_fanout must be at least 1")
    k = max(1, min(stripes, len(nodes)))
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    orders, caps = stripe_orders(nodes, k)
    ups_in_order = [uplinks_in_order(c, o) for o, c in zip(orders, caps, strict=True)]
    if rate_bps is not None:
        slots = _source_slots(
            source_up_bps, orders, ups_in_order, rate_bps, max_fanout, source, caps, reach
        )
        if slots is None:
            raise ValueError(f"no plan reaches all {len(nodes)} nodes at {rate_bps:.0f} B/s")
        rate, fanout = rate_bps, max_fanout
    else:
        # At source_up / (k * N) the source alone can feed every node in every stripe. The search
        # only counts source slots; the trees are placed once, at the rate it settles on.
        rate, fanout = source_up_bps / (k * max(1, len(nodes))), len(nodes) + 1
        slots = _source_slots(
            source_up_bps, orders, ups_in_order, rate, fanout, source, caps, reach
        )
        assert slots is not None
        lo, hi = rate, max(ups.values())
        for _ in range(_SEARCH_STEPS):
            mid = (lo + hi) / 2
            got = _source_slots(
                source_up_bps, orders, ups_in_order, mid, max_fanout, source, caps, reach
            )
            if got is None:
                hi = mid
            else:
                lo, rate, slots, fanout = mid, mid, got, max_fanout
    built = _build(source, orders, caps, slots, rate, fanout, reach)
    stripes_ = tuple(
        Stripe({p: tuple(cs) for p, cs in placed.items() if cs}, rate) for placed in built
    )
    return TreePlan(source, stripes_, ups, dict(downs or {}), kind=f"tree/{k}")
