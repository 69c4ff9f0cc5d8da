"""Who does what in an FSDP2 learner: rank 0 leads, the other ranks follow its calls.

Rank 0 is the learner the coordinator knows (its host, key, reports, publishing, the job's
lock); the others only compute. Every call rank 0 makes on its trainer is a collective, so
:class:`Leader` -- the trainer as rank 0's :class:`~echo.learner.service.Learner` holds it --
first announces the call (its name and arguments, msgpack over the gloo command group; batches
travel as their wire records) and then makes it; :func:`follow` is the other ranks' loop, making
the same calls in the same order until rank 0 says ``stop``.

A rank that dies ends the learner: torchrun sees the exit, stops the other ranks, and exits
non-zero, and the coordinator's supervisor starts the learner again from its last checkpoint.
torchrun's own exit status is 1 whatever the rank's was, so rank 0 leaves the status that
matters to the supervisor (cannot resume, superseded) in ``<job dir>/learner.exit``
(:func:`leave_exit_status`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from echo.learner.fsdp import distributed
from echo.learner.fsdp import trainer as fsdp_trainer
from echo.learner.fsdp.distributed import Dist
from echo.learner.fsdp.trainer import ShardedTrainer
from echo.learner.trainer import StepResult
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec
from echo.protocol import codec, limits
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec

log = logging.getLogger("echo.learner")

# Where rank 0 leaves the exit status torchrun cannot pass on (coordinator/jobs/learners.py reads
# it).
EXIT_FILE = "learner.exit"


def leave_exit_status(job_dir: Path, code: int, epoch: int, why: str) -> None:
    """Record ``code`` as the exit status of the learner of ``epoch`` for the supervisor, and
    ``why`` (rank 0, before it exits with it)."""
    (job_dir / EXIT_FILE).write_text(f"{code} {epoch}\n{why}\n")


class Leader:
    """Rank 0's trainer: each call is announced to the other ranks, then made here. It offers
    what :class:`~echo.learner.service.Learner` uses of a
    :class:`~echo.learner.trainer.Trainer`."""

    def __init__(self, trainer: ShardedTrainer, d: Dist) -> None:
        self.trainer = trainer
        self.d = d

    def _announce(self, op: str, **args: Any) -> None:
        distributed.broadcast_bytes(self.d, codec.packb({"op": op, **args}))

    @property
    def version(self) -> int:
        return self.trainer.version

    def prescore(self, groups: list[m.TrainingGroup]) -> None:
        self._announce("prescore", groups=[m.encode(g) for g in groups])
        self.trainer.prescore(groups)

    def train(self, batch: list[m.TrainingGroup]) -> StepResult:
        self._announce("train", groups=[m.encode(g) for g in batch])
        return self.trainer.train(batch)

    def published_state(self) -> dict[str, torch.Tensor]:
        self._announce("published_state")
        return self.trainer.published_state()

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self._announce("remember", version=version)
        self.trainer.remember(version, state)

    def save_checkpoint(self, root: Path, anchor_version: int, report: bytes) -> None:
        self._announce("save_checkpoint", root=str(root), anchor_version=anchor_version)
        self.trainer.save_checkpoint(root, anchor_version, report)

    def evaluate(self, force: bool = False) -> dict[str, float]:
        self._announce("evaluate", force=force)
        return self.trainer.evaluate(force)

    def stop(self) -> None:
        """Let the other ranks exit (once rank 0 is done with the trainer)."""
        self._announce("stop")


def _groups(msg: dict) -> list[m.TrainingGroup]:
    return [
        m.decode(m.TrainingGroup, g, max_bytes=limits.MAX_BATCH_REPLY_BYTES) for g in msg["groups"]
    ]


def follow(trainer: ShardedTrainer, d: Dist) -> None:
    """Make rank 0's trainer calls on this rank until it says ``stop``."""
    while True:
        msg = codec.unpackb(
            distributed.broadcast_bytes(d, None), max_bytes=distributed.MAX_MESSAGE_BYTES
        )
        op = msg["op"]
        if op == "stop":
            return
        if op == "prescore":
            trainer.prescore(_groups(msg))
        elif op == "train":
            trainer.train(_groups(msg))
        elif op == "published_state":
            trainer.published_state()
        elif op == "remember":
            trainer.remember(int(msg["version"]), {})
        elif op == "save_checkpoint":
            trainer.save_checkpoint(Path(msg["root"]), int(msg["anchor_version"]), b"")
        elif op == "evaluate":
            trainer.evaluate(bool(msg["force"]))
        else:
            raise RuntimeError(f"rank 0 sent an unknown call {op!r}")


def build(job_dir: Path, d: Dist) -> tuple[ShardedTrainer, Any]:
    """This rank's trainer for the job in ``job_dir`` (see :func:`fsdp_trainer.build`, and
    :func:`~echo.learner.fsdp.lora.build` for a LoRA job)."""
    spec = JobSpec.model_validate_json((job_dir / "job.json").read_text())
    model_spec = ModelSpec.from_dict(spec.model_spec_dict())
    if spec.lora is not None:  # the base sharded, the adapter trained
        from echo.learner.fsdp import lora as fsdp_lora

        return fsdp_lora.build(spec, model_spec, job_dir, d)
    return fsdp_trainer.build(spec, model_spec, job_dir, d)


def run_follower(job_dir: Path, d: Dist) -> None:
    """A follower rank's whole life: build its trainer with the others, follow rank 0."""
    trainer, _ = build(job_dir, d)
    follow(trainer, d)
    log.info("rank %d: rank 0 is done; exiting", d.rank)


def start(
    job_dir: Path, device: str, threads: int, checkpoint_layers: bool = False
) -> Dist | None:
    """Join the learner's process group (this process was started by torchrun). Rank 0 gets its
    place in the group back and goes on to be the learner; any other rank follows rank 0 here
    until it is done, and gets None. ``checkpoint_layers``: ``[learner]
    activation_checkpointing`` (see :class:`~echo.learner.fsdp.distributed.Dist`).

    :raises ValueError: a ``device`` this machine cannot compute on, or not under torchrun.
    """
    torch.set_num_threads(threads)
    d = distributed.init(resolve_device(device), checkpoint_layers)
    if d.leader:
        (job_dir / EXIT_FILE).unlink(missing_ok=True)  # a status left by an earlier life
        return d
    try:
        run_follower(job_dir, d)
    finally:
        distributed.close()
    return None


def finish(trainer: object) -> None:
    """Rank 0 is done with the trainer (``trainer`` is None if it never built one): let the
    other ranks go, and leave the group."""
    if isinstance(trainer, Leader):
        try:
            trainer.stop()
        except Exception as exc:  # a rank already gone: torchrun is ending the others anyway
            log.warning("could not stop the other ranks: %s", exc)
    distributed.close()
