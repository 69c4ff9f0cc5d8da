"""Patching a plan for nodes that joined or left since it was made: O(nodes), no search.

A full plan (:func:`echo.coordinator.dissemination.planner.best.best_plan`) searches stripe counts
and rate targets, which takes seconds for a thousand nodes. A version must not wait for that, so the
coordinator patches the last plan and re-plans in the background
(``echo.coordinator.dissemination.planning``). The patch:

- a node that left is cut out of every stripe: its children move up to its parent (which may
  then feed more children than its uplink was planned for, until the next full plan);
- a node whose uplink is now 0 (demoted) hands its children to its parent and stays a leaf;
- a node that joined becomes a leaf in every stripe, under the parent with the most spare slots
  at that stripe's rate (``floor(uplink / rate)`` minus the children it has), the source when no
  one has any;
- with ``reach`` (:mod:`echo.coordinator.dissemination.planner.reach`), a node whose parent can no
longer feed it (it
  was judged behind NAT since) moves, with its subtree, under its nearest ancestor that can (the
  source at worst), and a joining node only goes under a parent that can feed it;
- the uplinks (and downlinks) are the current ones, so :meth:`TreePlan.estimate_s` and the edge
  rates describe the patched plan as it is.

Pure: no I/O, no clock. Raises ``ValueError`` for a source among the nodes or a bad uplink
(:func:`~echo.coordinator.dissemination.planner.equal.check_inputs`); nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from echo.coordinator.dissemination.planner.equal import check_inputs
from echo.coordinator.dissemination.planner.plan import Stripe, TreePlan
from echo.coordinator.dissemination.planner.reach import Reach


def patch_plan(
    plan: TreePlan,
    source_up_bps: float,
    nodes: Mapping[str, float],
    *,
    downs: Mapping[str, float] | None = None,
    reach: Reach | None = None,
) -> TreePlan:
    """``plan`` reaching exactly ``nodes`` (id -> uplink B/s) from the same source; no edge
    that ``reach`` refuses (optional)."""
    check_inputs(plan.source, source_up_bps, nodes)
    old = set(plan.nodes)
    left = old - set(nodes)
    joined = [n for n in nodes if n not in old]
    stripes = []
    for stripe in plan.stripes:
        children = {p: list(cs) for p, cs in stripe.children.items()}
        parent = {c: p for p, cs in children.items() for c in cs}
        for gone in sorted(left):
            up = parent.pop(gone, plan.source)
            kids = children.pop(gone, [])
            if gone in children.get(up, ()):
                children[up].remove(gone)
            children.setdefault(up, []).extend(kids)
            for k in kids:
                parent[k] = up
        ups = {plan.source: source_up_bps, **nodes}
        # A node that can no longer upload (demoted) keeps its place but hands its children up.
        mutes = {n for n, up in nodes.items() if up <= 0}
        for mute in sorted(n for n in mutes if children.get(n)):
            up = parent.get(mute, plan.source)
            while up in mutes:  # the nearest ancestor that still uploads
                up = parent.get(up, plan.source)
            kids = children.pop(mute)
            children.setdefault(up, []).extend(kids)
            for k in kids:
                parent[k] = up
        if reach is not None:
            _repair(plan.source, children, parent, reach)
        for new in joined:
            best, best_spare = plan.source, None
            for p in (plan.source, *(n for n in nodes if n in parent)):
                if reach is not None and not reach.feeds(p, new):
                    continue
                spare = int(ups[p] / stripe.rate_bps + 1e-9) - len(children.get(p, ()))
                if best_spare is None or spare > best_spare:
                    best, best_spare = p, spare
            children.setdefault(best, []).append(new)
            parent[new] = best
        stripes.append(Stripe({p: tuple(cs) for p, cs in children.items() if cs}, stripe.rate_bps))
    ups = {plan.source: float(source_up_bps), **{n: float(u) for n, u in nodes.items()}}
    kind = plan.kind if plan.kind.endswith("+patched") else f"{plan.kind}+patched"
    return replace(plan, stripes=tuple(stripes), ups=ups, downs=dict(downs or {}), kind=kind)


def _repair(
    source: str, children: dict[str, list[str]], parent: dict[str, str], reach: Reach
) -> None:
    """Move every node whose parent cannot feed it under its nearest ancestor that can, in
    place; top down, so a moved subtree is checked from its new place on."""
    frontier = [source]
    while frontier:
        nxt = []
        for p in frontier:
            for c in list(children.get(p, ())):
                if not reach.feeds(p, c):
                    up = parent.get(p, source)
                    while up != source and not reach.feeds(up, c):
                        up = parent.get(up, source)
                    children[p].remove(c)
                    children.setdefault(up, []).append(c)
                    parent[c] = up
                nxt.append(c)
        frontier = nxt
