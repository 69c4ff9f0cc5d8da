"""How each new version reaches the nodes: the coordinator's side of the relay broadcast.

:class:`Dissemination` remembers what a plan needs to know about each node -- the addresses a
dial-back verified (:meth:`set_reachable`), its uplink (see "Trust" below), and whether peers
reported it for bad chunks -- and, when the learner reports a version, plans relay trees from
the learner over the nodes active now
(:func:`echo.coordinator.dissemination.planner.best.best_plan`: fast uploaders near the root,
striped where that uses more uplinks) and returns the
:class:`~echo.protocol.broadcast.PlanAnnouncement` the coordinator signs, returns to the learner
and gossips to the nodes.

Planning never holds up a version: :meth:`Dissemination.plan` patches the job's last plan for
the nodes that joined or left since
(:func:`echo.coordinator.dissemination.planner.patch.patch_plan`, linear in the nodes) and leaves
the full search (:func:`echo.coordinator.dissemination.planner.best.best_plan`, seconds at a
thousand nodes) to
:meth:`Dissemination.refresh_forever`, a background task that re-plans in a worker thread for the
next version. A job's first plan is a single equal-rate tree, also linear.

Trust: nodes verify every chunk against the learner-signed manifest, so a plan can slow a version
down but never change it. Identities are free, so no identity's own word steers a plan:

- **Uplinks as the receivers measured them.** What a node says of its own uplink -- declared at
  registration, or the push rate its status reports (:meth:`measured`) -- counts only up to
  :attr:`default_node_upload_bps`, or up to what its receivers confirmed (:meth:`delivered`):
  when a child with accepted work, on another network than its parent, reports holding a
  version, each of its parents in that version's plan is credited with the stripe bytes it owed
  that child over the time the child took (at least the time the learner's own uplink needs for
  the whole version: nobody can hold it sooner). One status message claiming 1e15 B/s buys
  nothing (issue 26, finding 3).
- **Demotion only by credible, distinct, recent reporters.** A report of a bad chunk cannot be
  proven to the coordinator, so it never expels the relay. Reports count only from nodes with
  accepted work whose dial-back saw them on a network (/24, /48) no other counted reporter is on;
  :data:`DEMOTE_REPORTERS` such networks within :data:`DEMOTE_WINDOW_S` plan the relay as a leaf
  (it receives, it no longer forwards) until enough of the reports age out. Three merely
  registered identities demote nobody.

Addresses: a plan hands every node the addresses of the others, and honest relays dial them, so
it carries only what a dial-back verified (:meth:`set_reachable`: the address that answered, or
those it dialled, all on the IP the coordinator saw the node connect from) -- never a declared
one. A node not yet probed, or not dialable, is announced without addresses: it dials its
parents itself when it joins the plan and they push over that connection
(:meth:`echo.p2p.relay.peers.Peers.reach_out`). Loopback, private and link-local addresses are
handed out only when the operator allows them (``local_addrs=True``) or, by default, when every
announced address of the plan is one (a swarm on one machine or one LAN: the demo and the
tests); in a swarm that also has public nodes, a node seen on a local address is announced
without addresses, so no volunteer is told to dial into its own LAN (issue 26, finding 6).

Reachability: a node without announced addresses still relays, to the peers it can reach: it
dials a dialable child itself, and two such nodes can hold a direct connection after a
coordinated punch (:mod:`echo.coordinator.dissemination.punching` asks for the pairs
:meth:`punch_pairs` names and books the outcome with :meth:`set_punched`). The planners place every
edge accordingly (:class:`~echo.coordinator.dissemination.planner.reach.Reach`): no edge needs a
dial that cannot happen.

Nothing here does I/O except :meth:`Dissemination.refresh_forever` (a trio task that only
sleeps and runs the planner in a thread); it raises nothing for well-formed input.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field

import trio

from echo.coordinator.dissemination.circuits import split_addrs, trusted_circuits
from echo.coordinator.dissemination.planner import best as tree
from echo.coordinator.dissemination.planner.equal import plan_tree
from echo.coordinator.dissemination.planner.patch import patch_plan
from echo.coordinator.dissemination.planner.plan import TreePlan
from echo.coordinator.dissemination.planner.reach import Reach
from echo.coordinator.dissemination.punch_pairs import NatInfo, PunchPair, pair_key, punch_pairs
from echo.p2p.conn_guard import prefix_of
from echo.p2p.nat.dialback import candidates
from echo.protocol import broadcast as b
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger("echo.coordinator.dissemination.planning")

# Push rates a node reports are noisy (a chunk may wait for the upstream): smooth them.
UPLOAD_EWMA = 0.3
# Reporters of bad chunks, on distinct networks, before a relay is planned as a leaf.
DEMOTE_REPORTERS = 3
# A report counts this long, then ages out: a demotion is not forever. Long enough that a relay
# that corrupts chunks stays a leaf across many versions once caught (each version gives it new
# victims to report it), short enough that an honest relay demoted by a burst of lies -- or by a
# real fault since fixed -- relays again within the hour.
DEMOTE_WINDOW_S = 3600.0
# Reports kept per relay (the oldest dropped): a relay needs only DEMOTE_REPORTERS networks, and
# the bound keeps a flood of reporters from growing the coordinator's memory.
MAX_REPORTS_PER_RELAY = 64
# Accepted groups a node needs before its word counts: a bad-chunk report, or a receipt that
# confirms its parents' uplinks. An accepted group is real generation the coordinator verified;
# registering is free.
MIN_ACCEPTED = 1
# Versions per job whose plans are remembered to time the receipts by. A node reports holding a
# version within seconds of getting it; older versions' receipts are no longer timed.
TIMED_VERSIONS = 4
# Confirmed uplink figures kept per node (one per version timed, the newest): the cap on what a
# node says of itself follows its recent receipts.
CONFIRMED_KEEP = 8
# How often the background task looks for a job whose plan is due for a full re-plan.
REFRESH_POLL_S = 0.5
# A patched plan is re-planned in full when a member's uplink moved by more than this fraction.
UPLINK_DRIFT = 0.25

_IP_ADDR = re.compile(r"^/ip[46]/([^/]+)/")


def is_local_addr(addr: str) -> bool:
    """Whether ``addr`` (a multiaddr) points at a loopback, private or link-local IP -- or at
    something that is not an IP address at all (treated as local: never handed out blindly)."""
    found = _IP_ADDR.match(addr)
    prefix = prefix_of(found.group(1)) if found else None
    return prefix is None or prefix.kind != "public"


def network_of(ip: str) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) ``ip`` is counted in (loopback: the address itself)."""
    prefix = prefix_of(ip) if ip else None
    return prefix.network if prefix is not None else None


