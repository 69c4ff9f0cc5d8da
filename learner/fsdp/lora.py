"""A LoRA job on the FSDP2 learner: the base sharded with ``fully_shard``, the adapter trained.

The same job as :mod:`~echo.learner.lora`'s single learner, on ranks: every rank builds the base
from ``<job dir>/lora_base.safetensors`` (rank 0 makes it the first time, after the job's
format warm-up, exactly as the single learner does, while the others wait), injects the same
``peft`` adapter (A drawn from the job's seed, B = 0, or the ``[job.lora] init`` folder), and
shards the whole model per decoder layer (:func:`~echo.learner.fsdp.distributed.shard_model`): base
and adapter tensors alike are sharded, only the adapter's have gradients and AdamW state.

- Publishing: rank 0 gathers the adapter alone (``get_model_state_dict`` with
  ``ignore_frozen_params``) under peft's saved names, in the publish dtype: the state the single
  LoRA learner publishes, so :class:`~echo.learner.lora.AdapterPublisher` builds the same signed
  adapter manifests from it.
- Checkpoints: DCP, the adapter and its optimizer state only
  (:data:`~echo.learner.checkpoints.dcp_checkpoint.ADAPTER_ONLY`), under the names the single LoRA
  learner's checkpoints use, so either learner resumes from the other's, with any number of ranks.
- Re-scoring: the re-scorer's base+adapter model is sharded too; rank 0 broadcasts a
  remembered version's adapter into it (:class:`ShardedLoraRescorer`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from echo.learner.algorithm.grpo import GRPOLearner
from echo.learner.checkpoints import checkpoint, dcp_checkpoint
from echo.learner.fsdp import distributed
from echo.learner.fsdp.distributed import Dist
from echo.learner.fsdp.trainer import (
    ShardedRescorer,
    ShardedTrainer,
    newest_checkpoint,
    shard_and_resume,
    single_checkpoint,
)
from echo.learner.lora import (
    BASE_FILE,
    AdapterInitError,
    AdapterPublisher,
    LoraTrainer,
    read_peft_folder,
    save_base,
    shape_of,
)
from echo.learner.publish import Publisher
from echo.learner.rescoring.rescore import Rescorer
from echo.models.lora import (
    LoraShape,
    base_state,
    inject,
    load_adapter_state,
    load_base_state,
)
from echo.models.spec import ModelSpec, build_model, load_tokenizer
from echo.models.weights import DTYPES, export_state, load_state, state_digest
from echo.protocol.jobspec import JobSpec
from echo.tasks.registry import make_task

# The adapter gathered whole on rank 0, on the CPU; the frozen base is left out.
ADAPTER_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def saved_names(model: torch.nn.Module) -> dict[str, str]:
    """peft's saved name of each trainable (adapter) parameter -> its live name."""
    return {n.replace(".default.", "."): n for n, p in model.named_parameters() if p.requires_grad}


class ShardedLoraRescorer(ShardedRescorer):
    """The re-scorer of a LoRA job on ranks: the base once, sharded, and the adapter of the
    version groups claim broadcast from rank 0 into the shards."""

    def __init__(self, spec: ModelSpec, d: Dist, model: torch.nn.Module, **kw: Any) -> None:
        Rescorer.__init__(self, spec, model=model, **kw)  # not ShardedRescorer's: no twins here
        self.d, self.twins = d, {}
        self.live = saved_names(self.model)
        distributed.shard_model(self.model)  # fp32: verdicts compare with nodes' log-probs

    def _load(self, version: int) -> None:
        state: dict[str, torch.Tensor] = {}
        if self.d.leader:
            remembered = self._states[version]
            if remembered.keys() != self.live.keys():  # not strict below: checked here
                raise ValueError(f"the adapter of v{version} has other tensors than the model's")
            state = {self.live[n]: t.float() for n, t in remembered.items()}
        set_model_state_dict(
            self.model,
            state,
            options=StateDictOptions(
                full_state_dict=True,
                broadcast_from_rank0=True,
                ignore_frozen_params=True,
                strict=False,  # the base is no part of the state, and stays as it is
            ),
        )


