"""The plan of each new version: the coordinator's side of the relay broadcast.

When the learner reports a version, :class:`Dissemination` plans relay trees from the learner
over the nodes active now (:func:`echo.coordinator.dissemination.planner.best.best_plan`: fast
uploaders near the root, striped where that uses more uplinks) and returns the
:class:`~echo.protocol.broadcast.PlanAnnouncement` the coordinator signs, returns to the learner
and gossips to the nodes. It plans from what the coordinator believes of each node as a relay
(:class:`~echo.coordinator.dissemination.relays.RelayBeliefs`: uplinks, demotions, verified
addresses, punched paths), hands out only the addresses
:mod:`echo.coordinator.dissemination.addresses` allows, and times each version's receipts
against its plan (:class:`~echo.coordinator.dissemination.receipts.Receipts`), which is how the
relays' uplinks get confirmed.

Planning never holds up a version: :meth:`Dissemination.plan` patches the job's last plan for
the nodes that joined or left since
(:func:`echo.coordinator.dissemination.planner.patch.patch_plan`, linear in the nodes) and leaves
the full search (:func:`echo.coordinator.dissemination.planner.best.best_plan`, seconds at a
thousand nodes) to
:meth:`Dissemination.refresh_forever`, a background task that re-plans in a worker thread for the
next version. A job's first plan is a single equal-rate tree, also linear.

Nothing here does I/O except :meth:`Dissemination.refresh_forever` (a trio task that only
sleeps and runs the planner in a thread); it raises nothing for well-formed input.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import trio

from echo.coordinator.dissemination.planner import best as tree
from echo.coordinator.dissemination.planner.equal import plan_tree
from echo.coordinator.dissemination.planner.patch import patch_plan
from echo.coordinator.dissemination.planner.plan import TreePlan
from echo.coordinator.dissemination.planner.reach import Reach
from echo.coordinator.dissemination.receipts import Receipts
from echo.coordinator.dissemination.relays import RelayBeliefs
from echo.protocol import broadcast as b
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger("echo.coordinator.dissemination.planning")

# How often the background task looks for a job whose plan is due for a full re-plan.
REFRESH_POLL_S = 0.5
# A patched plan is re-planned in full when a member's uplink moved by more than this fraction.
UPLINK_DRIFT = 0.25


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

    Owns the two things a plan needs besides the planner: :attr:`relays` (what it believes of
    each node; the node RPCs, dial-backs and punches feed it) and :attr:`receipts` (the timing
    of each plan's receipts, which feeds confirmed uplinks back into :attr:`relays`).

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
        self.max_fanout = max_fanout
        self.max_stripes = max_stripes
        self.local_addrs = local_addrs
        self.relays = RelayBeliefs(default_node_upload_bps=default_node_upload_bps, clock=clock)
        self.receipts = Receipts(self.relays, clock=clock)
        # The coordinator's own relay addresses (``.../p2p/<id>``), set when its host listens:
        # circuit addresses through them are announced (echo.coordinator.dissemination.circuits).
        self.relay_addrs: list[str] = []
        # Per job: the plan versions are patched from, and the inputs of a due full re-plan.
        # plan() and refresh() run in worker threads: the lock guards these maps.
        self._plans: dict[str, TreePlan] = {}
        self._due: dict[str, _Inputs] = {}
        self._reaches: dict[str, Reach] = {}  # what each job's last plan was made under
        self._lock = threading.Lock()

    def reported(
        self, reporter: str, report: b.BadPeerReport, *, accepted: int | None = None
    ) -> None:
        """A node's report about a relay: "bad_chunk" counts towards a demotion
        (:meth:`~echo.coordinator.dissemination.relays.RelayBeliefs.bad_chunk`, ``accepted``
        groups of the reporter, None: as of its last plan); "stalled" withholds the relay's
        credit for the reporter's receipt of that version
        (:meth:`~echo.coordinator.dissemination.receipts.Receipts.stalled`); anything else, or a
        relay never registered, is ignored."""
        if report.peer_id not in self.relays.links:
            return
        if report.reason == "stalled":
            self.receipts.stalled(reporter, report)
        elif report.reason == "bad_chunk":
            self.relays.bad_chunk(reporter, report, accepted=accepted)

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
        accepted work (:meth:`reported`,
        :meth:`Receipts.delivered <echo.coordinator.dissemination.receipts.Receipts.delivered>`)."""
        links = self.relays.links
        members = sorted({n for n in nodes if n != source and n in links and links[n].addrs})
        if not members:
            return None
        leaf_only = set(leaves)
        for n in members:
            links[n].proven = n not in leaf_only
        ups = {n: 0.0 if n in leaf_only else self.relays.upload_of(n) for n in members}
        announced, reach = self.relays.announce(members, self.local_addrs, self.relay_addrs)
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
        floor_s = total_bytes / self.learner_upload_bps
        self.receipts.expect(job_id, version, chosen, total_bytes, floor_s)
        with self._lock:
            self._plans[job_id] = chosen
            self._reaches[job_id] = reach
            if last is None or _changed(last, chosen) or reach != last_reach:
                self._due[job_id] = inputs
        behind_relays = {n for n in reach.behind for st in chosen.stripes if st.children.get(n)}
        if behind_relays:
            log.info(
                "v%d plan: %d node(s) without addresses relay to peers they reach",
                version,
                len(behind_relays),
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
        self.receipts.forget(job_id)
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


__all__ = ["Dissemination"]
