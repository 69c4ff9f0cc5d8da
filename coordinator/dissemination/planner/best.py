"""Broadcast planning: the plan a version travels down, and each node's part of it. Pure: no I/O,
no clock.

A plan (:class:`~echo.coordinator.dissemination.planner.plan.TreePlan`) is one or more striped trees
from the source that reach every node once per stripe;
:mod:`echo.coordinator.dissemination.planner.plan` says what it is and estimates how long a version
takes down it. Two planners build one from measured upload bandwidth:
:func:`~echo.coordinator.dissemination.planner.equal.plan_tree` (one per-child rate for all stripes,
fast uploaders near the root, the nodes' uplinks split into one group per stripe) and
:func:`~echo.coordinator.dissemination.planner.weighted.plan_weighted` (a rate per stripe and chunk
shares to match).

This module is what the coordinator and the relays use:

- :func:`best_plan` tries several stripe counts, rate targets and both planners and keeps the
  plan with the lowest :meth:`~echo.coordinator.dissemination.planner.plan.TreePlan.estimate_s`;
  :func:`star_plan` and
  :func:`chain_plan` build the two baselines;
- :func:`route_for` cuts one node's :class:`~echo.protocol.broadcast.Route` out of a plan and
  :func:`plan_record` turns a plan into its wire record (a node cuts its route out of that record
  with :mod:`echo.p2p.relay.routes`).

Raises ``ValueError`` for bad arguments (negative bandwidths, a source among the nodes, a
stripe count below 1); nothing else.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from echo.coordinator.dissemination.planner.equal import (
    DEFAULT_MAX_FANOUT,
    by_uplink,
    check_inputs,
    plan_tree,
)
from echo.coordinator.dissemination.planner.plan import Stripe, TreePlan
from echo.coordinator.dissemination.planner.reach import Reach
from echo.coordinator.dissemination.planner.weighted import plan_weighted
from echo.protocol import broadcast as b

# best_plan tries 1..this many stripes: each one costs every node another parent connection.
DEFAULT_MAX_STRIPES = 16
# best_plan also tries these fractions of the highest rate target (wider, shallower trees).
_RATE_FRACTIONS = (0.75, 0.5)


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
    reach: Reach | None = None,
) -> TreePlan:
    """:func:`plan_tree` for 1..``max_stripes`` stripes, each at its highest rate target and a
    few lower ones (wider, shallower trees fill the pipeline sooner, which wins for payloads of
    few chunks), and :func:`plan_weighted` for each stripe count above 1; the plan with the
    lowest :meth:`TreePlan.estimate_s`.

    More stripes are also capped by the chunk count (a stripe without chunks is wasted).
    ``reach`` (optional): which nodes cannot be dialled
    (:mod:`echo.coordinator.dissemination.planner.reach`).
    """
    n_chunks = max(1, math.ceil(max(total_bytes, 1) / max(chunk_bytes, 1)))
    top = max(1, min(max_stripes, len(nodes), n_chunks))
    best: TreePlan | None = None
    best_t = math.inf
    for k in range(1, top + 1):
        opts = {"stripes": k, "downs": downs, "max_fanout": max_fanout, "reach": reach}
        fastest = plan_tree(source, source_up_bps, nodes, **opts)
        candidates = [fastest]
        if k > 1:
            candidates.append(plan_weighted(source, source_up_bps, nodes, **opts))
        for f in _RATE_FRACTIONS:
            try:
                rate = fastest.stripes[0].rate_bps * f
                candidates.append(plan_tree(source, source_up_bps, nodes, rate_bps=rate, **opts))
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
    check_inputs(source, source_up_bps, nodes)
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    kids = tuple(by_uplink(nodes))
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
    check_inputs(source, source_up_bps, nodes)
    ups = {source: float(source_up_bps), **{n: float(up) for n, up in nodes.items()}}
    order = [source, *by_uplink(nodes)]
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


__all__ = [
    "DEFAULT_MAX_FANOUT",
    "DEFAULT_MAX_STRIPES",
    "best_plan",
    "chain_plan",
    "plan_record",
    "route_for",
    "star_plan",
]
