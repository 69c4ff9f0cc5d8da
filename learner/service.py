"""The learner process of one job: train on verified rollouts, publish versions.

:class:`Learner` owns a libp2p host (its identity is the key the job pins), the chunk store it
serves versions from, its publisher and its checkpoints, around a
:class:`~echo.learner.trainer.Trainer` that owns the model, optimizer and re-scorer. Its loop:
take groups from the coordinator's replay buffer within the staleness window (re-scoring those
from older versions while it waits for the rest), train (``Trainer.train``), publish version
``v + 1`` (anchor or patch, signed), checkpoint, and report which rollouts went into the
version. Compute runs in a trio worker thread so the host keeps serving chunks.

Crash safety: the checkpoint of ``v + 1`` is written, with its signed report, before the report
is sent; after a restart the learner re-sends that report (re-signed with its new learner
epoch), so the coordinator's ledger and the learner's weights never disagree.

One learner per job: the job folder's lock (:mod:`~echo.learner.fence`) keeps two off one
machine's checkpoints, and the learner epoch the coordinator issued this process (``--epoch``)
rides on every request, so once a newer learner of the job has been started or handed the job
the coordinator refuses this one (:class:`Superseded`) and it exits with
:data:`EXIT_SUPERSEDED`, whichever host it runs on.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import torch
import trio

from echo.learner import fence
from echo.learner.distributed import Dist
from echo.learner.lora import build_lora
from echo.learner.publish import Publisher
from echo.learner.tracking import Tracker, open_tracker
from echo.learner.trainer import Trainer
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec
from echo.p2p.budget import STRANGER_BYTES_PER_S, Audience
from echo.p2p.chunkstore import ChunkStore, serve_chunks
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.relay import Relay, RelayConfig, open_relay
from echo.p2p.rpc import RemoteError
from echo.protocol import ids, limits, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.jobspec import JobSpec

log = logging.getLogger("echo.learner")

RPC_TIMEOUT = 30.0
# How long to wait between polls of an empty replay buffer.
POLL_S = 0.1
# After the last step the learner is the only holder some nodes can fetch the final version from:
# it keeps serving until no chunk has been asked for in FINAL_IDLE_S (a node mid-generation asks
# after its current groups), and never longer than FINAL_SERVE_MAX_S.
FINAL_IDLE_S = 10.0
FINAL_SERVE_MAX_S = 90.0
# Share of a paced learner's uplink (--upload-limit-bps) that peers outside its audience -- not
# in a recent plan, no group trained -- may take together: a quarter leaves the plan most of it.
STRANGER_SHARE = 0.25


# The exit status that tells the coordinator's supervisor not to restart us: restarting cannot
# help (coordinator/jobs/learners.py, LEARNER_CANNOT_RESUME).
EXIT_CANNOT_RESUME = 3


# The exit status that tells the coordinator's supervisor a newer learner holds the job: do not
# restart us (coordinator/jobs/learners.py, LEARNER_SUPERSEDED).
EXIT_SUPERSEDED = 4


class LedgerAhead(RuntimeError):
    """The coordinator's ledger holds a version this learner has no checkpoint of."""


class Superseded(RuntimeError):
    """The coordinator refused this learner's epoch: a newer learner of the job was started
    or handed the job (or the epoch was never issued). Nothing this learner sends is booked
    any more, so it stops."""


def resume_action(ledger_version: int, own_version: int, pending_report: bytes | None) -> str:
    """What a (re)attaching learner does first: ``"publish_base"`` (a new job: publish v0),
    ``"resend"`` (the checkpoint of ``own_version`` was written but its report not booked),
    or ``"train"``.

    :raises LedgerAhead: the ledger is past ``own_version``. Checkpoints are durable before
        their report is sent, so this means checkpoints were lost; training on would make a
        version the ledger already has (and refuses), so the learner stops and says why.
    """
    if ledger_version > own_version:
        raise LedgerAhead(
            f"the coordinator's ledger is at v{ledger_version} but the newest checkpoint here is "
            f"v{own_version}: checkpoints were lost; restore them (or cancel the job)"
        )
    if ledger_version < own_version and pending_report is not None:
        return "resend"
    return "publish_base" if ledger_version < 0 else "train"


