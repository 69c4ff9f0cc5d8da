"""What the coordinator believes of each node as a relay: the beliefs a plan is made from.

:class:`RelayBeliefs` keeps, per registered node (:class:`NodeLink`): the addresses it declared
and what a dial-back verified of them (:meth:`~RelayBeliefs.set_reachable`), its uplink as the
node claims it and as its receivers confirmed it, the bad-chunk reports against it, and the
direct paths punched between nodes behind NAT. The planner reads them through
:meth:`~RelayBeliefs.upload_of` and :meth:`~RelayBeliefs.announce`.

Trust: nodes verify every chunk against the learner-signed manifest, so a plan can slow a version
down but never change it. Identities are free, so no identity's own word steers a plan:

- **Uplinks as the receivers measured them.** What a node says of its own uplink -- declared at
  registration, or the push rate its status reports (:meth:`~RelayBeliefs.measured`) -- counts
  only up to ``default_node_upload_bps``, or up to what its receivers confirmed
  (:meth:`~RelayBeliefs.confirm`, fed by :class:`echo.coordinator.dissemination.receipts.Receipts`
  as it times each receipt). One status message claiming 1e15 B/s buys nothing (issue 26,
  finding 3).
- **Demotion only by credible, distinct, recent reporters.** A report of a bad chunk cannot be
  proven to the coordinator, so it never expels the relay. Reports count only from nodes with
  accepted work whose dial-back saw them on a network (/24, /48) no other counted reporter is on;
  :data:`DEMOTE_REPORTERS` such networks within :data:`DEMOTE_WINDOW_S` plan the relay as a leaf
  (it receives, it no longer forwards) until enough of the reports age out. Three merely
  registered identities demote nobody.

Reachability: a node without announced addresses
(:mod:`echo.coordinator.dissemination.addresses`) still relays, to the peers it can reach: it
dials a dialable child itself, and two such nodes can hold a direct connection after a
coordinated punch (:mod:`echo.coordinator.dissemination.punching` asks for the pairs
:meth:`~RelayBeliefs.punch_pairs` names and books the outcome with
:meth:`~RelayBeliefs.set_punched`). :meth:`~RelayBeliefs.announce` hands the planners the
:class:`~echo.coordinator.dissemination.planner.reach.Reach` that places every edge accordingly:
no edge needs a dial that cannot happen.

No I/O; raises nothing for well-formed input. The trio thread writes, a planning worker thread
reads: :attr:`~RelayBeliefs.punched` is replaced, never mutated, so a reader holds one snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from echo.coordinator.dissemination.addresses import (
    direct_addrs,
    network_of,
    verified_addrs,
    with_circuits,
)
from echo.coordinator.dissemination.circuits import split_addrs
from echo.coordinator.dissemination.planner.reach import Reach
from echo.coordinator.dissemination.punch_pairs import NatInfo, PunchPair, pair_key, punch_pairs
from echo.protocol import broadcast as b

log = logging.getLogger("echo.coordinator.dissemination.relays")

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
# Confirmed uplink figures kept per node (one per version timed, the newest): the cap on what a
# node says of itself follows its recent receipts.
CONFIRMED_KEEP = 8


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


class RelayBeliefs:
    """Every belief about a node as a relay, keyed by node; see the module docstring.

    One class because the beliefs judge each other: a dial-back's verdict decides which punched
    paths still hold and who may punch, demotion removes a node from punching and zeroes its
    uplink, and a reporter's or receiver's word counts only with the network its dial-back saw.
    Forgetting a node drops them all at once.

    ``clock``: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, *, default_node_upload_bps: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.default_node_upload_bps = default_node_upload_bps
        self._clock = clock
        self.links: dict[str, NodeLink] = {}
        # Called with a node whose addresses await a dial-back (the prober's queue sets it).
        self.on_new_addrs: Callable[[str], None] | None = None
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
        :func:`~echo.coordinator.dissemination.addresses.verified_addrs`) is what plans
        announce. One that cannot be dialled is announced without addresses: its parents push
        over the connection it opens to them, and it relays only to peers it can reach
        (:meth:`announce`). ``verdict`` "nat" with the ``observed_ip`` it was seen from makes it
        a candidate for punches."""
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

    def unprobed(self) -> list[tuple[str, list[str]]]:
        """(node, addresses) of the nodes no dial-back has judged since their addresses."""
        return [(n, list(k.addrs)) for n, k in self.links.items() if k.reachable is None]

    # -- direct paths between nodes behind NAT -------------------------------------------------

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

    # -- what a plan of these nodes is made from -----------------------------------------------

    def announce(
        self, members: Sequence[str], local_addrs: bool | None, relay_addrs: Sequence[str]
    ) -> tuple[dict[str, list[str]], Reach]:
        """The addresses each of ``members`` is announced with
        (:mod:`echo.coordinator.dissemination.addresses`; circuit ones through the coordinator's
        own ``relay_addrs`` or a dialable node), and the :class:`Reach` of the plan: which
        members nobody can dial (no direct address) and the punched paths between them."""
        direct = direct_addrs(
            {n: list(self.links[n].verified) if self.links[n].reachable else [] for n in members},
            local_addrs,
        )
        behind = frozenset(n for n in members if not direct[n])
        punched = self.punched  # one snapshot: the trio thread replaces it, never mutates it
        paths: dict[str, set[str]] = {}
        for pair, ok in punched.items():
            if ok and pair <= behind and len(pair) == 2:
                a, b_ = sorted(pair)
                paths.setdefault(a, set()).add(b_)
                paths.setdefault(b_, set()).add(a)
        reach = Reach(behind, {n: frozenset(ps) for n, ps in paths.items()})
        relays: dict[str, set[str]] = {}
        for addr in relay_addrs:
            relays.setdefault(addr.rsplit("/p2p/", 1)[-1], set()).add(addr)
        for n, link in self.links.items():
            if link.reachable:
                relays.setdefault(n, set()).update(link.verified)
        circuits = {n: self.links[n].circuits for n in members}
        return with_circuits(direct, circuits, relays, local_addrs), reach

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
        :meth:`~echo.coordinator.dissemination.receipts.Receipts.delivered`, or a test's; the
        newest :data:`CONFIRMED_KEEP` are kept."""
        link = self.links.get(node_id)
        if link is None or upload_bps <= 0:
            return
        link.confirmed[key] = upload_bps
        while len(link.confirmed) > CONFIRMED_KEEP:
            del link.confirmed[next(iter(link.confirmed))]

    def upload_of(self, node_id: str) -> float:
        """The uplink a plan gives the node: 0 while demoted; else what it says (its reported
        push rate, else its declared uplink, else the default) up to the larger of
        ``default_node_upload_bps`` and what its receivers confirmed. KeyError if it never
        registered."""
        link = self.links[node_id]
        if self._demoted(link, self._clock()):  # a leaf: it relays to nobody
            return 0.0
        own = link.claimed_bps or link.declared_bps or self.default_node_upload_bps
        return min(own, max(self.default_node_upload_bps, link.confirmed_bps))

    # -- reports of bad chunks -----------------------------------------------------------------

    def bad_chunk(
        self, reporter: str, report: b.BadPeerReport, *, accepted: int | None = None
    ) -> None:
        """A node's report that the relay ``report.peer_id`` sent it a bad chunk: counts towards
        a demotion when the reporter is credible (:meth:`credible_network`; see
        :data:`DEMOTE_REPORTERS`). Unknown relays are ignored."""
        link = self.links.get(report.peer_id)
        if link is None:
            return
        network = self.credible_network(reporter, accepted)
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
        """Whether the node is planned as a leaf now (see :meth:`bad_chunk`)."""
        link = self.links.get(node_id)
        return link is not None and self._demoted(link, self._clock())

    @staticmethod
    def _demoted(link: NodeLink, now: float) -> bool:
        recent = {net for net, at in link.reports.values() if now - at < DEMOTE_WINDOW_S}
        return len(recent) >= DEMOTE_REPORTERS

    def credible_network(self, node_id: str, accepted: int | None) -> str | None:
        """The network of a node whose word counts (:data:`MIN_ACCEPTED` accepted groups, as
        ``accepted`` says or, None, as of its last plan; a network its dial-back saw), else
        None."""
        link = self.links.get(node_id)
        if link is None:
            return None
        proven = link.proven if accepted is None else accepted >= MIN_ACCEPTED
        return link.network if proven else None


__all__ = [
    "CONFIRMED_KEEP",
    "DEMOTE_REPORTERS",
    "DEMOTE_WINDOW_S",
    "MIN_ACCEPTED",
    "NodeLink",
    "RelayBeliefs",
]
