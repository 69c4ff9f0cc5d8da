"""The learner's compute sharded over ranks with FSDP2: :class:`ShardedTrainer` and its build.

Every rank holds a shard of the policy (``fully_shard`` per decoder layer, then the root: see
:mod:`~echo.learner.fsdp.distributed`) and runs the same :class:`~echo.learner.trainer.Trainer` code
on the same batch: each steps on its share of the batch's groups (:meth:`ShardedTrainer.share`), the
loss is divided by the whole batch's token count and FSDP sums the gradients, so the update is
the one the single learner makes on the whole batch. Re-scoring is sharded alike
(:class:`ShardedRescorer`: the re-scorer's model is sharded too, each rank scores its share of
every version's groups, and the verdicts are gathered before the step). Rank 0 alone holds the
published states (gathered whole, on the CPU, with ``get_model_state_dict``); checkpoints are
``torch.distributed.checkpoint`` (:mod:`~echo.learner.checkpoints.dcp_checkpoint`).

Every method that computes is a collective: all ranks call it in the same order, which
:mod:`~echo.learner.fsdp.ranks` arranges (rank 0 announces each call to the others).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from echo.learner.algorithm.grpo import Across, GRPOLearner, TrainGroup, pad_batch
from echo.learner.checkpoints import checkpoint, dcp_checkpoint
from echo.learner.checkpoints.checkpoint_files import version_dir
from echo.learner.fsdp import distributed
from echo.learner.fsdp.distributed import Dist
from echo.learner.rescoring.rescore import Rescorer, Verdict
from echo.learner.trainer import Trainer
from echo.learner.warmup import warmup
from echo.models.spec import ModelSpec, build_model, load_tokenizer
from echo.models.weights import DTYPES
from echo.protocol.jobspec import JobSpec
from echo.tasks.registry import make_task

log = logging.getLogger("echo.learner")

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class RankSums(Across):
    """The step's sums and maxima over every rank's share of the batch."""

    def __init__(self, d: Dist) -> None:
        self.d = d

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return distributed.all_sum(self.d, values).to(values.dtype)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        out = values.detach().to("cpu", torch.float64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.d.commands)
        return out.to(values.dtype)


def export_names(model: torch.nn.Module) -> list[str]:
    """The names :func:`~echo.models.weights.export_state` publishes for ``model`` (unsharded):
    tied tensors once, under their first name."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(name)
    return out


def _verdict_bytes(verdicts: dict[int, Verdict]) -> bytes:
    return json.dumps({str(i): [v.ok, v.reason, v.stats] for i, v in verdicts.items()}).encode()


def _verdicts_from(data: bytes) -> dict[int, Verdict]:
    return {
        int(i): Verdict(ok, reason, stats) for i, (ok, reason, stats) in json.loads(data).items()
    }


class ShardedRescorer(Rescorer):
    """The re-scorer with its model sharded over the ranks: rank 0 keeps the published states
    and broadcasts a version's weights into the shards when groups claim it; each rank scores
    its share of the groups (one forward, so every rank runs the same collectives), and the
    verdicts are gathered on every rank."""

    def __init__(self, spec: ModelSpec, d: Dist, names: list[str], **kw: Any) -> None:
        super().__init__(spec, **kw)
        self.d = d
        # Tied names export_state leaves out, each with the name it publishes the tensor as.
        full = self.model.state_dict(keep_vars=True)
        first = {id(full[n]): n for n in names}
        self.twins = {n: first[id(t)] for n, t in full.items() if n not in names}
        distributed.shard_model(self.model)  # fp32: verdicts compare with nodes' log-probs

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        super().remember(version, state if self.d.leader else {})

    def _load(self, version: int) -> None:
        state: dict[str, torch.Tensor] = {}
        if self.d.leader:
            published = self._states[version]
            state = {n: t.float() if t.is_floating_point() else t for n, t in published.items()}
            state.update({n: state[twin] for n, twin in self.twins.items()})
        set_model_state_dict(
            self.model,
            state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )

    def _share(self, members: list[int]) -> list[int]:
        return [members[i] for i in distributed.share(len(members), self.d.rank, self.d.world)]

    @torch.no_grad()  # not inference_mode: FSDP's gathered weights must stay ordinary tensors
    def _token_stats(self, groups: list[TrainGroup]) -> list[tuple[torch.Tensor, ...]]:
        # One forward over whole sequences on every rank, even one whose share is empty: the
        # prompt-cache prefill takes one pass or two depending on the groups, and the sharded
        # model's collectives need every rank in every pass.
        pad = self.pad_id
        prompts = [list(g.prompt_ids) for g in groups] or [[pad]]
        completions = [[list(c) for c in g.completions] for g in groups] or [[[pad]]]
        batch = pad_batch(prompts, completions, pad, self.d.device)
        logits = self.model(input_ids=batch.ids, attention_mask=batch.mask).logits
        if not groups:
            return []
        return self._stats_from(
            groups, logits[:, :-1][batch.target], batch.ids[:, 1:][batch.target]
        )

    def _gather(self, out: list[Verdict | None]) -> None:
        mine = {i: v for i, v in enumerate(out) if v is not None}
        for data in distributed.all_gather_bytes(self.d, _verdict_bytes(mine)):
            for i, v in _verdicts_from(data).items():
                out[i] = out[i] or v


