"""Who can feed whom in a broadcast plan, when some nodes cannot be dialled. Pure: no I/O, no clock.

A parent pushes to a child over a connection one of them opens. A node behind NAT (or a firewall)
cannot be dialled, but it dials out: it reaches its parent over a connection it opens itself,
and it can push to any child that *can* be dialled. Two such nodes can only be parent and child
over a direct path that was set up for them (a punched or LAN connection). :class:`Reach` holds
that rule; :func:`place_reach` is the breadth-first placement of
:func:`echo.coordinator.dissemination.planner.equal.place` under it, and :func:`source_slots_reach`
the source's children that placement needs.

So a node behind NAT is a relay like any other -- for the dialable nodes and its path peers --
instead of a leaf: at N = 16 with half the nodes behind NAT (benchmarks/nat.py's uplinks), as
leaves the plan's estimate was 1.36x the all-public one; with their uplinks used, 1.11x (1.10x
with direct paths between four of them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reach:
    """``behind``: nodes nobody can dial; ``paths[n]``: the nodes of ``behind`` that ``n`` (also
    behind) holds a direct connection to, in both directions (``paths`` should list each pair
    both ways; an edge needs the parent's entry). The source is never behind: it feeds anyone."""

    behind: frozenset[str] = frozenset()
    paths: Mapping[str, Set[str]] = field(default_factory=dict)

    def feeds(self, parent: str, child: str) -> bool:
        """Whether ``parent`` can push to ``child``."""
        return (
            child not in self.behind
            or parent not in self.behind
            or child in self.paths.get(parent, ())
        )

    def constrains(self, nodes: Sequence[str]) -> bool:
        """Whether two of ``nodes`` could be refused as parent and child (two behind NAT)."""
        return sum(1 for n in nodes if n in self.behind) > 1


def place_reach(
    source: str,
    source_slots: int,
    caps: Mapping[str, float],
    order: Sequence[str],
    rate: float,
    max_fanout: int,
    reach: Reach,
) -> dict[str, list[str]] | None:
    """:func:`~echo.coordinator.dissemination.planner.equal.place` where every edge obeys ``reach``:
    a dialable node takes the earliest placed parent with a free slot, as there; one behind NAT
    takes the earliest path peer with a free slot, else the earliest dialable parent (the source
    feeds anyone). ``None`` when some node finds none.

    Two queues of open parents keep it linear: those that feed anyone (the source, dialable
    nodes) and those behind NAT (they feed dialable nodes, and their path peers, looked up
    through the peer's own paths).
    """
    children: dict[str, list[str]] = {source: []}
    slots = {source: source_slots}
    rank = {source: -1}  # placement order: earlier parents first, as in place()
    anyone: deque[str] = deque([source])
    natted: deque[str] = deque()
    behind, paths = reach.behind, reach.paths
    for i, node in enumerate(order):
        while anyone and slots[anyone[0]] == 0:
            anyone.popleft()
        while natted and slots[natted[0]] == 0:
            natted.popleft()
        parent = None
        if node not in behind:
            parent = anyone[0] if anyone else None
            if natted and (parent is None or rank[natted[0]] < rank[parent]):
                parent = natted[0]
        else:
            # A path peer first: its slots can feed few others, while a slot of the source or of
            # a dialable node is what the other nodes behind NAT need (taking the source's slot
            # here made the planner add a source child, and lower every stripe's rate, when a
            # third NAT'd node came). feeds() decides: a one-sided path entry makes no edge.
            for p in paths.get(node, ()):
                if (
                    slots.get(p, 0) > 0
                    and (parent is None or rank[p] < rank[parent])
                    and reach.feeds(p, node)
                ):
                    parent = p
            if parent is None and anyone:
                parent = anyone[0]
        if parent is None:
            return None
        children[parent].append(node)
        slots[parent] -= 1
        children[node] = []
        rank[node] = i
        slots[node] = min(max_fanout, int(caps.get(node, 0.0) / rate + 1e-9))
        if slots[node] > 0:
            (natted if node in reach.behind else anyone).append(node)
    return children


def source_slots_reach(
    source: str,
    caps: Mapping[str, float],
    order: Sequence[str],
    rate: float,
    max_fanout: int,
    reach: Reach,
    at_least: int,
) -> tuple[int, dict[str, list[str]]]:
    """The fewest source children, from ``at_least`` (the count without ``reach``), with which
    :func:`place_reach` places everyone, and that placement. More source slots never hurt a
    placement (the source feeds anyone, ahead of every other parent), so a doubling search then
    a binary one finds it in O(log n) placements; with a slot per node the source feeds all."""
    lo = max(1, at_least)
    placed = place_reach(source, lo, caps, order, rate, max_fanout, reach)
    if placed is not None:
        return lo, placed
    hi, step = lo, 1
    while True:
        hi = min(len(order), lo + step)
        found = place_reach(source, hi, caps, order, rate, max_fanout, reach)
        if found is not None or hi == len(order):
            break
        lo, step = hi, step * 2
    assert found is not None  # the source alone can feed every node
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = place_reach(source, mid, caps, order, rate, max_fanout, reach)
        if got is None:
            lo = mid
        else:
            hi, found = mid, got
    return hi, found
