"""The learner's compute: a batch from the coordinator in, one GRPO version out.

:class:`Trainer` owns the policy and its optimizer
(:class:`~echo.learner.algorithm.grpo.GRPOLearner`), the re-scorer with the weights of the versions
a group may still claim, the task and its held-out evaluation. :meth:`Trainer.train` takes one batch
through three stages, each in its own module: the wire records as GRPO groups (:func:`train_groups`:
the coordinator verified and decoded them once, so nothing is unpacked here), the re-scoring gate
(``echo.learner.rescoring.rescore``), and the GRPO step (``echo.learner.algorithm.grpo``, which
refuses a token id outside the vocabulary). It does no I/O: the learner process
(``echo.learner.service``) publishes, checkpoints and reports what it returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echo.learner.algorithm.grpo import GRPOLearner, TrainGroup
from echo.learner.checkpoints import checkpoint
from echo.learner.evaluate import greedy_accuracy
from echo.learner.rescoring.rescore import Rescorer, Verdict, token_stats
from echo.learner.warmup import warmup
from echo.models.spec import ModelSpec, build_model, load_tokenizer
from echo.models.weights import export_state
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.jobspec import JobSpec
from echo.tasks.registry import make_task

log = logging.getLogger("echo.learner")

def train_groups(batch: list[m.TrainingGroup]) -> tuple[list[TrainGroup], list[list[str]]]:
    """The groups as the GRPO step reads them, and each completion's finish reason: the wire
    records carry them in that form (protocol 9), so this only regroups their fields."""
    groups, finish = [], []
    for g in batch:
        groups.append(
            TrainGroup(
                g.prompt_tokens,
                [c.token_ids for c in g.completions],
                [c.logprobs for c in g.completions],
                list(g.rewards),
                g.version,
            )
        )
        finish.append([c.finish_reason for c in g.completions])
    return groups, finish


@dataclass
class StepResult:
    """What one step trained on and what it found: the learner reports all of it."""

    trained: list[str]  # rollout ids that went into the new version
    verdicts: list[m.RescoreVerdict]  # one per group of the batch, passed or not
    metrics: dict[str, float]


class Trainer:
    """The policy, its re-scorer and its evaluation for one job; see the module docstring."""

    def __init__(
        self,
        spec: JobSpec,
        model_spec: ModelSpec,
        learner: GRPOLearner,
        task: Any,
        tokenizer: Any = None,
        rescorer: Rescorer | None = None,
    ) -> None:
        """``rescorer``: default, one over a fresh model of ``model_spec``."""
        self.spec = spec
        self.model_spec = model_spec
        self.learner = learner
        self.task = task
        self.tokenizer = tokenizer
        self.rescorer = rescorer or self.make_rescorer()
        # Verdicts reached ahead of the step, by rollout id, and the seconds spent reaching them.
        self._early: dict[str, Verdict] = {}
        self._early_s = 0.0

    def make_rescorer(self) -> Rescorer:
        """The re-scorer, holding the weights of the ``staleness + 1`` newest versions."""
        return Rescorer(
            self.model_spec,
            keep=self.spec.staleness + 1,
            temperature=self.spec.sampling.temperature,
            device=self.learner.device,
        )

    @classmethod
    def build(
        cls,
        spec: JobSpec,
        model_spec: ModelSpec,
        job_dir: Path,
        device: torch.device | str = "cpu",
    ) -> tuple[Trainer, checkpoint.Checkpoint | None]:
        """The trainer at its newest checkpoint under ``job_dir`` (returned too), else a fresh
        model after the job's format warm-up, computing on ``device`` (the policy, the
        optimizer and the re-scorer; published states and checkpoints are on the CPU whatever
        the device, so a learner may restart on another). Blocking: run it in a worker thread.

        :raises OSError: an unreadable model folder or checkpoint.
        """
        # Initialised on the CPU, so that a seed gives the same weights on every device.
        model = build_model(model_spec, seed=spec.model.seed).to(device)
        task = make_task(spec.task.name, dict(spec.task.params))
        tokenizer = load_tokenizer(model_spec) if model_spec.kind == "hf" else None
        ckpt = checkpoint.latest(job_dir / "checkpoints")

        # A validated spec holds the steps its model kind defaults to (0 for a pretrained
        # model), or those the job asked for.
        def initial(m: torch.nn.Module) -> torch.nn.Module:
            """``m`` after the job's format warm-up: the policy GRPO starts from."""
            if spec.warmup.steps:
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
            return m

        reference = None
        if ckpt is None:
            initial(model)
        else:
            model.load_state_dict(ckpt.model_state)
            if spec.grpo.kl_coef > 0:  # the KL term's anchor is the starting policy, again
                reference = initial(build_model(model_spec, seed=spec.model.seed).to(device))
        learner = GRPOLearner(model, spec.grpo, spec.sampling.temperature, reference)
        if ckpt is not None:
            learner.opt.load_state_dict(ckpt.optim_state)
            learner.version = ckpt.version
        trainer = cls(spec, model_spec, learner, task, tokenizer)
        trainer.rescorer.remember(learner.version, trainer.published_state())
        return trainer, ckpt

    @property
    def version(self) -> int:
        """Steps taken: the version the current weights are published as."""
        return self.learner.version

    def make_checkpoint(self, anchor_version: int, report: bytes) -> checkpoint.Checkpoint:
        """What :meth:`build` restores from: the weights (copied to the CPU, so that training on
        may go on while they are written) and the optimizer at the current version."""
        return checkpoint.Checkpoint(
            version=self.version,
            anchor_version=anchor_version,
            model_state={
                k: v.detach().to("cpu", copy=True)
                for k, v in self.learner.model.state_dict().items()
            },
            optim_state=self.learner.opt.state_dict(),
            report=report,
        )

    def save_checkpoint(self, root: Path, anchor_version: int, report: bytes) -> None:
        """Make the current version's checkpoint durable under ``root`` (before its report
        is sent). :raises OSError: the disk refused."""
        checkpoint.save(root, self.make_checkpoint(anchor_version, report))

    def share(self, order: list[int]) -> list[int]:
        """The groups of ``order`` (batch indices) this process steps on: all of them here;
        one rank's share under FSDP2 (``echo.learner.fsdp.trainer``)."""
        return order

    def gather_verdicts(self, results: dict[int, Verdict], mine: list[int]) -> None:
        """Complete ``results`` with the verdicts other processes reached on their shares of
        the step: none here."""

    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights as nodes receive them (in the job's publish dtype)."""
        return export_state(self.learner.model, self.spec.publish_dtype)

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep ``state`` to re-score groups that claim ``version`` later."""
        self.rescorer.remember(version, state)

    def evaluate(self, force: bool = False) -> dict[str, float]:
        """Held-out greedy accuracy every ``eval.every`` versions and at the last one (or now,
        with ``force``); {} when it is not due."""
        every, v = self.spec.eval.every, self.version
        if not every or not (force or v % every == 0 or v == self.spec.steps):
            return {}
        t0 = time.perf_counter()
        acc = greedy_accuracy(
            self.learner.model,
            self.model_spec,
            self.task,
            n=self.spec.eval.prompts,
            tokenizer=self.tokenizer,
            chat=self.spec.task.chat,
        )
        return {"eval_accuracy": acc, "eval_s": time.perf_counter() - t0}

    def _fused_version(self) -> int:
        """The version whose groups the step judges from its own forward; -1 when the published
        weights are not the master weights (a bf16 policy differs from the fp32 master)."""
        return self.version if self.spec.publish_dtype == "float32" else -1

    def prescore(self, groups: list[m.TrainingGroup]) -> None:
        """Re-score ``groups`` from older versions now, while the learner waits for the rest of
        its batch: the same check under the same weights :meth:`train` would run, taken off
        the step's critical path. Groups from the current weights are left to the step, which
        judges them from its own forward at no extra cost.

        """
        current = self._fused_version()
        todo = [g for g in groups if g.version != current and g.rollout_id not in self._early]
        if not todo:
            return
        decoded, finish = train_groups(todo)
        verdicts = self.rescorer.check(decoded, finish, [g.engine for g in todo])
        self._early.update(zip((g.rollout_id for g in todo), verdicts, strict=True))
        self._early_s += self.rescorer.last_seconds

    def train(self, batch: list[m.TrainingGroup]) -> StepResult:
        """Gate and train on ``batch``; the weights become version ``version + 1`` even when
        every group fails the gate (the version then equals the last one).

        Groups sampled from older versions are re-scored by a prefill under those weights;
        groups from the current weights are judged inside the step, from its own forward (only
        when the published weights are the master weights: a bf16 policy differs from the fp32
        master the step runs on).

        :raises ValueError: a group the GRPO step refuses (see ``TrainGroup.check``).
        """
        decoded, finish = train_groups(batch)
        engines = [g.engine for g in batch]
        current = self._fused_version()
        results: dict[int, Verdict] = {
            i: self._early[g.rollout_id] for i, g in enumerate(batch) if g.rollout_id in self._early
        }
        older = [i for i, g in enumerate(decoded) if g.version != current and i not in results]
        results.update(
            zip(
                older,
                self.rescorer.check(
                    [decoded[i] for i in older],
                    [finish[i] for i in older],
                    [engines[i] for i in older],
                ),
                strict=True,
            )
        )
        rescore_s = self.rescorer.last_seconds if older else 0.0
        prescore_s = self._early_s
        self._early, self._early_s = {}, 0.0
        order = [i for i in range(len(batch)) if i not in results or results[i].ok]
        mine = self.share(order)

        def gate(stats: list[tuple[torch.Tensor, ...]]) -> list[bool]:
            nonlocal rescore_s
            t0 = time.perf_counter()
            for i, st in zip(mine, stats, strict=True):
                if i not in results:
                    results[i] = self.rescorer.judge(decoded[i], finish[i], engines[i], *st)
            rescore_s += time.perf_counter() - t0
            return [results[i].ok for i in mine]

        if order:
            metrics = self.learner.step(
                [decoded[i] for i in mine], gate=gate, gate_stats=token_stats
            )
            self.gather_verdicts(results, mine)
        else:
            metrics = {"reward": 0.0, "step_s": 0.0}
            self.learner.version += 1
        trained, verdicts = [], []
        for i, g in enumerate(batch):
            res = results.get(i) or Verdict(False, R.UNSCORABLE)
            verdicts.append(
                m.RescoreVerdict(
                    rollout_id=g.rollout_id, ok=res.ok, reason=res.reason, stats=res.stats
                )
            )
            if res.ok:
                trained.append(g.rollout_id)
        metrics["rejected"] = float(len(batch) - len(trained))
        # rescore_s is on the step's critical path; prescore_s was spent while waiting for the
        # batch. Their share of the learner's time is the re-scoring cost a researcher pays.
        metrics["rescore_s"] = rescore_s
        metrics["prescore_s"] = prescore_s
        metrics["rescored_early"] = float(
            sum(1 for i in results if i not in older and batch[i].version != current)
        )
        metrics["rescored_in_step"] = float(len(older))
        metrics.update(self.evaluate())
        return StepResult(trained, verdicts, metrics)