class ShardedTrainer(Trainer):
    """A :class:`~echo.learner.trainer.Trainer` on one rank of an FSDP2 learner; see the module
    docstring."""

    def __init__(
        self,
        spec: JobSpec,
        model_spec: ModelSpec,
        learner: GRPOLearner,
        task: Any,
        tokenizer: Any,
        d: Dist,
        names: list[str],
        mixed: bool,
    ) -> None:
        """``names``: the tensors published (see :func:`export_names`); ``mixed``: the policy
        computes in bf16."""
        self.d, self.names, self.mixed = d, names, mixed
        super().__init__(spec, model_spec, learner, task, tokenizer)

    def make_rescorer(self) -> Rescorer:
        return ShardedRescorer(
            self.model_spec,
            self.d,
            self.names,
            keep=self.spec.staleness + 1,
            temperature=self.spec.sampling.temperature,
            device=self.d.device,
        )

    def _fused_version(self) -> int:
        # bf16 compute differs from the fp32 weights nodes sample with: judge from a prefill.
        return -1 if self.mixed else super()._fused_version()

    def share(self, order: list[int]) -> list[int]:
        return [order[i] for i in distributed.share(len(order), self.d.rank, self.d.world)]

    def gather_verdicts(self, results: dict[int, Verdict], mine: list[int]) -> None:
        own = {i: results[i] for i in mine}
        for data in distributed.all_gather_bytes(self.d, _verdict_bytes(own)):
            results.update(_verdicts_from(data))

    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights as nodes receive them, gathered whole on rank 0 (on the CPU); {} on the
        other ranks."""
        full = get_model_state_dict(self.learner.model, options=FULL)
        if not self.d.leader:
            return {}
        target = DTYPES[self.spec.publish_dtype]
        out = {}
        for name in self.names:
            t = full[name]
            t = t.to(target) if t.is_floating_point() else t
            # Never alias a tensor a later gather might reuse.
            out[name] = t.contiguous().clone() if t.data_ptr() == full[name].data_ptr() else t
        return dict(sorted(out.items()))

    def save_checkpoint(self, root: Path, anchor_version: int, report: bytes) -> None:
        dcp_checkpoint.save(
            root,
            self.version,
            anchor_version,
            report,
            self.learner.model,
            self.learner.opt,
            self.d.leader,
        )


def _broadcast_module(d: Dist, module: torch.nn.Module) -> None:
    """Rank 0's weights of the (unsharded, CPU) ``module`` into every rank's copy."""
    with torch.no_grad():
        for t in module.state_dict().values():
            dist.broadcast(t, src=0, group=d.commands)


def build(
    spec: JobSpec, model_spec: ModelSpec, job_dir: Path, d: Dist
) -> tuple[ShardedTrainer, checkpoint.Checkpoint | None]:
    """Every rank's trainer, at the newest checkpoint under ``job_dir`` (a DCP one, read with
    however many ranks wrote it, or the single learner's), else a fresh model after the job's
    format warm-up (run on rank 0, its weights then broadcast). The returned checkpoint holds
    the version, anchor and report only. Collective: every rank calls it.

    :raises OSError: an unreadable model folder or checkpoint.
    """
    model = build_model(model_spec, seed=spec.model.seed)
    names = export_names(model)
    task = make_task(spec.task.name, dict(spec.task.params))
    tokenizer = load_tokenizer(model_spec) if model_spec.kind == "hf" else None
    root = job_dir / "checkpoints"
    found = newest_checkpoint(root, d)

    def initial(m: torch.nn.Module) -> torch.nn.Module:
        """``m`` after the job's format warm-up (computed once, on rank 0)."""
        if spec.warmup.steps:
            if d.leader:
                t0 = time.perf_counter()
                warmup(
                    m,
                    model_spec,
                    task,
                    steps=spec.warmup.steps,
                    lr=spec.warmup.lr,
                    seed=spec.model.seed,
                    cache_dir=job_dir.parent.parent / "cache",
                )
                log.info("format warm-up done in %.1f s", time.perf_counter() - t0)
            _broadcast_module(d, m)
        return m

    single = None
    if found is None:
        initial(model)
    elif not dcp_checkpoint.is_dcp(found):  # the single learner's: every rank reads it whole
        single = single_checkpoint(root, found)
        model.load_state_dict(single.model_state)
    reference = None
    if spec.grpo.kl_coef > 0:  # the KL term's anchor is the starting policy
        reference = build_model(model_spec, seed=spec.model.seed)
        if found is None:
            reference.load_state_dict(model.state_dict())  # the policy just warmed up
        else:
            initial(reference)
    learner, resumed, mixed = shard_and_resume(spec, d, model, reference, found, single)
    trainer = ShardedTrainer(spec, model_spec, learner, task, tokenizer, d, names, mixed)
    trainer.rescorer.remember(learner.version, trainer.published_state())
    return trainer, resumed


