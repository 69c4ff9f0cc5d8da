"""The learner of a LoRA job (``[job.lora]``): the adapter trains, the base stays as it was.

:class:`LoraTrainer` is a :class:`~echo.learner.trainer.Trainer` whose policy is the base model
with a ``peft`` LoRA adapter (:mod:`echo.models.lora`): the optimizer holds the adapter's
parameters only, checkpoints hold the adapter and its optimizer state only, and the re-scorer
keeps the base once and switches adapters between the versions it remembers.

The base is fixed when the job first starts: the model after the job's format warm-up, rounded
to the publish dtype (so the learner trains on exactly the base that nodes receive), written once
to ``<job dir>/lora_base.safetensors`` and read back on every restart.

:class:`AdapterPublisher` publishes versions as adapters: version 0 carries the base's tensors
beside the adapter's (nodes fetch the base once, through the same signed chunks), every other
anchor the adapter alone, and patches the adapter's changed bits (the same lossless codec).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file

from echo.learner.algorithm.grpo import GRPOLearner
from echo.learner.checkpoints import checkpoint
from echo.learner.exports.staging import staged_folder
from echo.learner.publish import Publisher
from echo.learner.rescoring.rescore import Rescorer
from echo.learner.trainer import Trainer
from echo.models.lora import (
    LoraShape,
    adapter_state,
    base_state,
    inject,
    load_adapter_state,
    load_base_state,
    lora_digest,
)
from echo.models.spec import ModelSpec, build_model, load_tokenizer
from echo.models.weights import (
    DTYPES,
    export_state,
    load_state,
    state_digest,
    state_digests,
    state_to_bytes,
)
from echo.p2p.chunkstore import ChunkStore
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec, LoraSection
from echo.tasks.registry import make_task

BASE_FILE = "lora_base.safetensors"
# peft's adapter folder: its files, and the prefix its saved tensor names carry.
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterInitError(ValueError):
    """A ``[job.lora] init`` folder that is not an adapter of this job's shape."""


def shape_of(section: LoraSection) -> LoraShape:
    return LoraShape(section.rank, float(section.alpha), tuple(section.target_modules))


def adapter_ref(shape: LoraShape, base_digest: str, carries_base: bool) -> m.AdapterRef:
    return m.AdapterRef(
        base_digest=base_digest,
        rank=shape.rank,
        alpha=float(shape.alpha),
        target_modules=list(shape.target_modules),
        carries_base=carries_base,
    )


