"""The node-facing libp2p handlers: register, lease, submit, status, manifest, relay reports.

:class:`NodeRPC` owns what a node may ask of the coordinator. Every handler treats its request as
hostile: it verifies the envelope against the Noise-authenticated peer before it decodes further,
answers with a clear reason, and never lets one peer's bad input stop the daemon. A
:class:`~echo.protocol.errors.ProtocolError` raised in a handler goes back to the peer as a
status-1 reply with its reason code; a rejected submission is a normal reply that says why
(the submit path is :class:`~echo.coordinator.submissions.submit.Submissions`).
"""

from __future__ import annotations

import logging
import time

from libp2p.peer.id import ID

from echo.coordinator.config import AdmissionSection
from echo.coordinator.dissemination.dialbacks import ProbeQueue
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.metrics import Metrics
from echo.coordinator.rpc.budgets import configure_gate
from echo.coordinator.rpc.common import (
    NODE_ACTIVE_S,
    SMALL_REQUEST_BYTES,
    active_nodes,
    admitted,
    open_signed,
)
from echo.coordinator.scheduling.leases import Leases
from echo.coordinator.scheduling.placement import Placement
from echo.coordinator.store import Store
from echo.coordinator.store.rows import NodeRow
from echo.coordinator.submissions.penalties import Penalties
from echo.coordinator.submissions.scoring import Scoring
from echo.coordinator.submissions.submit import Submissions
from echo.p2p.budget import Gate
from echo.p2p.conn_guard import ConnectionGuard
from echo.p2p.host import EchoHost
from echo.protocol import broadcast as b
from echo.protocol import ids, limits
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError, SchemaError, VersionError

log = logging.getLogger("echo.coordinator")



