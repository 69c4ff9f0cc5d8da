"""The coordinator daemon: one libp2p host and one HTTP server over the SQLite store.

:class:`Coordinator` owns the store, the identity and the parts that share them:
:class:`~echo.coordinator.jobs.control.JobControl` (jobs and their learner processes),
:class:`~echo.coordinator.rpc.node.NodeRPC` and :class:`~echo.coordinator.rpc.learner.LearnerRPC`
(the libp2p handlers), :class:`~echo.coordinator.scheduling.leases.Leases` (lease minting) and
:class:`~echo.coordinator.submissions.penalties.Penalties` (rate limits, exclusion).
:meth:`Coordinator.run` owns the libp2p host, the HTTP server, the circuit relay it offers its
registered nodes (:data:`RELAY_LIMITS`; nodes behind NAT keep a reservation there) and every
background task in one nursery; cancelling it (Ctrl-C) stops the learners, closes the host and
returns. The HTTP API sees the coordinator through :class:`~echo.coordinator.api.ports.ApiBackend`
only.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from echo.coordinator.api.app import serve_http
from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.credit import CreditBook
from echo.coordinator.dashboard.data import EdgeRates, Snapshots
from echo.coordinator.dashboard.live import LiveFeed
from echo.coordinator.dissemination.dialbacks import run_reachability
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.jobs.control import JobControl
from echo.coordinator.metrics import Metrics
from echo.coordinator.rpc.common import active_nodes
from echo.coordinator.rpc.learner import LearnerRPC
from echo.coordinator.rpc.node import NodeRPC
from echo.coordinator.scheduling.assign import SchedulerParams
from echo.coordinator.scheduling.leases import Leases
from echo.coordinator.scheduling.placement import Placement
from echo.coordinator.store import Store
from echo.coordinator.submissions.penalties import Penalties
from echo.p2p.conn_guard import PUBLIC_PREFIX_CAP, GuardPolicy
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay
from echo.p2p.nat.dialback import observed_ip
from echo.p2p.shedding import Shedder, install_shedder
from echo.protocol.jobspec import JobSpec

# How often leases past their deadline go back to the pool (and the active-node gauge updates).
HOUSEKEEPING_S = 1.0
# How often the store forgets what [retention] lets go (see echo.coordinator.store.prune).
PRUNE_EVERY_S = 60.0
# The circuit relay (v2) the coordinator offers its registered nodes (issue 14): a node behind
# NAT keeps a reservation here so that peers can reach it. The limits are those of control
# traffic, the same that public volunteers offer (echo.p2p.nat.circuit_relay.CONTROL_RELAY_LIMITS).
RELAY_LIMITS = CONTROL_RELAY_LIMITS
# How often the relay's figures are logged (only when they changed).
RELAY_REPORT_S = 10.0

log = logging.getLogger("echo.coordinator")


class Coordinator:
    """The daemon's state and its parts; see the module docstring.

    Construction opens nothing (the store is opened by the caller, who closes it after
    :meth:`run` returns); it raises OSError if a generated API token cannot be written.
    """

    def __init__(self, config: CoordinatorConfig, store: Store, identity: Identity) -> None:
        self.config = config
        self.store = store
        self.identity = identity
        self.token = config.ensure_token()
        self.metrics = Metrics()
        bc = config.broadcast
        self.dissemination = Dissemination(
            learner_upload_bps=bc.learner_upload_bps,
            default_node_upload_bps=bc.default_node_upload_bps,
            max_fanout=bc.max_fanout,
            max_stripes=bc.max_stripes,
            local_addrs=bc.local_addrs_policy(),
        )
        self.shedder: Shedder | None = None
        self.host: EchoHost | None = None
        self.http_addrs: list[str] = []
        verification = config.verification
        self.job_control = JobControl(config, store, self.metrics, lambda: self.multiaddrs)
        penalties = Penalties(store, self.metrics, verification)
        sc = config.scheduler
        self.placement = Placement(
            store,
            self.job_control.jobs,
            SchedulerParams(sc.min_stay_s, sc.min_gain, sc.headroom),
            sc.every_s,
            # Relays need the record the lease window asks of the proven (ramp 0: the operator
            # trusts identities at once, and one accepted group is enough, as before).
            verification.proven_groups if verification.lease_quota_ramp else 1,
        )
        self.node_rpc = NodeRPC(
            store,
            self.job_control.jobs,
            self.metrics,
            self.dissemination,
            Leases(store, self.metrics, identity, verification),
            penalties,
            self.placement,
        )
        self.learner_rpc = LearnerRPC(
            store,
            self.job_control.jobs,
            self.metrics,
            identity,
            self.dissemination,
            bc,
            penalties,
        )
        self.learner_rpc.placement = self.placement
        self.relay = None  # the circuit relay, while run() serves it (echo.p2p.nat.circuit_relay)
        # Credit and the dashboard: confirmed relaying is paid as the receipts come in, trained
        # groups by the book's own task; the dashboard draws each timed relay edge.
        self.credit = CreditBook(store, identity)
        self.edge_rates = EdgeRates()
        self.dissemination.receipts.on_relay_credit = self.credit.relayed
        self.dissemination.receipts.on_edge = self.edge_rates.record
        snapshots = Snapshots(self)
        self.live = LiveFeed(snapshots.full, snapshots.public)

    async def run(
        self, *, task_status: trio.TaskStatus[Coordinator] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve nodes, learners and the HTTP API until cancelled; ``task_status`` gets self.

        Raises OSError if an address cannot be bound, and what :meth:`JobControl.resume` raises
        for a stored job this build cannot load.
        """
        guard = None
        if self.config.admission.loopback_is_network:
            guard = GuardPolicy(loopback_cap=PUBLIC_PREFIX_CAP)  # a stranger's address
        async with open_host(self.identity, self.config.listen, guard_policy=guard) as host:
            self.host = host
            # Circuit addresses through our relay are announced in plans (nodes behind NAT).
            self.dissemination.relay_addrs = list(host.listen_multiaddrs)
            # Proven peers first while the loop lags (strangers' connections are work before
            # any handler or budget sees them; the attack benchmark's honest calls waited 8 s).
            self.shedder = shedder = install_shedder(host)
            self.node_rpc.probes.held_back = lambda node: shedder.holds_back(
                observed_ip(host, node)
            )
            # A peer serving a backoff would have each stream reset after its negotiation;
            # unread, its retries wait for its own timeouts and cost us nothing.
            host.hold_reads(lambda peer: host.gate.backoff_left(str(peer)))
            self.node_rpc.install(host, self.config.admission)
            self.learner_rpc.install(host)
            async with trio.open_nursery() as nursery:
                self.http_addrs = await nursery.start(serve_http, self)
                self.job_control.resume(nursery)
                nursery.start_soon(self._housekeeping)
                nursery.start_soon(shedder.run)
                nursery.start_soon(self.dissemination.refresh_forever)
                nursery.start_soon(run_reachability, host, self.dissemination, self.node_rpc.probes)
                nursery.start_soon(self.placement.run_forever)
                nursery.start_soon(self._serve_relay, host)
                nursery.start_soon(self.credit.run_forever)
                nursery.start_soon(self.live.run_forever)
                task_status.started(self)
                await trio.sleep_forever()

    @property
    def multiaddrs(self) -> list[str]:
        """Where nodes and learners dial the coordinator (empty before :meth:`run` listens)."""
        return self.host.listen_multiaddrs if self.host else []

    def _relay_admits(self, peer_id: ID) -> bool:
        """Who may reserve a slot on (or dial through) the relay: registered nodes that are not
        excluded, and the learner of a running job. Strangers are refused (PERMISSION_DENIED).

        A learner pushing a version to a node behind NAT that has not dialled it yet reaches
        it through this relay and asks it to dial back (DCUtR): refused, each of its v0 pushes
        to the NAT swarm's four such nodes waited for the node's own dial (3.4 s in one run;
        refused in 35 of 37 runs' logs). Bulk data never crosses the relay (its limits)."""
        peer = str(peer_id)
        node = self.store.node(peer)
        if node is not None:
            return not node.excluded
        return any(row.learner_peer_id == peer for row in self.store.jobs(("running",)))

    async def _serve_relay(self, host: EchoHost) -> None:
        """Offer circuit relay v2 (:data:`RELAY_LIMITS`) to registered nodes until cancelled;
        log its figures when they change."""
        async with offer_relay(host, RELAY_LIMITS, admit=self._relay_admits) as relay:
            self.relay = relay
            last: tuple = ()
            try:
                while True:
                    await trio.sleep(RELAY_REPORT_S)
                    held = len(relay.reservations)
                    now = (
                        held,
                        relay.circuits_opened,
                        relay.circuits_limited,
                        relay.bytes_relayed,
                        sorted(relay.refused.items()),
                    )
                    if now != last:
                        last = now
                        log.info(
                            "relay: %d reservations held, %d circuits opened (%d cut at a limit), "
                            "%d bytes relayed, refused %s",
                            held,
                            relay.circuits_opened,
                            relay.circuits_limited,
                            relay.bytes_relayed,
                            dict(relay.refused) or "none",
                        )
            finally:
                self.relay = None

    async def _housekeeping(self) -> None:
        last_prune = 0.0
        while True:
            now = time.time()
            expired = self.store.expire_leases(now)
            if expired:
                self.metrics.leases_expired.inc(expired)
            self.metrics.nodes_active.set(len(active_nodes(self.store)))
            for job in list(self.job_control.jobs.values()):
                job.scorer.close_if_idle()
            if now - last_prune >= PRUNE_EVERY_S:
                last_prune = now
                forgotten: list[str] = []
                pruned = self.store.prune(
                    now,
                    self.config.retention,
                    self.config.verification.expired_lease_window_s,
                    forgotten,
                )
                for node_id in forgotten:  # a churn's links would grow without end
                    self.dissemination.relays.forget_node(node_id)
                if any(pruned.values()):
                    log.info("pruned %s", pruned)
            await trio.sleep(HOUSEKEEPING_S)

    # The job operations of the HTTP API (ports.ApiBackend), done by JobControl.

    def submit_job(self, spec: JobSpec) -> str:
        """Store and start a new job; see :meth:`JobControl.submit`."""
        return self.job_control.submit(spec)

    def cancel_job(self, job_id: str) -> bool:
        """Cancel a job; see :meth:`JobControl.cancel`."""
        return self.job_control.cancel(job_id)

    def job_dir(self, job_id: str) -> Path:
        """The job's folder; see :meth:`JobControl.job_dir`."""
        return self.job_control.job_dir(job_id)

    def learner_command(self, job_id: str) -> list[str]:
        """The job's learner command line; see :meth:`JobControl.learner_command`."""
        return self.job_control.learner_command(job_id)

    def job_schedule(self, job_id: str) -> dict[str, Any]:
        """The job's placement; see :meth:`Placement.job_view`."""
        return self.placement.job_view(job_id)
