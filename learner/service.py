"""The learner process of one job: train on verified rollouts, publish versions.

:class:`Learner` owns the job's step loop and what makes a step a version: its identity (the key
the job pins), its publisher and checkpoints, resuming from them, and the report of each
version, around a :class:`~echo.learner.trainer.Trainer` that owns the model, optimizer and
re-scorer. It talks to the coordinator through a
:class:`~echo.learner.link.CoordinatorLink` and serves its versions to the swarm through a
:class:`~echo.learner.source.VersionSource`. Its loop:
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
the coordinator refuses this one (:class:`~echo.learner.link.Superseded`) and it exits with
:data:`EXIT_SUPERSEDED`, whichever host it runs on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import trio

from echo.learner import fence
from echo.learner.link import CoordinatorLink
from echo.learner.lora import build_lora
from echo.learner.publish import Publisher
from echo.learner.source import VersionSource
from echo.learner.tracking import Tracker, open_tracker
from echo.learner.trainer import Trainer
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.identity import Identity
from echo.p2p.lifecycle import settle_heap
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.jobspec import JobSpec

if TYPE_CHECKING:  # FSDP2 (torch.distributed) took a fifth of a single learner's start-up imports
    from echo.learner.fsdp.distributed import Dist

log = logging.getLogger("echo.learner")

# How long to wait between polls of an empty replay buffer.
POLL_S = 0.1


# The exit status that tells the coordinator's supervisor not to restart us: restarting cannot
# help (coordinator/jobs/learners.py, LEARNER_CANNOT_RESUME).
EXIT_CANNOT_RESUME = 3


# The exit status that tells the coordinator's supervisor a newer learner holds the job: do not
# restart us (coordinator/jobs/learners.py, LEARNER_SUPERSEDED).
EXIT_SUPERSEDED = 4


class LedgerAhead(RuntimeError):
    """The coordinator's ledger holds a version this learner has no checkpoint of."""


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
    """One job's learner process: its step loop, publisher and checkpoints around a
    :class:`~echo.learner.trainer.Trainer`, with its link to the coordinator and its source of
    versions in the swarm; see the module docstring. One concept: what turns a trained step
    into a booked version (publish, checkpoint, report, in that order) and the loop that feeds
    it; talking to the coordinator and serving chunks are the link's and the source's."""

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
        ``ranks``: this process is rank 0 of an FSDP2 learner (``echo.learner.fsdp.ranks``).

        :raises TrackingError: the job's tracking backend cannot start."""
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else resolve_device(device)
        self.epoch = epoch
        self.job_dir = job_dir
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
        self.source = VersionSource(
            job_dir, job_id, self.chunks, self.identity.public_key_bytes, upload_limit_bps
        )
        self.link = CoordinatorLink(self.identity, job_id, epoch)
        self.version = 0
        self.pending_report: bytes | None = None
        # Raises TrackingError now, before any work, when the job's backend cannot start.
        self.tracker: Tracker | None = open_tracker(
            self.spec.tracking, job_dir, job_id, self.spec.model_dump(mode="json")
        )

    def build(self) -> None:
        """Build (or restore) the model; runs in a worker thread."""
        if self.ranks is not None:  # with the other ranks, which build their shards alike
            from echo.learner.fsdp.ranks import Leader, build

            trainer, ckpt = build(self.job_dir, self.ranks)
            self.trainer: Trainer | Leader = Leader(trainer, self.ranks)
            if self.spec.lora is not None:  # versions are adapters of the base, as below
                from echo.learner.fsdp.lora import adapter_publisher

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
            "source_bytes_total": float(self.source.bytes_sent()),
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

    # ------------------------------------------------------------------ main loop

    async def _send_report(self, sealed: bytes) -> None:
        """Send a signed report of ``self.version``, then push the version down the plan the
        coordinator answered with."""
        plan = await self.link.send_report(sealed, self.version)
        if plan:
            await self.source.broadcast(plan, self.link.coordinator_key, self.version)

    async def _take_groups(self, want: int) -> m.BatchReply:
        """Up to ``want`` groups within the staleness window from the coordinator's buffer."""
        return await self.link.take_groups(want, max(0, self.version - self.spec.staleness))

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
        settle_heap()  # the model and optimizer live as long as we do: no full GC walks them
        async with self.source.open_host(self.identity, self.coordinator) as host:
            await self.link.connect(host, self.coordinator)
            async with self.source.open_relay(host):
                await self._attached()

    async def _attached(self) -> None:
        """Attach to the job at the coordinator, re-send a report a crash left unsent, train,
        and serve the final version."""
        hello = await self.link.hello()
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
            await self._send_report(self.link.for_this_epoch(self.pending_report))
        elif action == "publish_base":
            sealed = await trio.to_thread.run_sync(
                lambda: self._publish([], [], self.trainer.evaluate(force=True))
            )
            await self._send_report(sealed)
            log.info("published v0 (base policy)")
        if await self._train_loop():
            await self.source.serve_final(self.version)

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
            self.source.proven(g.node_id for g in groups)  # accepted work
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