class Learner:
    """One job's learner process: its host, chunk store, publisher and checkpoints around a
    :class:`~echo.learner.trainer.Trainer`; see the module docstring."""

    def __init__(
        self,
        job_dir: Path,
        job_id: str,
        coordinator: str,
        threads: int,
        upload_limit_bps: float | None = None,
        device: str = "cpu",
        epoch: int = 0,
        ranks: Dist | None = None,
    ) -> None:
        """``epoch`` is the learner epoch the coordinator issued this process (on the command
        line of a learner it starts; ``echo-job learner-epoch`` for an external one); 0 for a
        job that never issued one.

        :raises ValueError: a ``device`` this machine cannot compute on (see
            :func:`~echo.models.device.resolve_device`).
        ``ranks``: this process is rank 0 of an FSDP2 learner (``echo.learner.ranks``).

        :raises TrackingError: the job's tracking backend cannot start."""
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else resolve_device(device)
        self.epoch = epoch
        self.job_dir = job_dir
        self.upload_limit_bps = upload_limit_bps
        # Whom we serve chunks to on their own budgets: planned nodes and those whose groups we
        # trained on; everyone else shares a small bucket (issue 26, finding 7).
        self.audience = Audience(
            min(STRANGER_BYTES_PER_S, STRANGER_SHARE * upload_limit_bps)
            if upload_limit_bps
            else STRANGER_BYTES_PER_S
        )
        self.job_id = job_id
        self.coordinator = coordinator
        self.spec = JobSpec.model_validate_json((job_dir / "job.json").read_text())
        self.identity = Identity.load_or_create(job_dir / "learner.key")
        torch.set_num_threads(threads)
        self.model_spec = ModelSpec.from_dict(self.spec.model_spec_dict())
        self.chunks = ChunkStore(job_dir / "chunks", keep_versions=self.spec.staleness + 2)
        self.publisher = Publisher(
            self.identity.private_key, job_id, self.chunks, self.spec.anchor_every
        )
        self.version = 0
        self.pending_report: bytes | None = None
        self.host: EchoHost | None = None
        self.coord_peer = None
        self.relay: Relay | None = None
        self.served_bytes = 0  # chunk bytes nodes pulled from us
        # Raises TrackingError now, before any work, when the job's backend cannot start.
        self.tracker: Tracker | None = open_tracker(
            self.spec.tracking, job_dir, job_id, self.spec.model_dump(mode="json")
        )

    def build(self) -> None:
        """Build (or restore) the model; runs in a worker thread."""
        if self.ranks is not None:  # with the other ranks, which build their shards alike
            from echo.learner.ranks import Leader, build

            trainer, ckpt = build(self.job_dir, self.ranks)
            self.trainer: Trainer | Leader = Leader(trainer, self.ranks)
            if self.spec.lora is not None:  # versions are adapters of the base, as below
                from echo.learner.fsdp_lora import adapter_publisher

                self.publisher = adapter_publisher(trainer, self.publisher)
        elif self.spec.lora is not None:  # versions are adapters of a base fixed at the start
            self.trainer, self.publisher, ckpt = build_lora(
                self.spec, self.job_dir, self.device, self.publisher
            )
        else:
            self.trainer, ckpt = Trainer.build(
                self.spec, self.model_spec, self.job_dir, self.device
            )
        if ckpt is not None:
            self.version = ckpt.version
            self.pending_report = ckpt.report
            self.publisher.reset(self.trainer.published_state(), ckpt.version, ckpt.anchor_version)
            log.info("resumed from checkpoint v%d", ckpt.version)

    def _publish(
        self, trained: list[str], verdicts: list[m.RescoreVerdict], metrics: dict[str, float]
    ) -> bytes:
        """Publish the current weights as ``self.version``; returns the signed report."""
        state = self.trainer.published_state()
        pub = self.publisher.publish(state, self.version)
        metrics = {
            **metrics,
            "payload_bytes": float(pub.payload_bytes),
            "encode_s": pub.encode_s,
            # Cumulative: the difference between two versions is what disseminating the
            # earlier one cost the learner's uplink.
            "source_bytes_total": float(self.bytes_sent()),
        }
        report = m.StepReport(
            job_id=self.job_id,
            version=self.version,
            manifest=pub.envelope,
            trained=trained,
            verdicts=verdicts,
            metrics=metrics,
            epoch=self.epoch,
        )
        sealed = signing.seal_record(self.identity.private_key, report)
        self.trainer.save_checkpoint(
            self.job_dir / "checkpoints", pub.manifest.anchor_version, sealed
        )
        self.trainer.remember(self.version, state)
        if self.tracker is not None:
            self.tracker.log(self.version, metrics)
        return sealed

    # ------------------------------------------------------------------ coordinator RPC

    async def _rpc(self, proto: str, record: m.Record, reply_cls):
        """``record``, signed, to the coordinator; its reply as a ``reply_cls``, decoded in a worker
        thread (a batch's ids are lists, up to 32 MiB: the loop keeps serving chunks). :raises
        RpcError: the call failed. :raises ProtocolError: the reply does not decode."""
        assert self.host is not None
        sealed = signing.seal_record(self.identity.private_key, record)
        cap = limits.MAX_BATCH_REPLY_BYTES
        data = await self._request(proto, sealed, cap)
        return await trio.to_thread.run_sync(lambda: m.decode(reply_cls, data, max_bytes=cap))

    async def _request(self, proto: str, sealed: bytes, max_response: int) -> bytes:
        """One request to the coordinator. :raises Superseded: it refused our learner epoch.
        :raises RpcError: the call failed otherwise."""
        assert self.host is not None
        try:
            return await self.host.request(
                self.coord_peer, proto, sealed, timeout=RPC_TIMEOUT, max_response=max_response
            )
        except RemoteError as exc:
            if exc.message.startswith(f"{m.LEARNER_EPOCH_REFUSED}:"):
                raise Superseded(f"the coordinator refused this learner: {exc.message}") from None
            raise

    def _for_this_epoch(self, sealed: bytes) -> bytes:
        """``sealed`` (a StepReport this learner signed, perhaps in an earlier life under an
        older epoch: a report checkpointed but never booked) re-signed with this process's
        epoch; unchanged when it carries it already. :raises ProtocolError: not such a report."""
        _, report = signing.open_record(
            sealed, m.StepReport, expected_signer=self.identity.public_key_bytes
        )
        if report.epoch == self.epoch:
            return sealed
        return signing.seal_record(
            self.identity.private_key, report.model_copy(update={"epoch": self.epoch})
        )

    async def _send_report(self, sealed: bytes) -> None:
        assert self.host is not None
        data = await self._request(ids.PROTO_LEARNER_REPORT, sealed, 1 << 16)
        ack = m.decode(m.StepAck, data, max_bytes=8 << 20)
        if not ack.ok:
            raise RuntimeError(f"coordinator refused version {self.version}: {ack.message}")
        if ack.plan:
            await self._start_broadcast(ack.plan)

    async def _start_broadcast(self, sealed_plan: bytes) -> None:
        """Push the new version to our children in the coordinator's plan; nodes the push does
        not reach pull from us instead, so a bad plan only costs time."""
        assert self.host is not None and self.relay is not None
        try:
            ann = await self.relay.join_plan(
                sealed_plan, public_key_from_peer_id(self.coord_peer), self.job_id
            )
        except ProtocolError as exc:
            log.warning("cannot push v%d down the plan: %s", self.version, exc)
            return
        if ann is not None:  # the plan's nodes may pull from us on their own budgets
            self.audience.planned(ann.version, (p.peer_id for p in ann.peers))

    def bytes_sent(self) -> int:
        """Chunk bytes this learner has sent, pushed and pulled, since it started."""
        return self.served_bytes + (self.relay.pushed_out_total if self.relay else 0)

    async def _take_groups(self, want: int) -> m.BatchReply:
        """Up to ``want`` groups within the staleness window from the coordinator's buffer (one
        reply: ``more`` says the reply's size budget cut it short)."""
        min_version = max(0, self.version - self.spec.staleness)
        return await self._rpc(
            ids.PROTO_LEARNER_BATCH,
            m.BatchRequest(
                job_id=self.job_id,
                max_groups=want,
                min_version=min_version,
                timestamp=time.time(),
                epoch=self.epoch,
            ),
            m.BatchReply,
        )

    # ------------------------------------------------------------------ main loop

    def _listen_addr(self) -> str:
        """The port of the previous run if there was one: nodes fetching chunks from us when we
        crashed find us again at the same address (they also re-ask the coordinator)."""
        ip = self.coordinator.split("/")[2]  # the interface the coordinator is reached on
        try:
            port = int((self.job_dir / "learner.port").read_text())
            with socket.socket() as probe:  # still free? (another process may have taken it)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((ip, port))
        except (OSError, ValueError):
            port = 0
        return f"/ip4/{ip}/tcp/{port}"

    def _remember_port(self, host: EchoHost) -> None:
        port = host.listen_multiaddrs[0].split("/tcp/")[1].split("/")[0]
        (self.job_dir / "learner.port").write_text(port)

    async def run(self) -> None:
        """Build the model, attach to the coordinator and train until the job ends; the
        tracking run is closed on the way out."""
        try:
            await self._run()
        finally:
            if self.tracker is not None:
                self.tracker.close()

    async def _run(self) -> None:
        # One learner per job: an orphan of a killed coordinator must exit first (fence.py).
        self._lock_fd = await fence.hold(self.job_dir)
        await trio.to_thread.run_sync(self.build)
        async with open_host(self.identity, [self._listen_addr()]) as host:
            self._remember_port(host)
            self.host = host
            serve_chunks(host, self.chunks, on_served=self._count_served, audience=self.audience)
            self.coord_peer = await host.connect(self.coordinator)
            async with open_relay(
                host,
                self.chunks,
                learner_keys={self.job_id: self.identity.public_key_bytes},
                config=RelayConfig(upload_limit_bps=self.upload_limit_bps),
                serve_pulls=False,
            ) as relay:
                self.relay = relay
                await self._attached()

    def _count_served(self, n: int) -> None:
        self.served_bytes += n

    async def _attached(self) -> None:
        """Attach to the job at the coordinator, re-send a report a crash left unsent, train,
        and serve the final version."""
        assert self.host is not None
        host = self.host
        hello = await self._rpc(
            ids.PROTO_LEARNER_HELLO,
            m.LearnerHello(
                job_id=self.job_id,
                peer_id=str(host.peer_id),
                addrs=host.listen_multiaddrs,
                timestamp=time.time(),
                epoch=self.epoch,
            ),
            m.LearnerHelloReply,
        )
        if hello.cancelled:
            log.info("job was cancelled; exiting")
            return
        action = resume_action(hello.current_version, self.version, self.pending_report)
        if action == "resend":  # crashed between the checkpoint and its report
            assert self.pending_report is not None
            log.info(
                "re-sending the report of v%d (the ledger is at v%d)",
                self.version,
                hello.current_version,
            )
            # Checkpointed under the epoch of the learner that crashed: ours now.
            await self._send_report(self._for_this_epoch(self.pending_report))
        elif action == "publish_base":
            sealed = await trio.to_thread.run_sync(
                lambda: self._publish([], [], self.trainer.evaluate(force=True))
            )
            await self._send_report(sealed)
            log.info("published v0 (base policy)")
        if await self._train_loop():
            await self._serve_final()

    async def _serve_final(self) -> None:
        start = time.monotonic()
        log.info("serving the final version v%d until nodes stop asking", self.version)
        if self.relay is not None:  # first let the push down the tree finish
            await self.relay.wait_forwarded(self.job_id, self.version, FINAL_SERVE_MAX_S / 3)
        self.chunks.last_read = max(self.chunks.last_read, time.monotonic())
        while time.monotonic() - self.chunks.last_read < FINAL_IDLE_S:
            if time.monotonic() - start > FINAL_SERVE_MAX_S:
                log.info("served the final version for %.0f s; exiting", FINAL_SERVE_MAX_S)
                return
            await trio.sleep(1.0)
        log.info("no chunk requests for %.0f s; exiting", FINAL_IDLE_S)

    async def _train_loop(self) -> bool:
        """Train until the job's last step (True) or until it is cancelled (False)."""
        spec = self.spec
        pending: list[m.TrainingGroup] = []
        last_wait_log = time.monotonic()
        while self.version < spec.steps:
            reply = await self._take_groups(spec.batch_groups - len(pending))
            if reply.cancelled:
                log.info("job cancelled at v%d", self.version)
                return False
            groups = list(reply.groups)
            for g in groups:  # accepted work: they pull from us on their own budgets
                self.audience.proven(g.node_id)
            pending.extend(groups)
            floor = self.version - spec.staleness
            pending = [g for g in pending if g.version >= floor]
            if len(pending) < spec.batch_groups:
                fresh = {g.rollout_id for g in groups}
                if fresh:  # while we wait, re-score what came (off the step's critical path)
                    await trio.to_thread.run_sync(
                        self.trainer.prescore, [g for g in pending if g.rollout_id in fresh]
                    )
                if reply.more:
                    continue  # the reply's size budget cut it: the rest is waiting
                if time.monotonic() - last_wait_log > 10:
                    log.info("waiting for rollouts (%d/%d groups)", len(pending), spec.batch_groups)
                    last_wait_log = time.monotonic()
                await trio.sleep(POLL_S)
                continue
            # Never more than one batch is requested, so nothing is held across a publish: the
            # coordinator returns whatever a report does not name to the buffer.
            batch, pending = pending[: spec.batch_groups], []
            sealed, metrics = await trio.to_thread.run_sync(self._step, batch)
            if "eval_accuracy" in metrics:
                log.info(
                    "v%d held-out greedy accuracy %.3f", self.version, metrics["eval_accuracy"]
                )
            await self._send_report(sealed)
            log.info(
                "v%d reward %.3f loss %.4f mismatch %.2e groups %d rejected %d step %.2fs",
                self.version,
                metrics["reward"],
                metrics.get("loss", 0.0),
                metrics.get("mismatch", 0.0),
                len(batch),
                int(metrics["rejected"]),
                metrics["step_s"],
            )
        log.info("trained %d versions; done", self.version)
        return True

    def _step(self, batch: list[m.TrainingGroup]) -> tuple[bytes, dict[str, float]]:
        """Train on ``batch`` and publish the result; returns the signed report."""
        result = self.trainer.train(batch)
        self.version = self.trainer.version
        return self._publish(result.trained, result.verdicts, result.metrics), result.metrics