def read_peft_folder(folder: Path, shape: LoraShape) -> dict[str, torch.Tensor]:
    """The adapter state of a peft adapter folder, checked against ``shape`` (rank, alpha and
    modules as the job asks). :raises AdapterInitError: a missing file or another shape."""
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text())
        raw = load_file(str(folder / PEFT_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise AdapterInitError(f"lora.init {folder}: not a peft adapter folder ({exc})") from None
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    got = (config.get("r"), float(config.get("lora_alpha") or 0), sorted(modules))
    want = (shape.rank, float(shape.alpha), sorted(shape.target_modules))
    if got != want:
        raise AdapterInitError(
            f"lora.init {folder}: rank, alpha, modules are {got}, the job asks for {want}"
        )
    return {n.removeprefix(PEFT_PREFIX): t for n, t in raw.items()}


def write_peft_folder(folder: Path, adapter: Mapping[str, torch.Tensor], shape: LoraShape) -> None:
    """``adapter`` as a peft adapter folder (what ``PeftModel.from_pretrained`` reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": shape.rank,
        "lora_alpha": shape.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(shape.target_modules),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {PEFT_PREFIX + n: t.contiguous() for n, t in adapter.items()}, str(folder / PEFT_WEIGHTS)
    )


def save_base(path: Path, state: Mapping[str, torch.Tensor]) -> None:
    """Write the base durably (fsynced, then renamed): every later version is an adapter of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(dict(state), str(tmp))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class LoraTrainer(Trainer):
    """A trainer whose versions are adapters of a fixed base (see the module docstring)."""

    base: dict[str, torch.Tensor]  # the base as published (publish dtype)
    base_digest: str
    shape: LoraShape

    @classmethod
    def build(
        cls,
        spec: JobSpec,
        model_spec: ModelSpec,
        job_dir: Path,
        device: torch.device | str = "cpu",
    ) -> tuple[Trainer, checkpoint.Checkpoint | None]:
        """As :meth:`Trainer.build`, for a LoRA job: the base from ``lora_base.safetensors``
        (made by the warm-up the first time), the adapter from the newest checkpoint, else from
        ``[job.lora] init``, else B = 0.

        :raises OSError: an unreadable model folder, base or checkpoint.
        :raises AdapterInitError: a bad ``init`` folder.
        """
        assert spec.lora is not None
        shape = shape_of(spec.lora)
        task = make_task(spec.task.name, dict(spec.task.params))
        tokenizer = load_tokenizer(model_spec) if model_spec.kind == "hf" else None
        base_path = job_dir / BASE_FILE
        model = build_model(model_spec, seed=spec.model.seed)
        if base_path.exists():
            load_state(model, load_file(str(base_path)))
        else:
            cls._warm_up(spec, model_spec, model, task, job_dir)
            # Rounded to the publish dtype: the learner trains on the base nodes receive.
            published = export_state(model, spec.publish_dtype)
            load_state(model, published)
            save_base(base_path, published)
        model = inject(model, shape, seed=spec.model.seed).to(device)
        initial: dict[str, torch.Tensor] | None = None
        if spec.lora.init is not None:
            initial = read_peft_folder(Path(spec.lora.init), shape)
            try:
                load_adapter_state(model, initial)
            except ValueError as exc:
                raise AdapterInitError(f"lora.init {spec.lora.init}: {exc}") from None
        ckpt = checkpoint.latest(job_dir / "checkpoints")
        reference = None
        if ckpt is not None:
            if spec.grpo.kl_coef > 0:  # the KL term holds the policy near the initial adapter
                reference = copy.deepcopy(model)
            load_adapter_state(model, ckpt.model_state)
        learner = GRPOLearner(model, spec.grpo, spec.sampling.temperature, reference)
        if ckpt is not None:
            learner.opt.load_state_dict(ckpt.optim_state)
            learner.version = ckpt.version
        base = base_state(model, spec.publish_dtype)
        # The re-scorer holds the base once; a version it remembers is an adapter.
        rescorer_model = inject(build_model(model_spec), shape)
        load_base_state(rescorer_model, base)
        rescorer = Rescorer(
            model_spec,
            keep=spec.staleness + 1,
            temperature=spec.sampling.temperature,
            device=learner.device,
            model=rescorer_model,
            load_into=load_adapter_state,
        )
        trainer = cls(spec, model_spec, learner, task, tokenizer, rescorer)
        trainer.shape, trainer.base, trainer.base_digest = shape, base, state_digest(base)
        trainer.rescorer.remember(learner.version, trainer.published_state())
        return trainer, ckpt

    @staticmethod
    def _warm_up(
        spec: JobSpec, model_spec: ModelSpec, model: torch.nn.Module, task: Any, job_dir: Path
    ) -> None:
        """The job's format warm-up of the base (the full model: a random tiny model needs the
        answer's shape before an adapter can learn anything on it)."""
        if not spec.warmup.steps:
            return
        from echo.learner.warmup import warmup

        warmup(
            model,
            model_spec,
            task,
            steps=spec.warmup.steps,
            lr=spec.warmup.lr,
            seed=spec.model.seed,
            cache_dir=job_dir.parent.parent / "cache",
        )

    def published_state(self) -> dict[str, torch.Tensor]:
        """The adapter as nodes receive it (in the job's publish dtype)."""
        return adapter_state(self.learner.model, self.spec.publish_dtype)

    def make_checkpoint(self, anchor_version: int, report: bytes) -> checkpoint.Checkpoint:
        """The adapter's float32 master weights and its optimizer state: nothing of the base."""
        return checkpoint.Checkpoint(
            version=self.version,
            anchor_version=anchor_version,
            model_state=adapter_state(self.learner.model, "float32"),
            optim_state=self.learner.opt.state_dict(),
            report=report,
        )


class AdapterPublisher(Publisher):
    """Publishes adapter states (see the module docstring); ``base`` is the base as published."""

    def __init__(
        self,
        key: Ed25519PrivateKey,
        job_id: str,
        store: ChunkStore,
        anchor_every: int,
        base: Mapping[str, torch.Tensor],
        shape: LoraShape,
    ) -> None:
        super().__init__(key, job_id, store, anchor_every)
        self.base = dict(base)
        self.base_digest = state_digest(self.base)
        self.shape = shape
        # Version 0 holds the base: late joiners fetch it whatever anchor they start from, so
        # neither the publisher nor the learner's relay may prune it.
        store.pinned.add(0)

    def _anchor_payload(self, state: Mapping[str, torch.Tensor], version: int) -> bytes:
        if version == 0:
            return state_to_bytes({**self.base, **state})
        return state_to_bytes(state)

    def _identity(
        self, state: Mapping[str, torch.Tensor], version: int, kind: str
    ) -> dict[str, Any]:
        carries_base = version == 0 and kind == "anchor"
        payload_state = {**self.base, **state} if carries_base else dict(state)
        return {
            "tensor_digests": state_digests(payload_state),
            "state_digest": lora_digest(self.base_digest, state),
            "adapter": adapter_ref(self.shape, self.base_digest, carries_base),
        }


def build_lora(
    spec: JobSpec, job_dir: Path, device: torch.device | str, publisher: Publisher
) -> tuple[LoraTrainer, AdapterPublisher, checkpoint.Checkpoint | None]:
    """A LoRA job's trainer (restored from its newest checkpoint, returned too) and the adapter
    publisher that takes ``publisher``'s place (same key, job, store and anchor period)."""
    trainer, ckpt = LoraTrainer.build(
        spec, ModelSpec.from_dict(spec.model_spec_dict()), job_dir, device
    )
    assert isinstance(trainer, LoraTrainer)
    adapters = AdapterPublisher(
        publisher.key,
        publisher.job_id,
        publisher.store,
        publisher.anchor_every,
        trainer.base,
        trainer.shape,
    )
    return trainer, adapters, ckpt


def export_adapter(job_dir: Path, spec: JobSpec, version: int, digest: str, out: Path) -> list[str]:
    """Write version ``version`` of a LoRA job as a peft adapter folder at ``out`` (which must
    not exist): the adapter as nodes received it (the checkpoint's master weights in the publish
    dtype), checked against ``digest``, the learner's signed digest of base and adapter, before
    the folder is renamed into place. ``PeftModel.from_pretrained`` loads it onto the base
    (``<job dir>/lora_base.safetensors``). Returns the names of the files written.

    :raises ValueError: the version's checkpoint is not kept or does not reproduce ``digest``.
    :raises FileExistsError: ``out`` exists.
    """
    assert spec.lora is not None
    if out.exists():
        raise FileExistsError(f"{out} exists")
    try:
        master = checkpoint.load_model_state(job_dir / "checkpoints", version)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    adapter = {n: t.to(DTYPES[spec.publish_dtype]).contiguous() for n, t in master.items()}
    base_digest = state_digest(load_file(str(job_dir / BASE_FILE)))
    if lora_digest(base_digest, adapter) != digest:
        raise ValueError(
            f"the checkpoint of version {version} does not hold the adapter the learner "
            "published for it"
        )
    with staged_folder(out) as tmp:
        write_peft_folder(tmp, adapter, shape_of(spec.lora))
        back = read_peft_folder(tmp, shape_of(spec.lora))
        if lora_digest(base_digest, back) != digest:
            raise ValueError(f"{tmp}: the adapter written does not read back as published")
    return sorted(p.name for p in out.iterdir())
