"""How each new version reaches the nodes: the coordinator's side of the relay broadcast.

:class:`Dissemination` remembers what a plan needs to know about each node -- the addresses it
listens on (from its registration), its uplink (the push rate it measured as a relay, else what
it declared, else :attr:`BroadcastSection.default_node_upload_bps`), and whether a peer reported
it for a bad chunk -- and, when the learner reports a version, plans relay trees from the learner
over the nodes active now (:func:`echo.p2p.tree.best_plan`: fast uploaders near the root, striped
where that uses more uplinks) and returns the :class:`~echo.protocol.broadcast.PlanAnnouncement`
the coordinator signs, returns to the learner and gossips to the nodes.

Planning never holds up a version: :meth:`Dissemination.plan` patches the job's last plan for
the nodes that joined or left since (:func:`echo.p2p.tree_patch.patch_plan`, linear in the nodes)
and leaves the full search (:func:`echo.p2p.tree.best_plan`, seconds at a thousand nodes) to
:meth:`Dissemination.refresh_forever`, a background task that re-plans in a worker thread for the
next version. A job's first plan is a single equal-rate tree, also linear.

Trust: nodes verify every chunk against the learner-signed manifest, so a plan can slow a version
down but never change it. So that no single identity can steer a plan:

- a declared uplink counts only up to the fastest uplink measured in the swarm (the default
  before any measurement): claiming a fast link does not buy a place near the root;
- a report of a bad chunk cannot be proven to the coordinator, so it never expels the relay;
  reports from :data:`DEMOTE_REPORTERS` different nodes plan it as a leaf from then on (it
  receives, it no longer forwards). Lying reporters can demote honest peers, not exclude them.

Reachability: a node the coordinator's dial-back could not reach (:meth:`set_reachable`, from
:mod:`echo.coordinator.reachability`) is announced without addresses; it dials its parents itself
when it joins the plan and they push over that connection
(:meth:`echo.p2p.relay.peers.Peers.reach_out`). It still relays, to the peers it can reach: it
dials a dialable child itself, and two such nodes can hold a direct connection after a
coordinated punch (:mod:`echo.coordinator.punching` asks for the pairs :meth:`punch_pairs` names
and books the outcome with :meth:`set_punched`). The planners place every edge accordingly
(:class:`~echo.p2p.tree_reach.Reach`): no edge needs a dial that a verdict says cannot happen
(a node not yet probed counts as dialable until its verdict).

Nothing here does I/O except :meth:`Dissemination.refresh_forever` (a trio task that only
sleeps and runs the planner in a thread); it raises nothing for well-formed input.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field

import trio

from echo.coordinator.dissemination_nat import NatInfo, PunchPair, pair_key, punch_pairs
from echo.p2p import tree
from echo.p2p.tree_equal import plan_tree
from echo.p2p.tree_patch import patch_plan
from echo.p2p.tree_plan import TreePlan
from echo.p2p.tree_reach import Reach
from echo.protocol import broadcast as b
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger("echo.coordinator.dissemination")

# Measured push rates are noisy (a chunk may wait for the upstream): smooth them.
UPLOAD_EWMA = 0.3
# Distinct reporters of bad chunks before a relay is planned as a leaf: one liar cannot demote.
DEMOTE_REPORTERS = 3
# How often the background task looks for a job whose plan is due for a full re-plan.
REFRESH_POLL_S = 0.5
# A patched plan is re-planned in full when a member's uplink moved by more than this fraction.
UPLINK_DRIFT = 0.25


@dataclass
class NodeLink:
    """What a plan knows of one node's link: addresses, declared and measured uplink, demotion."""

    addrs: list[str] = field(default_factory=list)
    declared_bps: float = 0.0
    measured_bps: float = 0.0
    demoted: bool = False
    reporters: set[str] = field(default_factory=set)  # who reported it for a bad chunk
    # Whether a dial-back reached it (None: not probed yet, planned as before -- dialable).
    reachable: bool | None = None
    # The dial-back's verdict and the ip it saw the node on (its router's, when "nat").
    verdict: str = ""
    observed_ip: str = ""