def newest_checkpoint(root: Path, d: Dist) -> Path | None:
    """The folder of the newest checkpoint under ``root`` as rank 0 sees it (None: none), the
    same on every rank: they must agree whatever they see. Collective."""
    newest = str(max(checkpoint.versions(root), default=-1)).encode() if d.leader else None
    version = int(distributed.broadcast_bytes(d, newest))
    return version_dir(root, version) if version >= 0 else None


def single_checkpoint(root: Path, found: Path) -> checkpoint.Checkpoint:
    """The single learner's checkpoint in ``found`` (not a DCP one), read whole.

    :raises OSError: it is not the newest readable one under ``root``.
    """
    version = int(json.loads((found / "meta.json").read_text())["version"])
    single = checkpoint.latest(root)
    if single is None or single.version != version:
        raise OSError(f"cannot read the checkpoint of v{version} under {root}")
    return single


def shard_and_resume(
    spec: JobSpec,
    d: Dist,
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    found: Path | None,
    single: checkpoint.Checkpoint | None,
    adapter: bool = False,
) -> tuple[GRPOLearner, checkpoint.Checkpoint | None, bool]:
    """The common tail of both builds: ``model`` (and the KL ``reference``) sharded, the
    learner over the ranks, and, with a checkpoint ``found``, its optimizer state loaded (by
    name from the single learner's ``single``, else from the DCP shards; ``adapter``: the
    trainable tensors only) and its version, anchor and report. Collective.

    Returns the learner, the resumed checkpoint (no states: they are loaded) or None, and
    whether the policy computes in bf16.
    """
    policy = distributed.mixed_precision(d.device)
    distributed.shard_model(model.to(d.device), policy, d.checkpoint_layers)
    if reference is not None:  # no grad: nothing to recompute
        distributed.shard_model(reference.to(d.device), policy)
    learner = GRPOLearner(
        model, spec.grpo, spec.sampling.temperature, reference, across=RankSums(d)
    )
    if found is None:
        return learner, None, policy is not None
    meta = json.loads((found / "meta.json").read_text())
    if single is not None:
        set_optimizer_state_dict(
            model,
            learner.opt,
            optim_by_name(model, single.optim_state),
            options=StateDictOptions(full_state_dict=True),
        )
    else:
        dcp_checkpoint.load_sharded(found, model, learner.opt, adapter=adapter)
    learner.version = int(meta["version"])
    resumed = checkpoint.Checkpoint(
        version=learner.version,
        anchor_version=int(meta["anchor_version"]),
        model_state={},
        optim_state={},
        report=(found / "report.bin").read_bytes(),
    )
    return learner, resumed, policy is not None


def optim_by_name(model: torch.nn.Module, optim_state: dict) -> dict:
    """The single learner's positional optimizer state keyed by parameter name (its optimizer
    was built over the trainable ``model.parameters()``, in that order)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = optim_state["param_groups"]
    return {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }
