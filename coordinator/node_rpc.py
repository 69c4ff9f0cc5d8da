"""The node-facing libp2p handlers: register, lease, submit, status, manifest, relay reports.

:class:`NodeRPC` owns what a node may ask of the coordinator. Every handler treats its request as
hostile: it verifies the envelope against the Noise-authenticated peer before it decodes further,
answers with a clear reason, and never lets one peer's bad input stop the daemon. A
:class:`~echo.protocol.errors.ProtocolError` raised in a handler goes back to the peer as a
status-1 reply with its reason code; a rejected submission is a normal reply that says why
(:func:`~echo.coordinator.verify.check_submission` decides, :class:`Penalties` books it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from libp2p.peer.id import ID

from echo.coordinator.budgets import configure_gate
from echo.coordinator.config import AdmissionSection
from echo.coordinator.dissemination import Dissemination
from echo.coordinator.jobs import RunningJob
from echo.coordinator.leases import Leases
from echo.coordinator.metrics import Metrics
from echo.coordinator.penalties import Penalties
from echo.coordinator.rows import LeaseRow, NodeRow
from echo.coordinator.sched_loop import Placement
from echo.coordinator.scoring import TRUSTED_STREAK, Scoring, outcome_summary
from echo.coordinator.store import Store, StoreError
from echo.coordinator.verify import Accepted, Rejected, check_claimed_rewards, check_submission
from echo.p2p.budget import Gate
from echo.p2p.conn_guard import ConnectionGuard
from echo.p2p.host import EchoHost
from echo.p2p.identity import public_key_from_peer_id
from echo.protocol import broadcast as b
from echo.protocol import codec, ids, limits, signing
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError, SchemaError, VersionError
from echo.protocol.jobspec import JobSpec
from echo.protocol.signing import RecordT
from echo.tasks.sandbox import SandboxError, Score
from echo.tasks.scoring import has_advantage

log = logging.getLogger("echo.coordinator")

# A node that has not been heard from for this long no longer counts towards "all nodes hold v".
NODE_ACTIVE_S = 60.0
# Requests other than submissions and step reports are a few hundred bytes.
SMALL_REQUEST_BYTES = 64 * 1024
SOFTWARE = "echo-swarm/0.1.0"
# Under skip_uniform_groups, at most this many batches of no-advantage groups per sampled version
# are set aside; the rest train (as zero-advantage groups), so a version always fills its batch,
# even from a policy that solves, or fails, every prompt.
UNIFORM_BATCHES = 4


def active_nodes(store: Store) -> list[NodeRow]:
    """Nodes heard from within NODE_ACTIVE_S and not excluded (one range of an index, however
    many identities have come and gone)."""
    return store.active_nodes(time.time() - NODE_ACTIVE_S)


def open_signed(data: bytes, cls: type[RecordT], peer_id: ID) -> tuple[signing.Envelope, RecordT]:
    """Open a ``cls`` record that the authenticated peer ``peer_id`` must have signed.

    Raises ProtocolError (a SignatureError for another signer or a bad signature, a SchemaError
    for another kind or a bad record).
    """
    return signing.open_record(data, cls, expected_signer=public_key_from_peer_id(peer_id))


def buffers(spec: JobSpec, rewards: list[float], uniform_so_far: Callable[[], int]) -> bool:
    """Whether an accepted group goes to the batch buffer: always, unless the job skips uniform
    groups, its rewards are all equal (no advantage) and fewer than UNIFORM_BATCHES batches of
    such groups were set aside for its version (``uniform_so_far``, asked only then)."""
    if not spec.skip_uniform_groups or has_advantage(rewards):
        return True
    return uniform_so_far() >= UNIFORM_BATCHES * spec.batch_groups


def submit_reply(store: Store, node_id: str, ok: bool, reason: str, detail: str) -> bytes:
    """The reply to a submission: its verdict and the node's running totals."""
    node = store.node(node_id)
    return m.encode(
        m.SubmitReply(
            accepted=ok,
            reason=reason,
            detail=detail[:250],
            accepted_total=node.accepted if node else 0,
            rejected_total=node.rejected if node else 0,
            rejected_by_reason=store.rejection_counts(node_id) if node else {},
        )
    )


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
        # Rewards are recomputed in each job's sandbox, off the loop, charged to the sender.
        self.scoring = scoring or Scoring()
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

    def install(self, host: EchoHost, admission: AdmissionSection | None = None) -> None:
        """Serve the node protocols on ``host``, budget them per peer and per network prefix
        (``admission``, else its defaults), and book the host's framing violations."""
        self.gate = configure_gate(host.gate, admission or AdmissionSection())
        self.guard = self.penalties.guard = host.guard
        small = SMALL_REQUEST_BYTES
        host.set_handler(ids.PROTO_REGISTER, self.handle_register, max_request=small)
        host.set_handler(ids.PROTO_LEASE, self.handle_lease, max_request=small)
        host.set_handler(ids.PROTO_SUBMIT, self.handle_submit, max_request=limits.MAX_MESSAGE_BYTES)
        host.set_handler(ids.PROTO_MANIFEST, self.handle_manifest, max_request=small)
        host.set_handler(ids.PROTO_STATUS, self.handle_status, max_request=small)
        host.set_handler(ids.PROTO_BAD_PEER, self.handle_bad_peer, max_request=small)
        host.add_violation_listener(self.penalties.on_violation)

    def _registered(self, node_id: str) -> NodeRow:
        node = self.store.node(node_id)
        if node is None:
            raise ProtocolError("register first", code=R.UNKNOWN_NODE)
        return node

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
        if row.excluded:
            raise ProtocolError(
                "this node is excluded after repeated verification failures", code=R.NODE_EXCLUDED
            )
        if row.accepted and self.guard is not None:  # also after a coordinator restart
            self.guard.protect(peer_id)
        self.dissemination.registered(node_id, reg.addrs, reg.upload_bps)
        log.info("node %s registered (%s, %.0f tok/s)", node_id[-8:], reg.engine, reg.tokens_per_s)
        jobs = self._job_infos()
        # Registrations that need a scheduling pass share one (a churn of identities is not a
        # pass each).
        placed, why = await self.placement.place(node_id, reg) if self.placement else ("", "")
        placed = placed if placed in {j.job_id for j in jobs} else ""  # the job it serves
        return m.encode(
            m.RegisterReply(
                node_id=node_id,
                jobs=jobs,
                message=why or f"welcome to {SOFTWARE}",
                assigned_job=placed,
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
        node = self._registered(node_id)
        if node.excluded:
            raise ProtocolError("this node is excluded", code=R.NODE_EXCLUDED)
        job = self.jobs.get(req.job_id)
        row = self.store.job(req.job_id)
        if job is None or row is None:
            raise ProtocolError(f"unknown job {req.job_id}", code=R.JOB_MISMATCH)
        self.store.touch_node(node_id)
        moved = self.placement.moved(node_id, row) if self.placement else None
        return m.encode(moved or self.leases.grant(node, job, row, req))

    async def handle_submit(self, peer_id: ID, data: bytes) -> bytes:
        """Verify and store one group; the reply says accepted or the reason it was not.

        Cost before trust: a peer that is not a registered node, an excluded one, or one with no
        open lease is answered from one indexed read, before anything is decompressed,
        signature-checked or written (a stranger also serves a backoff). Raises nothing for
        bad input: every failure is a rejection reply, booked against the node (and its lease
        closed) when it is a registered node's.
        """
        node_id = str(peer_id)
        node = self.store.node(node_id)
        refused = self._untrusted(node_id, node)
        if refused is not None:
            return refused
        assert node is not None
        t0 = time.perf_counter()
        # The lease check_submission looks up, kept so a rejection can close it without
        # parsing the submission a second time.
        seen: list[LeaseRow] = []

        def lookup_lease(lease_id: str) -> LeaseRow | None:
            row = self.store.lease(lease_id)
            if row is not None:
                seen.append(row)
            return row

        detail = ""
        try:
            if not self.penalties.rate_ok(node_id):
                raise Rejected(R.RATE_LIMITED, "too many submissions per minute")
            if self.scoring.budget_left(node_id) <= 0:
                raise Rejected(
                    R.RATE_LIMITED, "scoring budget spent: your last groups took long to score"
                )
            if codec.is_zstd(data):
                try:
                    data = codec.decompress(data, max_output=limits.MAX_MESSAGE_BYTES)
                except ProtocolError as exc:
                    raise Rejected(R.MALFORMED, str(exc)) from None
            checked = check_submission(
                data,
                peer_key=public_key_from_peer_id(peer_id),
                node_key=node.public_key,
                node_excluded=node.excluded,
                lookup_lease=lookup_lease,
                jobs={k: j.ctx for k, j in self.jobs.items()},
            )
            if checked.lease.node_id != node_id:
                raise Rejected(R.LEASE_NOT_YOURS, "lease was issued to another node")
            t_score = time.perf_counter()
            scores = await self._score(node, checked.lease, checked.texts)
            self.metrics.scoring_seconds.observe(time.perf_counter() - t_score)
            for s in scores:
                if s.outcome != "ok":
                    self.metrics.scoring_failures.labels(outcome=s.outcome).inc()
            detail = outcome_summary(scores)
            result = check_claimed_rewards(checked, [s.value for s in scores])
            self._store_accepted(node_id, data, result)
            if self.guard is not None:
                self.guard.protect(peer_id)
        except Rejected as rej:
            self._book_rejection(node_id, seen[0] if seen else None, rej)
            return submit_reply(self.store, node_id, False, rej.reason, rej.detail)
        finally:
            self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        self.metrics.submissions.labels(result="accepted", reason="ok").inc()
        self.metrics.rollout_tokens.inc(result.tokens)
        if self.placement is not None:  # the node's delivered throughput, counted here
            self.placement.accepted(
                node_id, result.lease.job_id, len(result.submission.completions)
            )
        return submit_reply(self.store, node_id, True, "ok", detail)

    async def _score(self, node: NodeRow, lease: LeaseRow, texts: list[str]) -> list[Score]:
        """The group's scores from its job's sandbox (see :class:`Scoring`).

        :raises Rejected: UNSCORABLE when the job has ended meanwhile or its sandbox cannot
            start (not held against the node).
        """
        job = self.jobs.get(lease.job_id)
        if job is None:
            raise Rejected(R.JOB_MISMATCH, "job is not running")
        try:
            return await self.scoring.score(
                job.scorer,
                node.node_id,
                lease.prompt_id,
                texts,
                trusted=node.streak >= TRUSTED_STREAK,
                context=job.ctx.task.scoring_context(lease.prompt_id),
            )
        except SandboxError as exc:
            log.error("job %s cannot score: %s", lease.job_id, exc)
            raise Rejected(R.UNSCORABLE, "the coordinator cannot score this job now") from None

    def _untrusted(self, node_id: str, node: NodeRow | None) -> bytes | None:
        """The reply to a submission not worth reading (None: it is a registered, admitted node
        with an open lease). Writes nothing; strangers also serve a backoff."""
        if node is None:
            reason, detail, punish = R.UNKNOWN_NODE, "register before submitting", True
        elif node.excluded:
            # No backoff: it keeps getting the clear answer (one read, no write) it can show.
            reason, detail, punish = (
                R.NODE_EXCLUDED,
                "this node failed verification too often",
                False,
            )
        elif not self.store.has_open_lease(node_id):
            reason, detail, punish = R.UNKNOWN_LEASE, "no open lease: ask for one first", False
        else:
            return None
        if punish and self.gate is not None:
            self.gate.punish(node_id)
        self.metrics.submissions.labels(result="refused", reason=reason).inc()
        log.debug("submission from %s refused unread: %s", node_id[-8:], reason)
        return submit_reply(self.store, node_id, False, reason, detail)

    def _book_rejection(self, node_id: str, lease: LeaseRow | None, rej: Rejected) -> None:
        """Record a registered node's rejected submission; close its lease unless a duplicate."""
        lease_id = job_id = ""
        if lease is not None and lease.node_id == node_id:
            lease_id, job_id = lease.lease_id, lease.job_id
            if rej.reason != R.DUPLICATE:
                self.store.close_lease(lease_id)
        self.store.record_rejection(
            job_id,
            node_id,
            lease_id,
            rej.reason,
            rej.detail,
            counts_against=rej.reason in R.COUNTS_AGAINST,
        )
        self.penalties.maybe_exclude(node_id)
        self.metrics.submissions.labels(result="rejected", reason=rej.reason).inc()
        log.info("rejected %s from %s: %s", lease_id or "?", node_id[-8:], rej)

    def _store_accepted(self, node_id: str, data: bytes, result: Accepted) -> None:
        """Store the verified group decoded (a batch reads it back), its envelope for audit;
        under the job's ``skip_uniform_groups``, one whose rewards are all equal is stored
        without being buffered (see :func:`buffers`)."""
        job = self.jobs.get(result.lease.job_id)
        buffered = job is None or buffers(
            job.spec,
            result.rewards,
            lambda: self.store.uniform_count(result.lease.job_id, result.submission.version),
        )
        try:
            self.store.accept_rollout(
                lease_id=result.lease.lease_id,
                job_id=result.lease.job_id,
                node_id=node_id,
                version=result.submission.version,
                prompt_id=result.lease.prompt_id,
                engine=result.submission.engine,
                completions=result.submission.completions,
                rewards=result.rewards,
                tokens=result.tokens,
                content_hash=result.content_hash,
                envelope=data,
                buffered=buffered,
            )
        except StoreError as exc:
            raise Rejected(R.DUPLICATE, str(exc)) from None

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
        self.dissemination.measured(node_id, st.upload_bps)
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
            self.dissemination.delivered(node_id, st.job_id, st.version, accepted=row.accepted)
            active = [  # "every node holds v": every node serving this job
                n
                for n in active_nodes(self.store)
                if self.placement is None or self.placement.serves(n.node_id, st.job_id)
            ]
            if active and all(n.version >= st.version for n in active):
                self.store.mark_all_nodes(st.job_id, st.version, time.time())
        return m.encode(m.StepAck(ok=True))

    async def handle_bad_peer(self, peer_id: ID, data: bytes) -> bytes:
        """A node's report of a relay that sent it a bad chunk (see :class:`Dissemination`).

        Raises ProtocolError: UNKNOWN_NODE, SchemaError for a self-report, or for a bad envelope.
        """
        (_, report), node_id = open_signed(data, b.BadPeerReport, peer_id), str(peer_id)
        row = self._registered(node_id)
        if report.peer_id == node_id:
            raise SchemaError("a node cannot report itself")
        # Only reporters with accepted work count towards a demotion (issue 26, finding 3).
        self.dissemination.reported(
            node_id, report, accepted=0 if row.excluded else row.accepted
        )
        return m.encode(m.StepAck(ok=True))