def verified_addrs(
    node_id: str, declared: Sequence[str], observed_ip: str, verdict: str, dialed: str
) -> list[str]:
    """The addresses of ``node_id`` a dial-back vouches for, ``/p2p/<node_id>`` appended: the one
    that answered (``dialed``), else every candidate it dialled for that ``verdict``
    (:func:`echo.p2p.nat.dialback.candidates`: always on ``observed_ip``, the IP the coordinator
    saw the node connect from). Nothing without an observed IP: a declared address is never
    vouched for by itself."""
    if not observed_ip:
        return []
    if dialed:
        found = _IP_ADDR.match(dialed)
        if found is None or found.group(1) != observed_ip:
            return []
        dialed_ones = [dialed.split("/p2p/", 1)[0]]
    else:
        bare = [a.split("/p2p/", 1)[0] for a in declared]  # the dial-back dials them so
        dialed_ones = [a for a, v in candidates(bare, observed_ip) if not verdict or v == verdict]
    return [f"{a}/p2p/{node_id}" for a in dialed_ones][: b.MAX_ADDRS]


@dataclass
class NodeLink:
    """What a plan knows of one node's link; see the module docstring for whose word counts."""

    addrs: list[str] = field(default_factory=list)  # declared: dial-back candidates only
    declared_bps: float = 0.0  # what it registered with
    claimed_bps: float = 0.0  # the push rate its own status reports say, smoothed
    # Per (job, version) timed: the uplink its receivers confirmed (the newest CONFIRMED_KEEP).
    confirmed: dict[tuple[str, int], float] = field(default_factory=dict)
    # Bad-chunk reports about it that counted: reporter -> (reporter's network, when).
    reports: dict[str, tuple[str, float]] = field(default_factory=dict)
    # Whether a dial-back reached it (None: not probed since its addresses: not dialable).
    reachable: bool | None = None
    # The dial-back's verdict and the ip it saw the node on (its router's, when "nat").
    verdict: str = ""
    observed_ip: str = ""
    verified: list[str] = field(default_factory=list)  # what the dial-back vouched for
    circuits: list[str] = field(default_factory=list)  # declared circuit addresses (relays)
    proven: bool = False  # it had accepted work when it was last planned (not a leaf)

    @property
    def confirmed_bps(self) -> float:
        return max(self.confirmed.values(), default=0.0)

    @property
    def network(self) -> str | None:
        return network_of(self.observed_ip)


