"""The coordinator daemon: libp2p handlers for nodes and learners, over the SQLite store.

:class:`Coordinator` owns the store, the per-job runtime contexts and the learner supervisors.
:meth:`Coordinator.run` owns the libp2p host, the HTTP server and every background task in one
nursery; cancelling it (Ctrl-C) stops the learners, closes the host and returns.

Every handler treats its request as hostile: it verifies before it decodes further, answers
with a clear reason, and never lets one peer's bad input stop the daemon. A
:class:`~echo.protocol.errors.ProtocolError` raised in a handler goes back to the peer as a
status-1 reply with its reason code.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from collections import defaultdict, deque
from pathlib import Path

import trio

from echo.coordinator import reasons as R
from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.dissemination import Dissemination
from echo.coordinator.jobs import RunningJob, load_running_job
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import LeaseRow, Store, StoreError
from echo.coordinator.verify import Accepted, Rejected, check_submission
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.protocol import broadcast as b
from echo.protocol import codec, ids, limits, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError, SchemaError, SignatureError, VersionError
from echo.protocol.jobspec import JobSpec

log = logging.getLogger("echo.coordinator")

# A node that has not been heard from for this long no longer counts towards "all nodes hold v".
NODE_ACTIVE_S = 60.0
# Leases ask the node to come back this soon when there is no work (the learner is busy).
IDLE_RETRY_S = 0.5
SOFTWARE = "echo-swarm/0.1.0"


class Coordinator:
    def __init__(self, config: CoordinatorConfig, store: Store, identity: Identity) -> None:
        self.config = config
        self.store = store
        self.identity = identity
        self.token = config.ensure_token()
        self.jobs: dict[str, RunningJob] = {}
        self.metrics = Metrics()
        bc = config.broadcast
        self.dissemination = Dissemination(
            learner_upload_bps=bc.learner_upload_bps,
            default_node_upload_bps=bc.default_node_upload_bps,
            max_fanout=bc.max_fanout,
            max_stripes=bc.max_stripes,
        )
        self.host: EchoHost | None = None
        self.http_addrs: list[str] = []
        self._nursery: trio.Nursery | None = None
        self._learner_scopes: dict[str, trio.CancelScope] = {}
        self._submit_times: dict[str, deque[float]] = defaultdict(deque)
        self._started = trio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from echo.coordinator.api import serve_http
        from echo.coordinator.learners import supervise_learner

        self._supervise = supervise_learner
        async with open_host(self.identity, self.config.listen) as host:
            self.host = host
            self._install_handlers(host)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.http_addrs = await nursery.start(serve_http, self)
                for row in self.store.jobs(["pending", "running"]):
                    self._start_job(row["job_id"])
                nursery.start_soon(self._housekeeping)
                self._started.set()
                task_status.started(self)
                await trio.sleep_forever()

    @property
    def multiaddrs(self) -> list[str]:
        return self.host.listen_multiaddrs if self.host else []

    def _start_job(self, job_id: str) -> None:
        self.jobs[job_id] = load_running_job(self.store, job_id)
        if self.config.learner.local and self.store.job(job_id)["learner_pubkey"] is not None:
            scope = trio.CancelScope()
            self._learner_scopes[job_id] = scope
            assert self._nursery is not None
            self._nursery.start_soon(self._supervise, self, job_id, scope)

    async def _housekeeping(self) -> None:
        while True:
            expired = self.store.expire_leases(time.time())
            if expired:
                self.metrics.leases_expired.inc(expired)
            self.metrics.nodes_active.set(len(self._active_nodes()))
            await trio.sleep(1.0)

    def _active_nodes(self) -> list:
        """Nodes heard from within NODE_ACTIVE_S and not excluded (store rows)."""
        now = time.time()
        return [
            n
            for n in self.store.nodes()
            if not n["excluded"] and now - n["last_seen"] < NODE_ACTIVE_S
        ]

    # ------------------------------------------------------------------ jobs (HTTP API)

    def submit_job(self, spec: JobSpec) -> str:
        job_id = f"{spec.name[:32]}-{secrets.token_hex(4)}"
        job_dir = self.job_dir(job_id)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "job.json").write_text(spec.model_dump_json(indent=2))
        self.store.create_job(job_id, spec.name, spec.model_dump(mode="json"))
        if spec.learner_public_key:
            pub = bytes.fromhex(spec.learner_public_key)
        else:
            pub = Identity.load_or_create(job_dir / "learner.key").public_key_bytes
        self.store.set_learner_key(job_id, pub)
        self._start_job(job_id)
        self.metrics.jobs_submitted.inc()
        log.info("job %s submitted (%s, %d steps)", job_id, spec.task.name, spec.steps)
        return job_id

    def cancel_job(self, job_id: str) -> bool:
        row = self.store.job(job_id)
        if row is None or row["status"] in ("done", "cancelled", "failed"):
            return False
        self.store.set_job_status(job_id, "cancelled")
        scope = self._learner_scopes.get(job_id)
        if scope is not None:
            scope.cancel()
        return True

    def job_dir(self, job_id: str) -> Path:
        return self.config.data_dir / "jobs" / job_id

    def learner_command(self, job_id: str) -> list[str]:
        import sys

        cmd = [
            sys.executable,
            "-m",
            "echo.learner",
            "--job-dir",
            str(self.job_dir(job_id)),
            "--job-id",
            job_id,
            "--coordinator",
            self.multiaddrs[0],
            "--threads",
            str(self.config.learner.torch_threads),
        ]
        bc = self.config.broadcast
        if bc.learner_pace > 0:
            cmd += ["--upload-limit-bps", str(bc.learner_pace * bc.learner_upload_bps)]
        return cmd

    # ------------------------------------------------------------------ handlers

    def _install_handlers(self, host: EchoHost) -> None:
        small = 64 * 1024
        host.set_handler(ids.PROTO_REGISTER, self.handle_register, max_request=small)
        host.set_handler(ids.PROTO_LEASE, self.handle_lease, max_request=small)
        host.set_handler(ids.PROTO_SUBMIT, self.handle_submit, max_request=limits.MAX_MESSAGE_BYTES)
        host.set_handler(ids.PROTO_MANIFEST, self.handle_manifest, max_request=small)
        host.set_handler(ids.PROTO_STATUS, self.handle_status, max_request=small)
        host.set_handler(ids.PROTO_BAD_PEER, self.handle_bad_peer, max_request=small)
        host.set_handler(ids.PROTO_LEARNER_HELLO, self.handle_learner_hello, max_request=small)
        host.set_handler(ids.PROTO_LEARNER_BATCH, self.handle_learner_batch, max_request=small)
        host.set_handler(
            ids.PROTO_LEARNER_REPORT,
            self.handle_learner_report,
            max_request=limits.MAX_MESSAGE_BYTES,
        )
        host.add_violation_listener(self._on_violation)

    def _on_violation(self, peer_id, error: ProtocolError) -> None:
        node_id = str(peer_id)
        self.metrics.violations.labels(code=error.code).inc()
        if self.store.node(node_id) is not None:
            self.store.record_rejection(
                "", node_id, "", R.MALFORMED, str(error), counts_against=True
            )
            self._maybe_exclude(node_id)
        log.warning("framing violation from %s: %s", node_id, error)

    def _node_key(self, peer_id) -> bytes:
        return public_key_from_peer_id(peer_id)

    def _open_from_node(self, data: bytes, kind: str, peer_id) -> tuple[signing.Envelope, str]:
        env = signing.open_envelope(data, kind=kind, expected_signer=self._node_key(peer_id))
        return env, str(peer_id)

    async def handle_register(self, peer_id, data: bytes) -> bytes:
        env, node_id = self._open_from_node(data, "register", peer_id)
        reg = m.from_obj(m.Register, env.decode_body())
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
        if row["excluded"]:
            raise ProtocolError(
                "this node is excluded after repeated verification failures", code=R.NODE_EXCLUDED
            )
        self.dissemination.registered(node_id, reg.addrs, reg.upload_bps)
        log.info("node %s registered (%s, %.0f tok/s)", node_id[-8:], reg.engine, reg.tokens_per_s)
        return m.encode(
            m.RegisterReply(
                node_id=node_id, jobs=self._job_infos(), message=f"welcome to {SOFTWARE}"
            )
        )

    def _job_infos(self) -> list[m.JobInfo]:
        out = []
        for job_id, job in self.jobs.items():
            row = self.store.job(job_id)
            if row["status"] == "running" and row["current_version"] >= 0:
                out.append(job.info(row))
        return out

    async def handle_lease(self, peer_id, data: bytes) -> bytes:
        env, node_id = self._open_from_node(data, "lease_request", peer_id)
        req = m.from_obj(m.LeaseRequest, env.decode_body())
        node = self.store.node(node_id)
        if node is None:
            raise ProtocolError("register first", code=R.UNKNOWN_NODE)
        if node["excluded"]:
            raise ProtocolError("this node is excluded", code=R.NODE_EXCLUDED)
        job = self.jobs.get(req.job_id)
        row = self.store.job(req.job_id)
        if job is None or row is None:
            raise ProtocolError(f"unknown job {req.job_id}", code=R.JOB_MISMATCH)
        self.store.touch_node(node_id)
        current = int(row["current_version"])
        if row["status"] != "running" or current < 0:
            return m.encode(
                m.LeaseReply(
                    leases=[],
                    current_version=current,
                    retry_after_s=2.0,
                    message=f"job is {row['status']}",
                )
            )
        min_version = max(0, current - job.spec.staleness + 1)
        if req.have_version < min_version:
            return m.encode(
                m.LeaseReply(
                    leases=[],
                    current_version=current,
                    retry_after_s=0.2,
                    message=f"update to v{current} first",
                )
            )
        n = self._lease_budget(req.job_id, node_id, job, req.max_leases, int(node["streak"]))
        if n <= 0:
            return m.encode(
                m.LeaseReply(
                    leases=[],
                    current_version=current,
                    retry_after_s=IDLE_RETRY_S,
                    message="buffer full",
                )
            )
        now = time.time()
        rows, sealed = [], []
        for prompt_id in self.store.next_prompt_ids(req.job_id, n):
            lease = m.Lease(
                lease_id=secrets.token_hex(12),
                job_id=req.job_id,
                node_id=node_id,
                prompt_id=prompt_id,
                group_size=job.spec.group_size,
                sampling=m.SamplingSpec(
                    max_new_tokens=job.max_new_tokens,
                    temperature=job.spec.sampling.temperature,
                    top_p=job.spec.sampling.top_p,
                    seed=secrets.randbits(63),
                ),
                min_version=min_version,
                issued_at=now,
                deadline=now + self.config.verification.lease_timeout_s,
            )
            rows.append(
                LeaseRow(
                    lease.lease_id,
                    lease.job_id,
                    node_id,
                    prompt_id,
                    lease.group_size,
                    lease.sampling.max_new_tokens,
                    lease.sampling.seed,
                    min_version,
                    now,
                    lease.deadline,
                    "open",
                )
            )
            sealed.append(signing.seal(self.identity.private_key, "lease", lease.to_obj()))
        self.store.add_leases(rows)
        self.metrics.leases_issued.inc(len(rows))
        return m.encode(m.LeaseReply(leases=sealed, current_version=current, retry_after_s=0.0))

    def _lease_budget(
        self, job_id: str, node_id: str, job: RunningJob, wanted: int, streak: int
    ) -> int:
        """How many new leases keep the buffer near its target without starving other nodes.

        A node's quota grows with its run of valid results (one more open lease per
        ``lease_quota_ramp`` valid groups): identities are free, so a fresh one, honest or not,
        cannot tie up more than one lease of the buffer before it has proven itself.
        """
        cfg = self.config.verification
        target = cfg.buffer_groups or 2 * job.spec.batch_groups
        in_flight = self.store.open_lease_count(job_id) + self.store.buffered_count(job_id)
        quota = cfg.max_open_leases_per_node
        if cfg.lease_quota_ramp:
            quota = min(quota, 1 + streak // cfg.lease_quota_ramp)
        per_node = quota - self.store.open_lease_count(job_id, node_id)
        return max(0, min(wanted, per_node, target - in_flight))

    async def handle_submit(self, peer_id, data: bytes) -> bytes:
        node_id = str(peer_id)
        t0 = time.perf_counter()
        node = self.store.node(node_id)
        lease_id, job_id = "", ""
        try:
            if codec.is_zstd(data):
                try:
                    data = codec.decompress(data, max_output=limits.MAX_MESSAGE_BYTES)
                except ProtocolError as exc:
                    raise Rejected(R.MALFORMED, str(exc)) from None
            if not self._rate_ok(node_id):
                raise Rejected(R.RATE_LIMITED, "too many submissions per minute")
            result = check_submission(
                data,
                peer_key=self._node_key(peer_id),
                node_key=bytes(node["public_key"]) if node is not None else None,
                node_excluded=bool(node["excluded"]) if node is not None else False,
                lookup_lease=self.store.lease,
                jobs={k: j.ctx for k, j in self.jobs.items()},
            )
            lease_id, job_id = result.lease.lease_id, result.lease.job_id
            if result.lease.node_id != node_id:
                raise Rejected(R.LEASE_NOT_YOURS, "lease was issued to another node")
            self._store_accepted(node_id, data, result)
        except Rejected as rej:
            lease = self._lease_of(data) if not lease_id else None
            if lease is not None and lease.node_id == node_id:
                lease_id, job_id = lease.lease_id, lease.job_id
                if rej.reason not in (R.DUPLICATE,):
                    self.store.close_lease(lease_id)
            if node is not None:
                self.store.record_rejection(
                    job_id,
                    node_id,
                    lease_id,
                    rej.reason,
                    rej.detail,
                    counts_against=rej.reason in R.COUNTS_AGAINST,
                )
                self._maybe_exclude(node_id)
            self.metrics.submissions.labels(result="rejected", reason=rej.reason).inc()
            log.info("rejected %s from %s: %s", lease_id or "?", node_id[-8:], rej)
            return self._submit_reply(node_id, False, rej.reason, rej.detail)
        finally:
            self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        self.metrics.submissions.labels(result="accepted", reason="ok").inc()
        self.metrics.rollout_tokens.inc(result.tokens)
        return self._submit_reply(node_id, True, "ok", "")

    def _store_accepted(self, node_id: str, data: bytes, result: Accepted) -> None:
        try:
            self.store.accept_rollout(
                lease_id=result.lease.lease_id,
                job_id=result.lease.job_id,
                node_id=node_id,
                version=result.submission.version,
                prompt_id=result.lease.prompt_id,
                rewards=result.rewards,
                tokens=result.tokens,
                content_hash=result.content_hash,
                envelope=data,
            )
        except StoreError as exc:
            raise Rejected(R.DUPLICATE, str(exc)) from None

    def _lease_of(self, data: bytes) -> LeaseRow | None:
        """Best-effort: the lease a (rejected) submission names, to close it and log against it."""
        try:
            body = m.from_obj(
                m.Submission, signing.open_envelope(data, kind="submission").decode_body()
            )
        except ProtocolError:
            return None
        return self.store.lease(body.lease_id)

    def _submit_reply(self, node_id: str, ok: bool, reason: str, detail: str) -> bytes:
        node = self.store.node(node_id)
        return m.encode(
            m.SubmitReply(
                accepted=ok,
                reason=reason,
                detail=detail[:250],
                accepted_total=int(node["accepted"]) if node else 0,
                rejected_total=int(node["rejected"]) if node else 0,
                rejected_by_reason=self.store.rejection_counts(node_id) if node else {},
            )
        )

    def _rate_ok(self, node_id: str) -> bool:
        window = self._submit_times[node_id]
        now = time.monotonic()
        while window and now - window[0] > 60.0:
            window.popleft()
        if len(window) >= self.config.verification.submissions_per_minute:
            return False
        window.append(now)
        return True

    def _maybe_exclude(self, node_id: str) -> None:
        node = self.store.node(node_id)
        if (
            node is not None
            and not node["excluded"]
            and node["failures"] >= self.config.verification.exclude_after_failures
        ):
            self.store.set_excluded(node_id, True)
            self.metrics.nodes_excluded.inc()
            log.warning("node %s excluded after %d failures", node_id[-8:], node["failures"])

    async def handle_manifest(self, peer_id, data: bytes) -> bytes:
        req = m.decode(m.ManifestRequest, data)
        row = self.store.job(req.job_id)
        if row is None:
            raise ProtocolError(f"unknown job {req.job_id}", code="unknown_job")
        version = int(row["current_version"]) if req.version < 0 else req.version
        vrow = self.store.version(req.job_id, version)
        if vrow is None:
            raise ProtocolError(f"job {req.job_id} has no version {version}", code="no_version")
        return bytes(vrow["manifest"])

    async def handle_status(self, peer_id, data: bytes) -> bytes:
        env, node_id = self._open_from_node(data, "node_status", peer_id)
        st = m.from_obj(m.NodeStatus, env.decode_body())
        if self.store.node(node_id) is None:
            raise ProtocolError("register first", code=R.UNKNOWN_NODE)
        self.store.touch_node(
            node_id, version=st.version, digest=st.state_digest, tokens_per_s=st.tokens_per_s
        )
        self.dissemination.measured(node_id, st.upload_bps)
        job = self.jobs.get(st.job_id)
        if (
            job is not None
            and st.version >= 0
            and job.ctx.digests.get(st.version) == st.state_digest
        ):
            self.store.record_node_version(st.job_id, node_id, st.version)
            self._check_all_nodes(st.job_id, st.version)
        return m.encode(m.StepAck(ok=True))

    async def handle_bad_peer(self, peer_id, data: bytes) -> bytes:
        env, node_id = self._open_from_node(data, "bad_peer", peer_id)
        report = b.from_obj(b.BadPeerReport, env.decode_body())
        if self.store.node(node_id) is None:
            raise ProtocolError("register first", code=R.UNKNOWN_NODE)
        if report.peer_id == node_id:
            raise SchemaError("a node cannot report itself")
        self.dissemination.reported(node_id, report)
        return m.encode(m.StepAck(ok=True))

    async def _plan_broadcast(self, man: m.Manifest, manifest_env: bytes) -> bytes:
        """The signed PlanAnnouncement of a new version (empty when there is nobody to plan).

        The planner is pure CPU (a second or more for a hundred nodes): it runs in a worker
        thread on inputs read here, so the event loop keeps serving nodes meanwhile."""
        if not self.config.broadcast.enabled:
            return b""
        row = self.store.job(man.job_id)
        ann = await trio.to_thread.run_sync(
            functools.partial(
                self.dissemination.plan,
                man.job_id,
                man.version,
                manifest_env,
                man.total_size,
                chunk_bytes=max((c.size for c in man.chunks), default=1),
                source=row["learner_peer_id"],
                source_addrs=json.loads(row["learner_addrs_json"]),
                nodes=[n["node_id"] for n in self._active_nodes()],
            )
        )
        if ann is None:
            return b""
        return signing.seal(self.identity.private_key, "broadcast_plan", ann.to_obj())

    def _check_all_nodes(self, job_id: str, version: int) -> None:
        active = self._active_nodes()
        if active and all(n["version"] >= version for n in active):
            self.store.mark_all_nodes(job_id, version, time.time())

    # ------------------------------------------------------------------ learner handlers

    def _open_from_learner(self, data: bytes, kind: str, peer_id) -> tuple[RunningJob, object]:
        raw = signing.open_envelope(data, kind=kind, expected_signer=self._node_key(peer_id))
        body = raw.decode_body()
        job_id = body.get("job_id") if isinstance(body, dict) else None
        row = self.store.job(job_id) if isinstance(job_id, str) else None
        if row is None or job_id not in self.jobs:
            raise SchemaError(f"unknown job {job_id!r}")
        if row["learner_pubkey"] is None or bytes(row["learner_pubkey"]) != raw.signer:
            raise SignatureError("not the learner key this job pins")
        return self.jobs[job_id], body

    async def handle_learner_hello(self, peer_id, data: bytes) -> bytes:
        job, body = self._open_from_learner(data, "learner_hello", peer_id)
        hello = m.from_obj(m.LearnerHello, body)
        row = self.store.job(hello.job_id)
        self.store.attach_learner(
            hello.job_id, bytes(row["learner_pubkey"]), str(peer_id), list(hello.addrs)
        )
        row = self.store.job(hello.job_id)
        log.info(
            "learner %s attached to job %s at v%d",
            str(peer_id)[-8:],
            hello.job_id,
            row["current_version"],
        )
        return m.encode(
            m.LearnerHelloReply(
                current_version=int(row["current_version"]), cancelled=row["status"] == "cancelled"
            )
        )

    async def handle_learner_batch(self, peer_id, data: bytes) -> bytes:
        job, body = self._open_from_learner(data, "batch_request", peer_id)
        req = m.from_obj(m.BatchRequest, body)
        row = self.store.job(req.job_id)
        if row["status"] != "running":
            return m.encode(
                m.BatchReply(
                    groups=[],
                    current_version=int(row["current_version"]),
                    cancelled=row["status"] == "cancelled",
                )
            )
        groups = []
        for r in self.store.take_batch(req.job_id, req.max_groups, req.min_version):
            sub = m.from_obj(
                m.Submission,
                signing.open_envelope(bytes(r["envelope"]), kind="submission").decode_body(),
            )
            groups.append(
                m.TrainingGroup(
                    rollout_id=r["rollout_id"],
                    node_id=r["node_id"],
                    prompt_id=r["prompt_id"],
                    prompt_tokens=m.pack_tokens(job.prompt_tokens(r["prompt_id"])),
                    version=r["version"],
                    engine=sub.engine,
                    rewards=json.loads(r["rewards_json"]),
                    completions=sub.completions,
                    envelope=bytes(r["envelope"]),
                )
            )
        return m.encode(m.BatchReply(groups=groups, current_version=int(row["current_version"])))

    async def handle_learner_report(self, peer_id, data: bytes) -> bytes:
        job, body = self._open_from_learner(data, "step_report", peer_id)
        rep = m.from_obj(m.StepReport, body)
        row = self.store.job(rep.job_id)
        menv = signing.open_envelope(
            rep.manifest, kind="manifest", expected_signer=bytes(row["learner_pubkey"])
        )
        man = m.from_obj(m.Manifest, menv.decode_body())
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
                self._maybe_exclude(node_id)
        self.metrics.versions_published.inc()
        self.metrics.current_version.labels(job=rep.job_id).set(rep.version)
        for v in rep.verdicts:
            if not v.ok:
                self.metrics.submissions.labels(result="rejected", reason=v.reason).inc()
        if rep.version >= job.spec.steps:
            self.store.set_job_status(rep.job_id, "done")
            log.info("job %s done at v%d", rep.job_id, rep.version)
        assert self.host is not None
        plan = await self._plan_broadcast(man, rep.manifest)
        if plan:
            try:
                await self.host.publish(ids.TOPIC_VERSIONS, plan)
            except Exception as exc:  # nodes not reached learn the version from leases and pull
                log.debug("version announcement failed: %s", exc)
        return m.encode(m.StepAck(ok=True, plan=plan))