@dataclass
class _Inputs:
    """What a full plan of one job is computed from (kept for the background re-plan)."""

    source: str
    ups: dict[str, float]
    total_bytes: int
    chunk_bytes: int
    reach: Reach


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
        # Per job: the plan versions are patched from, and the inputs of a due full re-plan.
        # plan() and refresh() run in worker threads: the lock guards these two maps.
        self._plans: dict[str, TreePlan] = {}
        self._due: dict[str, _Inputs] = {}
        self._reaches: dict[str, Reach] = {}  # what each job's last plan was made under
        self._lock = threading.Lock()
        # Per pair of nodes behind NAT that were asked to connect: whether both ends reported
        # a direct connection. Dropped when either node's addresses or public ip change.
        self.punched: dict[frozenset[str], bool] = {}

    def registered(self, node_id: str, addrs: Sequence[str], declared_bps: float) -> None:
        """A node (re)registered: where it listens and the uplink it declared."""
        link = self.links.setdefault(node_id, NodeLink())
        fresh = [a for a in addrs if a][: b.MAX_ADDRS]
        if fresh != link.addrs:  # new addresses: the last dial-back says nothing about them
            link.reachable = None
            self._forget_paths(node_id)
        link.addrs = fresh
        link.declared_bps = declared_bps

    def set_reachable(
        self, node_id: str, reachable: bool, *, verdict: str = "", observed_ip: str = ""
    ) -> None:
        """A dial-back's verdict on the node's addresses (unknown nodes are ignored). One that
        cannot be dialled is announced without addresses (nobody wastes a dial on them): its
        parents push over the connection it opens to them, and it relays only to peers it can
        reach (:meth:`_reach`). ``verdict`` "nat" with the ``observed_ip`` it was seen from
        makes it a candidate for punches."""
        link = self.links.get(node_id)
        if link is not None:
            if observed_ip != link.observed_ip or reachable:
                self._forget_paths(node_id)
            link.reachable = reachable
            link.verdict = verdict
            link.observed_ip = observed_ip

    def _forget_paths(self, node_id: str) -> None:
        self.punched = {k: v for k, v in self.punched.items() if node_id not in k}

    def punch_pairs(
        self,
        busy: Mapping[str, int] | None = None,
        in_flight: Set[frozenset[str]] = frozenset(),
    ) -> list[PunchPair]:
        """Pairs of nodes behind NAT to ask for a direct connection now (see
        :func:`~echo.coordinator.dissemination_nat.punch_pairs`)."""
        return punch_pairs(self._nat(), self.punched, busy, in_flight)

    def set_punched(self, pair: PunchPair, ok: bool) -> None:
        """Both ends of ``pair`` answered (``ok``: both have the connection). Ignored when
        either node's addresses or public ip changed meanwhile (:meth:`punch_pairs` asks
        again)."""
        nat = self._nat()
        if nat.get(pair.a) == pair.info_a and nat.get(pair.b) == pair.info_b:
            # Copied, not updated in place: plan() may read it from a worker thread.
            self.punched = {**self.punched, pair_key(pair.a, pair.b): ok}

    def paths_of(self, node_id: str) -> set[str]:
        """The nodes behind NAT that ``node_id`` has a confirmed direct connection to."""
        punched = self.punched  # one snapshot: the trio thread replaces it, never mutates it
        return {n for k, ok in punched.items() if ok and node_id in k for n in k} - {node_id}

    def _nat(self) -> dict[str, NatInfo]:
        """The nodes a dial-back judged "nat" (seen from a public ip, not dialable there)."""
        return {
            n: NatInfo(k.observed_ip, tuple(k.addrs))
            for n, k in self.links.items()
            if k.reachable is False and k.verdict == "nat" and k.observed_ip and not k.demoted
        }

    def unprobed(self) -> list[tuple[str, list[str]]]:
        """(node, addresses) of the nodes no dial-back has judged since their addresses."""
        return [(n, list(k.addrs)) for n, k in self.links.items() if k.reachable is None]

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
        """A node's report about a relay: bad-chunk reports from :data:`DEMOTE_REPORTERS`
        different nodes demote the relay to a leaf for good."""
        link = self.links.get(report.peer_id)
        if report.reason != "bad_chunk" or link is None or link.demoted:
            return
        link.reporters.add(reporter)
        if len(link.reporters) >= DEMOTE_REPORTERS:
            link.demoted = True
            log.warning(
                "relay %s reported by %d nodes for bad chunks (last: v%d): planned as a leaf "
                "from now on",
                report.peer_id[-8:],
                len(link.reporters),
                report.version,
            )

    def upload_of(self, node_id: str) -> float:
        """The uplink a plan gives the node (0 when demoted): measured, else declared up to the
        fastest uplink measured in the swarm; KeyError if it never registered."""
        return self._upload(node_id, self._ceiling())

    def _ceiling(self) -> float:
        """The most a declared uplink counts for: the fastest measured one (or the default)."""
        return max([self.default_node_upload_bps, *(n.measured_bps for n in self.links.values())])

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
        leaves: Collection[str] = (),
    ) -> b.PlanAnnouncement | None:
        """The plan of ``version`` over those of ``nodes`` whose addresses are known (None when
        none are: nodes then pull from the learner). ``leaves`` receive and relay to nobody
        (the coordinator passes nodes without an accepted group: identities are free, and one
        planned as a relay that never relays stalls its subtree)."""
        members = sorted({n for n in nodes if n != source and self.links.get(n, NodeLink()).addrs})
        if not members:
            return None
        ceiling = self._ceiling()
        leaf_only = set(leaves)
        ups = {n: 0.0 if n in leaf_only else self._upload(n, ceiling) for n in members}
        reach = self._reach(members)
        inputs = _Inputs(source, ups, total_bytes, chunk_bytes, reach)
        with self._lock:
            last = self._plans.get(job_id)
            last_reach = self._reaches.get(job_id)
        if not any(ups.values()):  # everyone demoted: the learner sends to each (a star)
            chosen = tree.star_plan(source, self.learner_upload_bps, ups)
        elif last is None or last.source != source:
            chosen = plan_tree(
                source, self.learner_upload_bps, ups, max_fanout=self.max_fanout, reach=reach
            )
        else:
            chosen = patch_plan(last, self.learner_upload_bps, ups, reach=reach)
        with self._lock:
            self._plans[job_id] = chosen
            self._reaches[job_id] = reach
            if last is None or _changed(last, chosen) or reach != last_reach:
                self._due[job_id] = inputs
        relays = {n for n in reach.behind for st in chosen.stripes if st.children.get(n)}
        if relays:
            log.info(
                "v%d plan: %d node(s) behind NAT relay to peers they reach", version, len(relays)
            )
        peers = [b.PeerAddr(peer_id=source, addrs=list(source_addrs)[: b.MAX_ADDRS])]
        peers += [b.PeerAddr(peer_id=n, addrs=self._dialable(n)) for n in members]
        return b.PlanAnnouncement(
            job_id=job_id,
            version=version,
            manifest=manifest,
            plan=tree.plan_record(chosen, job_id, version),
            peers=peers,
        )

    def _upload(self, node_id: str, ceiling: float) -> float:
        """:meth:`upload_of` with the swarm's ceiling (:meth:`_ceiling`) computed once. A node
        that cannot be dialled keeps its uplink: it relays to the peers it can reach
        (:meth:`_reach`)."""
        link = self.links[node_id]
        if link.demoted:  # a leaf: it relays to nobody
            return 0.0
        return self._relay_upload(node_id, ceiling)

    def _reach(self, members: Sequence[str]) -> Reach:
        """Which of ``members`` no dial-back reached, and their direct paths to each other."""
        behind = frozenset(n for n in members if self.links[n].reachable is False)
        punched = self.punched  # one snapshot: the trio thread replaces it, never mutates it
        paths: dict[str, set[str]] = {}
        for pair, ok in punched.items():
            if ok and pair <= behind and len(pair) == 2:
                a, b_ = sorted(pair)
                paths.setdefault(a, set()).add(b_)
                paths.setdefault(b_, set()).add(a)
        return Reach(behind, {n: frozenset(ps) for n, ps in paths.items()})

    def _relay_upload(self, node_id: str, ceiling: float) -> float:
        """The node's uplink as a relay, whether or not others can dial it."""
        link = self.links[node_id]
        return link.measured_bps or min(link.declared_bps or self.default_node_upload_bps, ceiling)

    def _dialable(self, node_id: str) -> list[str]:
        link = self.links[node_id]
        return [] if link.reachable is False else link.addrs

    def refresh(self, job_id: str) -> bool:
        """The full plan of ``job_id`` from the inputs of its last patched plan, kept for the
        next version to patch from; False when none was due. Pure CPU (seconds at a thousand
        nodes): :meth:`refresh_forever` runs it in a worker thread."""
        with self._lock:
            inputs = self._due.pop(job_id, None)
        if inputs is None:
            return False
        if not any(inputs.ups.values()):
            full = tree.star_plan(inputs.source, self.learner_upload_bps, inputs.ups)
        else:
            full = tree.best_plan(
                inputs.source,
                self.learner_upload_bps,
                inputs.ups,
                total_bytes=inputs.total_bytes,
                chunk_bytes=inputs.chunk_bytes,
                max_stripes=self.max_stripes,
                max_fanout=self.max_fanout,
                reach=inputs.reach,
            )
        with self._lock:
            if job_id not in self._due:  # no newer patch arrived meanwhile
                self._plans[job_id] = full
        return True

    def forget(self, job_id: str) -> None:
        """Drop a finished job's plans."""
        with self._lock:
            self._plans.pop(job_id, None)
            self._due.pop(job_id, None)
            self._reaches.pop(job_id, None)

    async def refresh_forever(self) -> None:
        """Re-plan, in a worker thread, each job whose last plan was patched or quick; owns no
        state beyond that. Runs until cancelled (a re-plan in flight is abandoned)."""
        while True:
            with self._lock:
                due = list(self._due)
            for job_id in due:
                await trio.to_thread.run_sync(self.refresh, job_id, abandon_on_cancel=True)
            await trio.sleep(REFRESH_POLL_S)


def _changed(old: TreePlan, new: TreePlan) -> bool:
    """Whether ``new`` (a patch of ``old``) is worth a full re-plan: other members, or an uplink
    that moved by more than :data:`UPLINK_DRIFT`."""
    if "+patched" not in new.kind and new.kind == old.kind and new.ups == old.ups:
        return False
    if set(new.ups) != set(old.ups):
        return True
    return any(abs(new.ups[n] - old.ups[n]) > UPLINK_DRIFT * max(old.ups[n], 1.0) for n in new.ups)


__all__ = ["Dissemination", "NodeLink"]
