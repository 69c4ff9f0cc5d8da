"""The coordinator's learner-facing libp2p handlers: attach, take a batch, publish a version.

:class:`LearnerRPC` owns what a job's learner may ask: only the key the job pins may sign these
requests, and only with the job's newest learner epoch (:mod:`~echo.coordinator.store.epochs`),
so of two learners holding that key only the one the coordinator last started is heard. A step
report is booked in one store transaction (the trained rollouts, the re-scoring rejections, the
new version), then the version's broadcast is planned over the nodes active now
and announced; the learner gets the signed plan in its acknowledgement and pushes down it.
A :class:`~echo.protocol.errors.ProtocolError` raised here goes back as a status-1 reply.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import TypeVar

import trio
from libp2p.peer.id import ID

from echo.coordinator.config import BroadcastSection
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.metrics import Metrics
from echo.coordinator.rpc.common import SMALL_REQUEST_BYTES, active_nodes, open_signed
from echo.coordinator.scheduling.placement import Placement
from echo.coordinator.store import Store, StoreError
from echo.coordinator.submissions.penalties import Penalties
from echo.p2p.host import EchoHost
from echo.p2p.identity import Identity
from echo.protocol import ids, limits, signing
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError, SchemaError, SignatureError

log = logging.getLogger("echo.coordinator")

# A batch reply's own fields around its groups (current version, flags, list header).
REPLY_OVERHEAD = 256

# The signed requests a learner sends; each names its job.
LearnerRecord = TypeVar("LearnerRecord", m.LearnerHello, m.BatchRequest, m.StepReport)


class LearnerRPC:
    """The learner protocols; ``jobs`` is the live jobs of :class:`JobControl`."""

    def __init__(
        self,
        store: Store,
        jobs: dict[str, RunningJob],
        metrics: Metrics,
        identity: Identity,
        dissemination: Dissemination,
        broadcast: BroadcastSection,
        penalties: Penalties,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.metrics = metrics
        self.identity = identity
        self.dissemination = dissemination
        self.broadcast = broadcast
        self.penalties = penalties
        # Which learner of each job may speak (durable: a restart keeps refusing old ones).
        self._host: EchoHost | None = None
        # Bytes one batch reply may take; lowered only to exercise multi-reply batches.
        self.batch_reply_bytes = limits.MAX_BATCH_REPLY_BYTES
        # Which job each node serves (set by the service): a version's relay trees take only
        # the nodes serving its job (holding one of its versions, unless it is an anchor).
        # None: every active node.
        self.placement: Placement | None = None

    def install(self, host: EchoHost) -> None:
        """Serve the learner protocols on ``host``, which also gossips version announcements."""
        self._host = host
        small = SMALL_REQUEST_BYTES
        host.set_handler(ids.PROTO_LEARNER_HELLO, self.handle_learner_hello, max_request=small)
        host.set_handler(
            ids.PROTO_LEARNER_BATCH,
            self.handle_learner_batch,
            max_request=small,
            max_response=limits.MAX_BATCH_REPLY_BYTES,
        )
        host.set_handler(
            ids.PROTO_LEARNER_REPORT,
            self.handle_learner_report,
            max_request=limits.MAX_MESSAGE_BYTES,
        )

    def _open(
        self, data: bytes, cls: type[LearnerRecord], peer_id: ID
    ) -> tuple[RunningJob, LearnerRecord]:
        """The live job a learner request names and the request, a ``cls`` record.

        Raises SchemaError for an unknown job or a bad record, SignatureError unless the job's
        pinned learner key signed it (and the peer is that key), ProtocolError for a bad envelope
        or a learner epoch that is not the job's newest (:meth:`_check_epoch`).
        """
        env, rec = open_signed(data, cls, peer_id)
        job_id = rec.job_id
        row = self.store.job(job_id)
        if row is None or job_id not in self.jobs:
            raise SchemaError(f"unknown job {job_id!r}")
        if row.learner_pubkey is None or row.learner_pubkey != env.signer:
            raise SignatureError("not the learner key this job pins")
        self._check_epoch(job_id, rec.epoch)
        return self.jobs[job_id], rec

    def _check_epoch(self, job_id: str, epoch: int) -> None:
        """Refuse a request from any learner but the job's newest: its ``epoch`` must be the
        last one issued (:mod:`~echo.coordinator.store.epochs`). The key alone cannot tell two
        learners apart (both hold it): a superseded one, however far its versions run ahead,
        books nothing, takes no batch, and cannot re-attach (which would return the current
        learner's batch to the buffer).

        :raises ProtocolError: code :data:`~echo.protocol.messages.LEARNER_EPOCH_REFUSED`, the
            message says whether ``epoch`` was superseded or never issued.
        """
        current = self.store.learner_epoch(job_id)
        if epoch == current:
            return
        if epoch < current:
            why = f"was superseded by epoch {current}: another learner holds job {job_id}"
        else:
            why = f"was never issued for job {job_id} (the newest is {current})"
        raise ProtocolError(f"learner epoch {epoch} {why}", code=m.LEARNER_EPOCH_REFUSED)

    async def handle_learner_hello(self, peer_id: ID, data: bytes) -> bytes:
        """Attach the learner (where nodes fetch from); its unreported batch returns to the buffer.

        Raises what :meth:`_open` raises, SchemaError for a bad record.
        """
        _, hello = self._open(data, m.LearnerHello, peer_id)
        row = self.store.job(hello.job_id)
        assert row is not None and row.learner_pubkey is not None  # checked by _open
        self.store.attach_learner(hello.job_id, row.learner_pubkey, str(peer_id), list(hello.addrs))
        if self._host is not None:  # the learner's connection is never reaped as idle
            self._host.guard.protect(peer_id)
        row = self.store.job(hello.job_id)
        assert row is not None
        log.info(
            "learner %s attached to job %s at v%d",
            str(peer_id)[-8:],
            hello.job_id,
            row.current_version,
        )
        return m.encode(
            m.LearnerHelloReply(
                current_version=row.current_version, cancelled=row.status == "cancelled"
            )
        )

    async def handle_learner_batch(self, peer_id: ID, data: bytes) -> bytes:
        """Hand the learner up to ``max_groups`` buffered groups (none unless the job runs).

        A reply holds at most as many groups as fit :attr:`batch_reply_bytes` at the job's
        group size and completion length (bounded before any group is read) and says, with
        ``more``, when further groups wait: the learner asks again. Each group goes out as it
        was encoded when it was accepted (its prompt as its lease carried it): nothing is
        decoded or rendered again here. Raises what :meth:`_open` raises, SchemaError for a bad
        record.
        """
        job, req = self._open(data, m.BatchRequest, peer_id)
        row = self.store.job(req.job_id)
        assert row is not None  # checked by _open
        if row.status != "running":
            return m.encode_batch_reply(
                [], row.current_version, cancelled=row.status == "cancelled"
            )
        per_group = m.training_group_bound(job.spec.group_size, job.max_new_tokens)
        fit = max(1, (self.batch_reply_bytes - REPLY_OVERHEAD) // per_group)
        taken = self.store.take_batch(req.job_id, min(req.max_groups, fit), req.min_version)
        # The budget, not the buffer, may have cut this reply: then the learner asks again at once.
        more = len(taken) == fit < req.max_groups
        return m.encode_batch_reply([g.group for g in taken], row.current_version, more=more)

    async def handle_learner_report(self, peer_id: ID, data: bytes) -> bytes:
        """Publish the version a learner trained, then plan and announce its broadcast.

        A report the ledger refuses (:class:`StoreError`) is a ``StepAck(ok=False)`` that says
        why. Raises what :meth:`_open` raises, SchemaError for a bad record or a manifest that is
        not the report's, SignatureError for a manifest not signed by the job's learner key.
        """
        job, rep = self._open(data, m.StepReport, peer_id)
        row = self.store.job(rep.job_id)
        assert row is not None and row.learner_pubkey is not None  # checked by _open
        _, man = signing.open_record(rep.manifest, m.Manifest, expected_signer=row.learner_pubkey)
        if man.job_id != rep.job_id or man.version != rep.version:
            raise SchemaError("manifest does not match the report")
        rejected = [
            (v.rollout_id, v.reason or R.RESCORE_MISMATCH, json.dumps(v.stats))
            for v in rep.verdicts
            if not v.ok
        ]
        try:
            self.store.publish_version(
                rep.job_id,
                rep.version,
                kind=man.kind,
                manifest=rep.manifest,
                state_digest=man.state_digest,
                total_size=man.total_size,
                trained=list(rep.trained),
                rejected=rejected,
                metrics=dict(rep.metrics),
            )
        except StoreError as exc:
            return m.encode(m.StepAck(ok=False, message=str(exc)[:250]))
        job.ctx.current_version = rep.version
        job.ctx.digests[rep.version] = man.state_digest
        for rid, _, _ in rejected:
            node_id = self.store.rollout_node(rid)
            if node_id is not None:
                self.penalties.maybe_exclude(node_id)
        self.metrics.versions_published.inc()
        self.metrics.current_version.labels(job=rep.job_id).set(rep.version)
        if "eval_accuracy" in rep.metrics:
            self.metrics.eval_accuracy.labels(job=rep.job_id).set(rep.metrics["eval_accuracy"])
        if "staleness_mean" in rep.metrics:
            self.metrics.staleness_mean.labels(job=rep.job_id).set(rep.metrics["staleness_mean"])
        for v in rep.verdicts:
            if not v.ok:
                self.metrics.submissions.labels(result="rejected", reason=v.reason).inc()
        if rep.version >= job.spec.steps:
            self.store.set_job_status(rep.job_id, "done")
            log.info("job %s done at v%d", rep.job_id, rep.version)
        assert self._host is not None, "install() first"
        plan = await self._plan_broadcast(man, rep.manifest)
        if plan:
            try:
                await self._host.publish(ids.TOPIC_VERSIONS, plan)
            except Exception as exc:  # nodes not reached learn the version from leases and pull
                log.debug("version announcement failed: %s", exc)
        return m.encode(m.StepAck(ok=True, plan=plan))

    async def _plan_broadcast(self, man: m.Manifest, manifest_env: bytes) -> bytes:
        """The signed PlanAnnouncement of a new version (empty when there is nobody to plan).

        The planner is pure CPU (a second or more for a hundred nodes): it runs in a worker
        thread on inputs read here, so the event loop keeps serving nodes meanwhile."""
        if not self.broadcast.enabled:
            return b""
        row = self.store.job(man.job_id)
        assert row is not None  # the report that published this version named it
        nodes = [
            n.node_id
            for n in active_nodes(self.store)
            if self.placement is None
            or self.placement.plannable(n.node_id, man.job_id, man.kind == "anchor")
        ]
        # Nodes without an accepted group receive but relay to nobody (Placement.proven).
        placement = self.placement
        leaves = [] if placement is None else [n for n in nodes if not placement.proven(n)]
        ann = await trio.to_thread.run_sync(
            functools.partial(
                self.dissemination.plan,
                man.job_id,
                man.version,
                manifest_env,
                man.total_size,
                chunk_bytes=max((c.size for c in man.chunks), default=1),
                source=row.learner_peer_id,
                source_addrs=row.learner_addrs,
                nodes=nodes,
                leaves=leaves,
            )
        )
        if ann is None:
            return b""
        return signing.seal_record(self.identity.private_key, ann)
