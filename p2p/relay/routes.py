"""A node's part of a received broadcast plan: its route and its parents, read from the plan's
wire record (the coordinator builds plans with :mod:`echo.coordinator.dissemination.planner`).

Pure; returns None for a plan that does not reach the node and raises nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from echo.protocol import broadcast as b


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


def parents_in(plan: b.BroadcastPlan, node: str) -> list[str]:
    """The peers that push to ``node`` in ``plan`` (one per stripe at most, deduplicated)."""
    out: list[str] = []
    for edges in plan.stripes:
        for e in edges:
            if node in e.children and e.parent not in out:
                out.append(e.parent)
    return out


def route_from_announcement(ann: b.PlanAnnouncement, node: str) -> b.Route | None:
    """``node``'s route in an announced plan, with the addresses the announcement carries."""
    return route_from_record(ann.plan, {p.peer_id: list(p.addrs) for p in ann.peers}, node)


__all__ = ["parents_in", "route_from_announcement", "route_from_record"]
