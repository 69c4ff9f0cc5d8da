"""What a broadcast plan is: striped trees from a source, and how long one takes. Pure: no I/O,
no clock.

A plan is one or more *stripes*; chunk ``i`` of a version travels down stripe ``i % stripes``,
or, when the plan has ``weights``, down the stripe :func:`echo.protocol.broadcast.stripe_table`
deals it to (stripes then carry shares of the chunks in proportion to their weights).
Each stripe is a tree rooted at the source that reaches every node exactly once, given as a
parent -> children map. Bandwidths are bytes per second.

:class:`TreePlan` holds the stripes and the bandwidths they were planned for, and estimates the
time a version takes down them (:meth:`TreePlan.estimate_s`); :func:`lower_bound_s` is the bound
from REFERENCES.md that no plan beats. The planners that build plans are
:mod:`echo.coordinator.dissemination.planner.best` and the modules it names.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from echo.protocol import broadcast as b


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
        up = self.ups.get(parent, 0.0)
        links = self._links.get(parent)
        if links:
            up = up / len(links) / max(1, links[child])
        down = self.downs.get(child, math.inf) / len(self.stripes)
        return min(up, down)

    def estimate_s(self, total_bytes: int, chunk_bytes: int) -> float:
        """Analytic time until every node holds all ``total_bytes``.

        Per node and stripe, a pipeline along its path: the first chunk pays one chunk time per
        hop, the remaining chunks of the stripe pass at the path's slowest edge. The answer is the
        worst node's slowest stripe. Assumes every edge is busy for the whole transfer, so it is
        slightly pessimistic once stripes finish at different times.
        """
        return max(self.finish_times(total_bytes, chunk_bytes), default=0.0)

    def finish_times(self, total_bytes: int, chunk_bytes: int) -> list[float]:
        """Every node's estimated finish time in every stripe (see :meth:`estimate_s`, their
        maximum); ``[inf]`` when an edge has no rate, ``[]`` for nothing to send."""
        if total_bytes <= 0 or not self.nodes:
            return []
        chunk = max(1, min(chunk_bytes, total_bytes))
        n_chunks = math.ceil(total_bytes / chunk)
        sizes = Counter(b.stripe_table(n_chunks, len(self.stripes), self.weights))
        out: list[float] = []
        for s, stripe in enumerate(self.stripes):
            n_s = sizes[s]
            if n_s == 0:
                continue
            # Down the tree from the source: each node's summed chunk times along its path and
            # its path's slowest edge, from its parent's (one pass, not one walk per node).
            hops: dict[str, float] = {self.source: 0.0}
            slowest: dict[str, float] = {self.source: math.inf}
            frontier = [self.source]
            while frontier:
                nxt = []
                for p in frontier:
                    for c in stripe.children.get(p, ()):
                        r = self.edge_rate(p, c)
                        if r <= 0:
                            return [math.inf]
                        hops[c] = hops[p] + chunk / r
                        slowest[c] = min(slowest[p], r)
                        nxt.append(c)
                frontier = nxt
            out.extend(hops[node] + (n_s - 1) * chunk / slowest[node] for node in self.nodes)
        return out

    def stripe_rate(self, stripe: int) -> float:
        """The slowest edge of ``stripe``: the rate its chunks pipeline through the tree at."""
        return min(
            (self.edge_rate(p, c) for p, cs in self.stripes[stripe].children.items() for c in cs),
            default=0.0,
        )

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