class ShardedLoraTrainer(ShardedTrainer):
    """One rank's trainer of a LoRA job (see the module docstring); ``base``, ``base_digest``
    and ``shape`` as :class:`~echo.learner.lora.LoraTrainer` has them."""

    def __init__(
        self,
        spec: JobSpec,
        model_spec: ModelSpec,
        learner: GRPOLearner,
        task: Any,
        tokenizer: Any,
        d: Dist,
        mixed: bool,
        base: dict[str, torch.Tensor],
        shape: LoraShape,
    ) -> None:
        self.base, self.base_digest, self.shape = base, state_digest(base), shape
        super().__init__(spec, model_spec, learner, task, tokenizer, d, [], mixed)

    def make_rescorer(self) -> Rescorer:
        model = inject(build_model(self.model_spec), self.shape)
        load_base_state(model, self.base)
        return ShardedLoraRescorer(
            self.model_spec,
            self.d,
            model.to(self.d.device),
            keep=self.spec.staleness + 1,
            temperature=self.spec.sampling.temperature,
            device=self.d.device,
        )

    def published_state(self) -> dict[str, torch.Tensor]:
        """The adapter as nodes receive it, gathered whole on rank 0 (on the CPU); {} on the
        other ranks."""
        full = get_model_state_dict(self.learner.model, options=ADAPTER_FULL)
        if not self.d.leader:
            return {}
        target = DTYPES[self.spec.publish_dtype]
        return dict(
            sorted(
                (n.replace(".default.", "."), t.to(target).contiguous().clone())
                for n, t in full.items()
            )
        )

    def save_checkpoint(self, root: Path, anchor_version: int, report: bytes) -> None:
        dcp_checkpoint.save(
            root,
            self.version,
            anchor_version,
            report,
            self.learner.model,
            self.learner.opt,
            self.d.leader,
            adapter=True,
        )


def _base_model(spec: JobSpec, model_spec: ModelSpec, job_dir: Path, d: Dist, task: Any):
    """The job's base on every rank: rank 0 makes ``lora_base.safetensors`` the first time
    (warm-up, rounded to the publish dtype), the others wait for it, then all read it."""
    model = build_model(model_spec, seed=spec.model.seed)
    path = job_dir / BASE_FILE
    if d.leader and not path.exists():
        LoraTrainer._warm_up(spec, model_spec, model, task, job_dir)
        save_base(path, export_state(model, spec.publish_dtype))
    dist.barrier(group=d.commands)  # the base is on disk before any rank reads it
    load_state(model, load_file(str(path)))
    return model


def build(
    spec: JobSpec, model_spec: ModelSpec, job_dir: Path, d: Dist
) -> tuple[ShardedLoraTrainer, checkpoint.Checkpoint | None]:
    """Every rank's trainer of a LoRA job, at the newest checkpoint under ``job_dir`` (a DCP
    one, read with however many ranks wrote it, or the single LoRA learner's). The returned
    checkpoint holds the version, anchor and report only. Collective: every rank calls it.

    :raises OSError: an unreadable model folder, base or checkpoint.
    :raises AdapterInitError: a bad ``[job.lora] init`` folder.
    """
    assert spec.lora is not None
    shape = shape_of(spec.lora)
    task = make_task(spec.task.name, dict(spec.task.params))
    tokenizer = load_tokenizer(model_spec) if model_spec.kind == "hf" else None
    model = inject(_base_model(spec, model_spec, job_dir, d, task), shape, seed=spec.model.seed)
    if spec.lora.init is not None:
        try:
            load_adapter_state(model, read_peft_folder(Path(spec.lora.init), shape))
        except ValueError as exc:
            raise AdapterInitError(f"lora.init {spec.lora.init}: {exc}") from None
    root = job_dir / "checkpoints"
    found = newest_checkpoint(root, d)
    # The KL term holds the policy near the initial adapter, as the single LoRA learner's does.
    reference = copy.deepcopy(model) if spec.grpo.kl_coef > 0 else None
    single = None
    if found is not None and not dcp_checkpoint.is_dcp(found):
        single = single_checkpoint(root, found)
        load_adapter_state(model, single.model_state)
    base = base_state(model, spec.publish_dtype)
    learner, resumed, mixed = shard_and_resume(
        spec, d, model, reference, found, single, adapter=True
    )
    trainer = ShardedLoraTrainer(spec, model_spec, learner, task, tokenizer, d, mixed, base, shape)
    trainer.rescorer.remember(learner.version, trainer.published_state())
    return trainer, resumed


def adapter_publisher(trainer: ShardedLoraTrainer, publisher: Publisher) -> AdapterPublisher:
    """The adapter publisher that takes ``publisher``'s place (same key, job, store and anchor
    period) for rank 0 of a LoRA job, as :func:`~echo.learner.lora.build_lora` makes it."""
    return AdapterPublisher(
        publisher.key,
        publisher.job_id,
        publisher.store,
        publisher.anchor_every,
        trainer.base,
        trainer.shape,
    )
