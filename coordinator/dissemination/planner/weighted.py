"""The weighted planner, :func:`plan_weighted`: a rate target of its own for every stripe, and a
share of the chunks to match. Pure: no I/O, no clock.

One rate for all stripes (:func:`echo.coordinator.dissemination.planner.equal.plan_tree`) leaves a
fast group's uplinks partly idle whenever a slower group sets the common rate; here each stripe is
raised as far as its group and the source's uplink allow, and carries chunks in proportion to the
rate its tree then sustains (``TreePlan.weights``, see
:func:`echo.protocol.broadcast.stripe_table`).

Raises ``ValueError`` for bad arguments, as
:func:`~echo.coordinator.dissemination.planner.equal.plan_tree`; nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from echo.coordinator.dissemination.planner.equal import (
    DEFAULT_MAX_FANOUT,
    place,
    plan_tree,
    slots_needed,
    source_slots_needed,
    stripe_orders,
    uplinks_in_order,
)
from echo.coordinator.dissemination.planner.plan import Stripe, TreePlan
from echo.coordinator.dissemination.planner.reach import Reach

# plan_weighted: rounds of raising each stripe's rate in turn (a third rarely adds 1%), each a
# binary search to 2**-14 of the range (far below what bandwidth measurements resolve).
_WEIGHTED_ROUNDS = 2
_WEIGHTED_SEARCH_STEPS = 14
# Stripe weights are integers relative to the fastest stripe's 1000: finer than any estimate.
_WEIGHT_SCALE = 1000


def plan_weighted(
    source: str,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    stripes: int,
    downs: Mapping[str, float] | None = None,
    max_fanout: int = DEFAULT_MAX_FANOUT,
    reach: Reach | None = None,
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
    base = plan_tree(
        source,
        source_up_bps,
        nodes,
        stripes=stripes,
        downs=downs,
        max_fanout=max_fanout,
        reach=reach,
    )
    k = len(base.stripes)
    if k == 1:
        return base
    orders, caps = stripe_orders(nodes, k)
    best: TreePlan | None = None
    best_rate = 0.0
    # Raising one stripe takes source budget from the next, so the order matters: try both ways
    # and keep the plan that delivers more in all (sum of the stripes' sustained rates).
    for order in (range(k), range(k - 1, -1, -1)):
        built = _raise_stripes(
            source,
            source_up_bps,
            orders,
            caps,
            base.stripes[0].rate_bps,
            list(order),
            max_fanout,
            reach,
        )
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
    reach: Reach | None = None,
) -> tuple[Stripe, ...]:
    """From a common ``rate``, raise each stripe's rate in turn (``order``) as far as its group
    and the source's remaining uplink allow; spare source slots then go round-robin."""
    k = len(orders)
    ups = [uplinks_in_order(c, o) for o, c in zip(orders, caps, strict=True)]

    def slots(s: int, r: float, need: int | None = None) -> int:
        if need is None:
            need = source_slots_needed(ups[s], r, max_fanout) if len(orders[s]) else 0
        return slots_needed(source, orders[s], caps[s], need, r, max_fanout, reach)

    def fits(s: int, r: float, others: float) -> bool:
        # The count without reach first: it is cheap, and reach only ever adds children.
        budget = source_up_bps * (1 + 1e-9) - others
        need = source_slots_needed(ups[s], r, max_fanout) if len(orders[s]) else 0
        return need * r <= budget and slots(s, r, need) * r <= budget

    rates = [rate] * k
    used = [slots(s, rate) for s in range(k)]
    top = max((max(c.values(), default=0.0) for c in caps), default=0.0) + source_up_bps
    for _ in range(_WEIGHTED_ROUNDS):
        for s in order:
            others = sum(used[j] * rates[j] for j in range(k) if j != s)
            lo, hi = rates[s], top
            for _ in range(_WEIGHTED_SEARCH_STEPS):
                mid = (lo + hi) / 2
                if fits(s, mid, others):
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
        placed = place(source, used[s], caps[s], orders[s], rates[s], max_fanout, reach)
        assert placed is not None  # more source slots than the minimum always place
        built.append(Stripe({p: tuple(cs) for p, cs in placed.items() if cs}, rates[s]))
    return tuple(built)
