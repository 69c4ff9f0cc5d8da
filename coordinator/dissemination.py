"""How each new version reaches the nodes: the coordinator's side of the relay broadcast.

:class:`Dissemination` remembers what a plan needs to know about each node -- the addresses it
listens on (from its registration), its uplink (the push rate it measured as a relay, else what
it declared, else :attr:`BroadcastSection.default_node_upload_bps`), and whether a peer reported
it for a bad chunk -- and, when the learner reports a version, plans relay trees from the learner
over the nodes active now (:func:`echo.p2p.tree.best_plan`: fast uploaders near the root, striped
where that uses more uplinks) and returns the :class:`~echo.protocol.broadcast.PlanAnnouncement`
the coordinator signs, returns to the learner and gossips to the nodes.

Trust: nodes verify every chunk against the learner-signed manifest, so a plan can slow a version
down but never change it. A report of a bad chunk cannot be proven to the coordinator, so it does
not expel the relay from the swarm: the reported peer is planned as a leaf from then on (it
receives, it no longer forwards). A lying reporter can demote honest peers, not exclude them.

Nothing here does I/O; it raises nothing for well-formed input.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from echo.p2p import tree
from echo.protocol import broadcast as b
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger("echo.coordinator.dissemination")

# Measured push rates are noisy (a chunk may wait for the upstream): smooth them.
UPLOAD_EWMA = 0.3


@dataclass
class NodeLink:
    """What a plan knows of one node's link: addresses, declared and measured uplink, demotion."""

    addrs: list[str] = field(default_factory=list)
    declared_bps: float = 0.0
    measured_bps: float = 0.0
    demoted: bool = False


class Dissemination:
    """Plans one version's broadcast at a time; see the module docstring."""

    def __init__(
        self,
        *,
        learner_upload_bps: float,
        default_node_upload_bps: float,
        max_fanout: int = tree.DEFAULT_MAX_FANOUT,
        max_stripes: int = tree.DEFAULT_MAX_STRIPES,
    ) -> None:
        self.learner_upload_bps = learner_upload_bps
        self.default_node_upload_bps = default_node_upload_bps
        self.max_fanout = max_fanout
        self.max_stripes = max_stripes
        self.links: dict[str, NodeLink] = {}

    def registered(self, node_id: str, addrs: Sequence[str], declared_bps: float) -> None:
        """A node (re)registered: where it listens and the uplink it declared."""
        link = self.links.setdefault(node_id, NodeLink())
        link.addrs = [a for a in addrs if a][: b.MAX_ADDRS]
        link.declared_bps = declared_bps

    def measured(self, node_id: str, upload_bps: float) -> None:
        """A node's measured push rate (0: none yet), smoothed; unknown nodes are ignored."""
        link = self.links.get(node_id)
        if link is None or upload_bps <= 0:
            return
        if link.measured_bps <= 0:
            link.measured_bps = upload_bps
        else:
            link.measured_bps += UPLOAD_EWMA * (upload_bps - link.measured_bps)

    def reported(self, reporter: str, report: b.BadPeerReport) -> None:
        """A node's report about a relay; a bad chunk demotes the relay to a leaf for good."""
        link = self.links.get(report.peer_id)
        if report.reason == "bad_chunk" and link is not None and not link.demoted:
            link.demoted = True
            log.warning(
                "relay %s reported by %s for a bad chunk of v%d: planned as a leaf from now on",
                report.peer_id[-8:], reporter[-8:], report.version,
            )

    def upload_of(self, node_id: str) -> float:
        """The uplink a plan gives the node (0 when demoted); KeyError if it never registered."""
        link = self.links[node_id]
        if link.demoted:
            return 0.0
        return link.measured_bps or link.declared_bps or self.default_node_upload_bps

    def plan(
        self,
        job_id: str,
        version: int,
        manifest: bytes,
        total_bytes: int,
        *,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        source: str,
        source_addrs: Sequence[str],
        nodes: Sequence[str],
    ) -> b.PlanAnnouncement | None:
        """The plan of ``version`` over those of ``nodes`` whose addresses are known (None when
        none are: nodes then pull from the learner)."""
        members = sorted({n for n in nodes if n != source and self.links.get(n, NodeLink()).addrs})
        if not members:
            return None
        ups = {n: self.upload_of(n) for n in members}
        if not any(ups.values()):  # everyone demoted: the learner sends to each (a star)
            chosen = tree.star_plan(source, self.learner_upload_bps, ups)
        else:
            chosen = tree.best_plan(
                source,
                self.learner_upload_bps,
                ups,
                total_bytes=total_bytes,
                chunk_bytes=chunk_bytes,
                max_stripes=self.max_stripes,
                max_fanout=self.max_fanout,
            )
        peers = [b.PeerAddr(peer_id=source, addrs=list(source_addrs)[: b.MAX_ADDRS])]
        peers += [b.PeerAddr(peer_id=n, addrs=self.links[n].addrs) for n in members]
        return b.PlanAnnouncement(
            job_id=job_id,
            version=version,
            manifest=manifest,
            plan=tree.plan_record(chosen, job_id, version),
            peers=peers,
        )


__all__ = ["Dissemination", "NodeLink"]