class NodeRPC:
    """The node protocols over the store; ``jobs`` is the live jobs of :class:`JobControl`."""

    def __init__(
        self,
        store: Store,
        jobs: dict[str, RunningJob],
        metrics: Metrics,
        dissemination: Dissemination,
        leases: Leases,
        penalties: Penalties,
        placement: Placement | None = None,
        scoring: Scoring | None = None,
    ) -> None:
        self.store = store
        self.jobs = jobs
        # Which job each node serves (None: every node may serve every job).
        self.placement = placement
        self.metrics = metrics
        self.dissemination = dissemination
        self.leases = leases
        self.penalties = penalties
        # The host's admission gate (set by install): strangers' submissions put them in backoff.
        self.gate: Gate | None = None
        # The host's connection guard (set by install): nodes with accepted work are protected
        # from idle reaping; registering alone is free, so it protects nothing.
        self.guard: ConnectionGuard | None = None
        # The submit path: verification, scoring in the job's sandbox, booking.
        self.submissions = Submissions(store, jobs, metrics, penalties, placement, scoring)
        # Dial-backs only for nodes with accepted work (a churn of free identities cost a
        # second connection each): registrations ask through Dissemination's hook, a node's
        # first accepted group asks again.
        self.probes = ProbeQueue(worked=self._worked)
        self.submissions.on_first_accepted = self.probes.earned

    def install(self, host: EchoHost, admission: AdmissionSection | None = None) -> None:
        """Serve the node protocols on ``host``, budget them per peer and per network prefix
        (``admission``, else its defaults), and book the host's framing violations."""
        self.gate = configure_gate(host.gate, admission or AdmissionSection())
        self.guard = self.penalties.guard = host.guard
        self.submissions.gate, self.submissions.guard = self.gate, self.guard
        small = SMALL_REQUEST_BYTES
        host.set_handler(ids.PROTO_REGISTER, self.handle_register, max_request=small)
        host.set_handler(ids.PROTO_LEASE, self.handle_lease, max_request=small)
        host.set_handler(
            ids.PROTO_SUBMIT, self.submissions.handle, max_request=limits.MAX_MESSAGE_BYTES
        )
        host.set_handler(ids.PROTO_MANIFEST, self.handle_manifest, max_request=small)
        host.set_handler(ids.PROTO_STATUS, self.handle_status, max_request=small)
        host.set_handler(ids.PROTO_BAD_PEER, self.handle_bad_peer, max_request=small)
        host.add_violation_listener(self.penalties.on_violation)

    def _worked(self, node_id: str) -> bool:
        """Whether the node has accepted work and is not excluded."""
        row = self.store.node(node_id)
        return row is not None and row.accepted > 0 and not row.excluded

    def _registered(self, node_id: str) -> NodeRow:
        """The node's row, excluded or not (what it reports is weighed by its standing).

        :raises ProtocolError: UNKNOWN_NODE (see :func:`admitted`).
        """
        node = self.store.node(node_id)
        return node if node is not None else admitted(node)

    async def handle_register(self, peer_id: ID, data: bytes) -> bytes:
        """Register (or re-register) the node; replies with the jobs it can serve.

        Raises VersionError for another protocol version, ProtocolError (NODE_EXCLUDED) for an
        excluded node, and ProtocolError for a bad envelope or record.
        """
        (env, reg), node_id = open_signed(data, m.Register, peer_id), str(peer_id)
        if reg.protocol_version != ids.PROTOCOL_VERSION:
            raise VersionError(
                f"node speaks protocol {reg.protocol_version}, coordinator speaks "
                f"{ids.PROTOCOL_VERSION}: upgrade echo-swarm"
            )
        row = self.store.upsert_node(
            node_id,
            env.signer,
            reg.engine,
            reg.hardware.to_obj(),
            reg.tokens_per_s,
            reg.upload_bps,
            reg.download_bps,
        )
        admitted(row)
        if row.accepted and self.guard is not None:  # also after a coordinator restart
            self.guard.protect(peer_id)
        self.dissemination.relays.registered(node_id, reg.addrs, reg.upload_bps)
        log.info("node %s registered (%s, %.0f tok/s)", node_id[-8:], reg.engine, reg.tokens_per_s)
        # Registrations that need a scheduling pass share one (a churn of identities is not a
        # pass each).
        placed, why = await self.placement.place(node_id, reg) if self.placement else ("", "")
        # Listed after the pass: a job that published version 0 while this registration waited
        # for it is the job the pass placed the node on.
        jobs = self._job_infos()
        placed = placed if placed in {j.job_id for j in jobs} else ""  # the job it serves
        # LoRA jobs on the base of the node's job: served too, with adapter switches.
        shared = self.placement.bases.siblings(placed, [j.job_id for j in jobs]) if placed else []
        return m.encode(
            m.RegisterReply(
                node_id=node_id,
                jobs=jobs,
                message=why or f"welcome to {ids.SOFTWARE}",
                assigned_job=placed,
                base_jobs=shared,
            )
        )

    def _job_infos(self) -> list[m.JobInfo]:
        out = []
        for job_id, job in self.jobs.items():
            row = self.store.job(job_id)
            if row is not None and row.status == "running" and row.current_version >= 0:
                out.append(job.info(row))
        return out

    async def handle_lease(self, peer_id: ID, data: bytes) -> bytes:
        """Leases for a registered node (see :meth:`Leases.grant`).

        Raises ProtocolError: UNKNOWN_NODE, NODE_EXCLUDED, JOB_MISMATCH (unknown job), or for a
        bad envelope or record.
        """
        (_, req), node_id = open_signed(data, m.LeaseRequest, peer_id), str(peer_id)
        node = admitted(self.store.node(node_id))
        job = self.jobs.get(req.job_id)
        row = self.store.job(req.job_id)
        if job is None or row is None:
            raise ProtocolError(f"unknown job {req.job_id}", code=R.JOB_MISMATCH)
        self.store.touch_node(node_id)
        moved = self.placement.moved(node_id, row) if self.placement else None
        return m.encode(moved or self.leases.grant(node, job, row, req))

    async def handle_manifest(self, peer_id: ID, data: bytes) -> bytes:
        """The learner-signed manifest of a job's version (``-1``: the current one).

        Raises ProtocolError: ``unknown_job``, ``no_version``, or for a bad record.
        """
        req = m.decode(m.ManifestRequest, data)
        row = self.store.job(req.job_id)
        if row is None:
            raise ProtocolError(f"unknown job {req.job_id}", code="unknown_job")
        version = row.current_version if req.version < 0 else req.version
        vrow = self.store.version(req.job_id, version)
        if vrow is None:
            raise ProtocolError(f"job {req.job_id} has no version {version}", code="no_version")
        return vrow.manifest

    async def handle_status(self, peer_id: ID, data: bytes) -> bytes:
        """A node's heartbeat: the version it holds (checked against the published digest).

        Raises ProtocolError: UNKNOWN_NODE, or for a bad envelope or record.
        """
        (_, st), node_id = open_signed(data, m.NodeStatus, peer_id), str(peer_id)
        row = self._registered(node_id)
        self.store.touch_node(
            node_id, version=st.version, digest=st.state_digest, tokens_per_s=st.tokens_per_s
        )
        self.dissemination.relays.measured(node_id, st.upload_bps)
        if self.placement is not None:
            self.placement.observed(node_id, st.job_id, st.tokens_per_s, st.version)
        job = self.jobs.get(st.job_id)
        if (
            job is not None
            and st.version >= 0
            and job.ctx.digests.get(st.version) == st.state_digest
        ):
            self.store.record_node_version(st.job_id, node_id, st.version)
            # Its receipt times the relays that fed it: uplinks as receivers measure them.
            self.dissemination.receipts.delivered(
                node_id, st.job_id, st.version, accepted=row.accepted
            )
            if self._all_hold(st.job_id, st.version, node_id, row):
                self.store.mark_all_nodes(st.job_id, st.version, time.time())
        return m.encode(m.StepAck(ok=True))

    def _all_hold(self, job_id: str, version: int, reporter: str, row: NodeRow) -> bool:
        """Whether every active node serving ``job_id`` holds ``version`` (at least one does:
        ``reporter``, just heard from). Reads only the nodes still behind, not every active
        one: each status report asked, and building every active row per report was a tenth
        of the loop under a churn of identities (benchmarks/attack.py)."""

        def serves(node_id: str) -> bool:
            return self.placement is None or self.placement.serves(node_id, job_id)

        since = time.time() - NODE_ACTIVE_S
        if any(serves(n) for n in self.store.active_behind(since, version)):
            return False
        if not row.excluded and serves(reporter):
            return True
        return any(serves(n.node_id) for n in active_nodes(self.store))  # rare: not its job

    async def handle_bad_peer(self, peer_id: ID, data: bytes) -> bytes:
        """A node's report of a relay that sent it a bad chunk (see :class:`Dissemination`).

        Raises ProtocolError: UNKNOWN_NODE, SchemaError for a self-report, or for a bad envelope.
        """
        (_, report), node_id = open_signed(data, b.BadPeerReport, peer_id), str(peer_id)
        row = self._registered(node_id)
        if report.peer_id == node_id:
            raise SchemaError("a node cannot report itself")
        # Only reporters with accepted work count towards a demotion (issue 26, finding 3).
        self.dissemination.reported(node_id, report, accepted=0 if row.excluded else row.accepted)
        return m.encode(m.StepAck(ok=True))