@dataclass
class _Credit:
    """What one parent was credited with in one version: bytes its children got, the longest
    any of them took, and the networks they were on (one credited child per network)."""

    nbytes: float = 0.0
    elapsed: float = 0.0
    networks: set[str] = field(default_factory=set)


@dataclass
class _Timing:
    """One announced plan, kept to time its receipts (:meth:`Dissemination.delivered`)."""

    started: float
    floor_s: float  # the learner's own time to send the version once: nobody holds it sooner
    owed: dict[str, list[tuple[str, float]]]  # child -> [(relay parent, bytes of its stripe)]
    arrived: set[str] = field(default_factory=set)
    stalled: set[tuple[str, str]] = field(default_factory=set)  # (child, parent) it reported
    credit: dict[str, _Credit] = field(default_factory=dict)


def _timing(plan: TreePlan, started: float, floor_s: float, total_bytes: int) -> _Timing:
    """What each child of ``plan`` is owed by each of its relay parents (the source's own pushes
    are not timed: its uplink is the operator's figure)."""
    weights = list(plan.weights) or [1] * len(plan.stripes)
    owed: dict[str, list[tuple[str, float]]] = {}
    for stripe, weight in zip(plan.stripes, weights, strict=True):
        share = total_bytes * weight / sum(weights)
        for parent, kids in stripe.children.items():
            if parent == plan.source:
                continue
            for kid in kids:
                owed.setdefault(kid, []).append((parent, share))
    return _Timing(started, floor_s, owed)


@dataclass
class _Inputs:
    """What a full plan of one job is computed from (kept for the background re-plan)."""

    source: str
    ups: dict[str, float]
    total_bytes: int
    chunk_bytes: int
    reach: Reach


class Dissemination:
    """Plans one version's broadcast at a time; see the module docstring.

    One class because a plan is only as good as what it believes of each node, and each belief
    (verified addresses, uplinks receivers confirmed, demotions, punched paths) exists to be read
    by the planner and is kept only for nodes it may plan: forgetting a node, or a job, must
    drop both at once.

    ``local_addrs``: hand out loopback/private/link-local addresses (True), never (False), or
    only when every announced address of a plan is one (None, the default: a local swarm).
    ``clock``: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        learner_upload_bps: float,
        default_node_upload_bps: float,
        max_fanout: int = tree.DEFAULT_MAX_FANOUT,
        max_stripes: int = tree.DEFAULT_MAX_STRIPES,
        local_addrs: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.learner_upload_bps = learner_upload_bps
        self.default_node_upload_bps = default_node_upload_bps
        self.max_fanout = max_fanout
        self.max_stripes = max_stripes
        self.local_addrs = local_addrs
        self._clock = clock
        self.links: dict[str, NodeLink] = {}
        # Called with a node whose addresses await a dial-back (the prober's queue sets it).
        self.on_new_addrs: Callable[[str], None] | None = None
        # Called (job, version, parent, child, bytes) for each relay edge credited by a receipt
        # (:meth:`delivered`), and (job, version, parent, child, B/s) for each receipt timed.
        self.on_relay_credit: Callable[[str, int, str, str, float], None] | None = None
        self.on_edge: Callable[[str, int, str, str, float], None] | None = None
        # The coordinator's own relay addresses (``.../p2p/<id>``), set when its host listens:
        # circuit addresses through them are announced (echo.coordinator.dissemination.circuits).
        self.relay_addrs: list[str] = []
        # Per job: the plan versions are patched from, and the inputs of a due full re-plan.
        # plan() and refresh() run in worker threads: the lock guards these maps.
        self._plans: dict[str, TreePlan] = {}
        self._due: dict[str, _Inputs] = {}
        self._reaches: dict[str, Reach] = {}  # what each job's last plan was made under
        self._timings: dict[tuple[str, int], _Timing] = {}  # the last TIMED_VERSIONS per job
        self._lock = threading.Lock()
        # Per pair of nodes behind NAT that were asked to connect: whether both ends reported
        # a direct connection. Dropped when either node's addresses or public ip change.
        self.punched: dict[frozenset[str], bool] = {}

    # -- what nodes say and what the dial-backs found ------------------------------------------

    def registered(self, node_id: str, addrs: Sequence[str], declared_bps: float) -> None:
        """A node (re)registered: where it says it listens (a dial-back checks it before anyone
        is told) and the uplink it declared (counted up to the default, see :meth:`upload_of`)."""
        link = self.links.setdefault(node_id, NodeLink())
        # Circuit addresses are no dial-back candidates: a new one (a reservation refreshed on
        # another relay) must not cost the node its verdict and its punched paths.
        fresh, link.circuits = split_addrs(node_id, [a for a in addrs if a][: b.MAX_ADDRS])
        if fresh != link.addrs:  # new addresses: the last dial-back says nothing about them
            link.reachable = None
            link.verified = []
            self._forget_paths(node_id)
        link.addrs = fresh
        link.declared_bps = declared_bps
        if link.reachable is None and fresh and self.on_new_addrs is not None:
            self.on_new_addrs(node_id)

    def set_reachable(
        self,
        node_id: str,
        reachable: bool,
        *,
        verdict: str = "",
        observed_ip: str = "",
        dialed: str = "",
    ) -> None:
        """A dial-back's verdict on the node's addresses (unknown nodes are ignored): what it
        ``dialed`` successfully (else every candidate it tried for ``verdict``, see
        :func:`verified_addrs`) is what plans announce. One that cannot be dialled is announced
        without addresses: its parents push over the connection it opens to them, and it relays
        only to peers it can reach (:meth:`_reach`). ``verdict`` "nat" with the
        ``observed_ip`` it was seen from makes it a candidate for punches."""
        link = self.links.get(node_id)
        if link is None:
            return
        if observed_ip != link.observed_ip or reachable:
            self._forget_paths(node_id)
        link.reachable = reachable
        link.verdict = verdict
        link.observed_ip = observed_ip
        link.verified = (
            verified_addrs(node_id, link.addrs, observed_ip, verdict, dialed) if reachable else []
        )

    def forget_node(self, node_id: str) -> None:
        """Drop everything known of a node that left for good (its paths included)."""
        self.links.pop(node_id, None)
        self._forget_paths(node_id)

    def _forget_paths(self, node_id: str) -> None:
        self.punched = {k: v for k, v in self.punched.items() if node_id not in k}

    def punch_pairs(
        self,
        busy: Mapping[str, int] | None = None,
        in_flight: Set[frozenset[str]] = frozenset(),
    ) -> list[PunchPair]:
        """Pairs of nodes behind NAT to ask for a direct connection now (see
        :func:`~echo.coordinator.dissemination.punch_pairs.punch_pairs`)."""
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
        now = self._clock()
        return {
            n: NatInfo(k.observed_ip, tuple(k.addrs))
            for n, k in self.links.items()
            if k.reachable is False
            and k.verdict == "nat"
            and k.observed_ip
            and not self._demoted(k, now)
        }

    def unprobed(self) -> list[tuple[str, list[str]]]:
        """(node, addresses) of the nodes no dial-back has judged since their addresses."""
        return [(n, list(k.addrs)) for n, k in self.links.items() if k.reachable is None]

    # -- uplinks: claimed by the node, confirmed by its receivers ------------------------------

    def measured(self, node_id: str, upload_bps: float) -> None:
        """The push rate a node's own status reports (0: none yet), smoothed; unknown nodes
        are ignored. Its own word: it counts only up to :meth:`upload_of`'s cap."""
        link = self.links.get(node_id)
        if link is None or upload_bps <= 0:
            return
        if link.claimed_bps <= 0:
            link.claimed_bps = upload_bps
        else:
            link.claimed_bps += UPLOAD_EWMA * (upload_bps - link.claimed_bps)

    def confirm(self, node_id: str, key: tuple[str, int], upload_bps: float) -> None:
        """A receivers' figure for the node's uplink in version ``key`` (job, version): from
        :meth:`delivered`, or a test's; the newest :data:`CONFIRMED_KEEP` are kept."""
        link = self.links.get(node_id)
        if link is None or upload_bps <= 0:
            return
        link.confirmed[key] = upload_bps
        while len(link.confirmed) > CONFIRMED_KEEP:
            del link.confirmed[next(iter(link.confirmed))]

    def delivered(
        self, node_id: str, job_id: str, version: int, *, accepted: int | None = None
    ) -> None:
        """``node_id`` proved it holds ``version`` of ``job_id`` (its status named the version's
        digest): time its receipt and credit each relay parent of it in that version's plan
        (:class:`_Credit`). Counts only once per node and version, only for a node with
        :data:`MIN_ACCEPTED` accepted groups (``accepted``; None: as of its last plan) on a
        network the dial-back saw, and only for parents on another network that the node did
        not report as stalled. A parent that pushed slowly while the child pulled the rest
        elsewhere is credited as if it had pushed all of it: bounded by the child's real time."""
        with self._lock:
            timing = self._timings.get((job_id, version))
        if timing is None or node_id in timing.arrived:
            return
        timing.arrived.add(node_id)
        elapsed = max(self._clock() - timing.started, timing.floor_s, 1e-3)
        if self.on_edge is not None:  # what the dashboard draws, credible or not
            for parent, nbytes in timing.owed.get(node_id, ()):
                self.on_edge(job_id, version, parent, node_id, nbytes / elapsed)
        network = self._credible_network(node_id, accepted)
        if network is None:
            return
        for parent, nbytes in timing.owed.get(node_id, ()):
            plink = self.links.get(parent)
            if plink is None or (node_id, parent) in timing.stalled or plink.network == network:
                continue
            credit = timing.credit.setdefault(parent, _Credit())
            if network in credit.networks:
                continue
            credit.networks.add(network)
            credit.nbytes += nbytes
            credit.elapsed = max(credit.elapsed, elapsed)
            self.confirm(parent, (job_id, version), credit.nbytes / credit.elapsed)
            if self.on_relay_credit is not None:  # the credit ledger pays what is confirmed here
                self.on_relay_credit(job_id, version, parent, node_id, nbytes)

    def upload_of(self, node_id: str) -> float:
        """The uplink a plan gives the node: 0 while demoted; else what it says (its reported
        push rate, else its declared uplink, else the default) up to the larger of
        :attr:`default_node_upload_bps` and what its receivers confirmed. KeyError if it never
        registered."""
        link = self.links[node_id]
        if self._demoted(link, self._clock()):  # a leaf: it relays to nobody
            return 0.0
        own = link.claimed_bps or link.declared_bps or self.default_node_upload_bps
        return min(own, max(self.default_node_upload_bps, link.confirmed_bps))

    # -- reports about relays -------------------------------------------------------------------

    def reported(
        self, reporter: str, report: b.BadPeerReport, *, accepted: int | None = None
    ) -> None:
        """A node's report about a relay. "bad_chunk" counts towards a demotion when the
        reporter is credible (``accepted`` groups, None: as of its last plan; a network the
        dial-back saw; see :data:`DEMOTE_REPORTERS`); "stalled" withholds the relay's credit for
        the reporter's receipt of that version (:meth:`delivered`); anything else is ignored."""
        link = self.links.get(report.peer_id)
        if link is None:
            return
        if report.reason == "stalled":
            self._stalled(reporter, report)
            return
        if report.reason != "bad_chunk":
            return
        network = self._credible_network(reporter, accepted)
        if network is None:
            log.debug("bad-chunk report by %s not counted: no accepted work or network", reporter)
            return
        now = self._clock()
        was = self._demoted(link, now)
        link.reports.pop(reporter, None)  # re-inserted last: the newest
        link.reports[reporter] = (network, now)
        while len(link.reports) > MAX_REPORTS_PER_RELAY:
            del link.reports[next(iter(link.reports))]
        if not was and self._demoted(link, now):
            log.warning(
                "relay %s reported for bad chunks from %d networks (last: v%d): planned as a "
                "leaf until the reports age out (%.0f s)",
                report.peer_id[-8:],
                DEMOTE_REPORTERS,
                report.version,
                DEMOTE_WINDOW_S,
            )

    def is_demoted(self, node_id: str) -> bool:
        """Whether the node is planned as a leaf now (see :meth:`reported`)."""
        link = self.links.get(node_id)
        return link is not None and self._demoted(link, self._clock())

    @staticmethod
    def _demoted(link: NodeLink, now: float) -> bool:
        recent = {net for net, at in link.reports.values() if now - at < DEMOTE_WINDOW_S}
        return len(recent) >= DEMOTE_REPORTERS

    def _credible_network(self, node_id: str, accepted: int | None) -> str | None:
        """The network of a node whose word counts (see :data:`MIN_ACCEPTED`), else None."""
        link = self.links.get(node_id)
        if link is None:
            return None
        proven = link.proven if accepted is None else accepted >= MIN_ACCEPTED
        return link.network if proven else None

    def _stalled(self, reporter: str, report: b.BadPeerReport) -> None:
        with self._lock:
            timing = self._timings.get((report.job_id, report.version))
        if timing is not None and any(
            p == report.peer_id for p, _ in timing.owed.get(reporter, ())
        ):
            timing.stalled.add((reporter, report.peer_id))

    # -- plans ------------------------------------------------------------------------------------

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
        """The plan of ``version`` over those of ``nodes`` that registered addresses (None when
        none did: nodes then pull from the learner). ``leaves`` receive and relay to nobody
        (the coordinator passes nodes without an accepted group: identities are free, and one
        planned as a relay that never relays stalls its subtree); the others count as having
        accepted work (:meth:`reported`, :meth:`delivered`)."""
        members = sorted({n for n in nodes if n != source and self.links.get(n, NodeLink()).addrs})
        if not members:
            return None
        leaf_only = set(leaves)
        for n in members:
            self.links[n].proven = n not in leaf_only
        ups = {n: 0.0 if n in leaf_only else self.upload_of(n) for n in members}
        announced = self._announced(members)
        reach = self._reach(members, announced)
        announced = self._with_circuits(announced)
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
        timing = _timing(chosen, self._clock(), total_bytes / self.learner_upload_bps, total_bytes)
        with self._lock:
            self._plans[job_id] = chosen
            self._reaches[job_id] = reach
            if last is None or _changed(last, chosen) or reach != last_reach:
                self._due[job_id] = inputs
            self._remember_timing(job_id, version, timing)
        relays = {n for n in reach.behind for st in chosen.stripes if st.children.get(n)}
        if relays:
            log.info(
                "v%d plan: %d node(s) without addresses relay to peers they reach",
                version,
                len(relays),
            )
        peers = [b.PeerAddr(peer_id=source, addrs=list(source_addrs)[: b.MAX_ADDRS])]
        peers += [b.PeerAddr(peer_id=n, addrs=announced[n]) for n in members]
        return b.PlanAnnouncement(
            job_id=job_id,
            version=version,
            manifest=manifest,
            plan=tree.plan_record(chosen, job_id, version),
            peers=peers,
        )

    def _remember_timing(self, job_id: str, version: int, timing: _Timing) -> None:
        """Keep ``timing`` and the job's newest :data:`TIMED_VERSIONS` others (lock held)."""
        self._timings[(job_id, version)] = timing
        mine = sorted(v for j, v in self._timings if j == job_id)
        for old in mine[:-TIMED_VERSIONS]:
            del self._timings[(job_id, old)]

    def _announced(self, members: Sequence[str]) -> dict[str, list[str]]:
        """The addresses each member is announced with: what a dial-back verified, local ones
        only where allowed (see the module docstring); [] for a node not probed or not
        dialable."""
        verified = {
            n: list(self.links[n].verified) if self.links[n].reachable else [] for n in members
        }
        allow = self.local_addrs
        if allow is None:  # a swarm on one machine or one LAN: nothing but local addresses
            allow = all(is_local_addr(a) for addrs in verified.values() for a in addrs)
        return {
            n: [a for a in addrs if allow or not is_local_addr(a)] for n, addrs in verified.items()
        }

    def _with_circuits(self, announced: Mapping[str, list[str]]) -> dict[str, list[str]]:
        """``announced`` with the trusted circuit addresses (:mod:`.dissemination_circuits`)
        of the members announced without direct ones: peers reach those for control messages."""
        relays: dict[str, set[str]] = {}
        for addr in self.relay_addrs:
            relays.setdefault(addr.rsplit("/p2p/", 1)[-1], set()).add(addr)
        for n, link in self.links.items():
            if link.reachable:
                relays.setdefault(n, set()).update(link.verified)
        out = dict(announced)
        allow_local = self.local_addrs is not False and (
            self.local_addrs or all(is_local_addr(a) for v in announced.values() for a in v)
        )
        for n, addrs in announced.items():
            if not addrs and self.links[n].circuits:
                ok = trusted_circuits(self.links[n].circuits, relays)
                out[n] = [a for a in ok if allow_local or not is_local_addr(a)]
        return out

    def _reach(self, members: Sequence[str], announced: Mapping[str, list[str]]) -> Reach:
        """Which of ``members`` nobody can dial (announced without addresses), and the direct
        paths between them."""
        behind = frozenset(n for n in members if not announced[n])
        punched = self.punched  # one snapshot: the trio thread replaces it, never mutates it
        paths: dict[str, set[str]] = {}
        for pair, ok in punched.items():
            if ok and pair <= behind and len(pair) == 2:
                a, b_ = sorted(pair)
                paths.setdefault(a, set()).add(b_)
                paths.setdefault(b_, set()).add(a)
        return Reach(behind, {n: frozenset(ps) for n, ps in paths.items()})

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

    def current_plan(self, job_id: str) -> TreePlan | None:
        """The plan the job's next version is patched from (its last, or its re-plan)."""
        with self._lock:
            return self._plans.get(job_id)

    def forget(self, job_id: str) -> None:
        """Drop a finished job's plans and timings."""
        with self._lock:
            self._plans.pop(job_id, None)
            self._due.pop(job_id, None)
            self._reaches.pop(job_id, None)
            for key in [k for k in self._timings if k[0] == job_id]:
                del self._timings[key]

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


__all__ = [
    "DEMOTE_REPORTERS",
    "DEMOTE_WINDOW_S",
    "Dissemination",
    "NodeLink",
    "is_local_addr",
    "verified_addrs",
]
