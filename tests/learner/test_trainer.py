"""The learner's compute: decoding, the re-scoring gate ahead of the step, evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from echo.learner.algorithm.grpo import GRPOLearner
from echo.learner.evaluate import EVAL_PROMPT_BASE, greedy_accuracy, greedy_completions
from echo.learner.trainer import Trainer
from echo.models.spec import ModelSpec, build_model, encode_prompt
from echo.models.tokenizer import EOS_ID
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.jobspec import JobSpec
from echo.tasks import make_task

SPEC = ModelSpec()
TASK = make_task("addition", {"max_operand": 5})


def batch_from(engine: TorchEngine, version: int, n: int, seed: int) -> list[m.TrainingGroup]:
    reqs = [GenRequest(encode_prompt(SPEC, TASK.prompt(seed + i)), 4,
                       SamplingParams(max_new_tokens=3, seed=seed + i)) for i in range(n)]
    return [
        m.TrainingGroup(
            rollout_id=f"r{seed}-{i}", node_id="n", prompt_id=seed + i,
            prompt_tokens=list(reqs[i].prompt_ids), version=version, engine="torch",
            rewards=[float(j % 2) for j in range(len(comps))],
            # Log-probs as the coordinator hands them on: float32, as the node packed them.
            completions=[m.TrainingCompletion(token_ids=list(c.token_ids),
                                              logprobs=np.float32(c.logprobs).tolist(),
                                              finish_reason=c.finish_reason) for c in comps])
        for i, comps in enumerate(engine.generate(reqs))
    ]


def trainer_pair() -> tuple[Trainer, Trainer, TorchEngine]:
    job = JobSpec(name="t", staleness=2)
    a, b = (Trainer(job, SPEC, GRPOLearner(build_model(SPEC, seed=3), job.grpo), TASK)
            for _ in range(2))
    engine = TorchEngine(SPEC, threads=1)
    state = export_state(a.learner.model)
    engine.load_state(state)
    for t in (a, b):
        t.remember(0, state)
        t.learner.version = 1  # the groups below are one version old
    return a, b, engine


def test_prescored_groups_skip_the_step_prefill_with_the_same_verdicts() -> None:
    a, b, engine = trainer_pair()
    batch = batch_from(engine, 0, 4, seed=10)
    a.prescore(batch[:3])  # three arrived while the learner waited
    ra, rb = a.train(batch), b.train(batch)
    assert ra.metrics["rescored_early"] == 3 and ra.metrics["rescored_in_step"] == 1
    assert rb.metrics["rescored_early"] == 0 and rb.metrics["rescored_in_step"] == 4
    assert ra.trained == rb.trained == [g.rollout_id for g in batch]
    assert [(v.ok, v.reason) for v in ra.verdicts] == [(v.ok, v.reason) for v in rb.verdicts]
    # The figures agree up to float rounding. The re-scoring prefill's matrix products take
    # their shapes from the batch (echo.learner.rescoring.prefill), so a group's log-probs can round
    # differently with other batch-mates (measured: 2e-7 nats); the count test's limit, a sum
    # over the tokens below IMPROBABLE_P, moved more (0.0014 in 14). Both are far inside the
    # thresholds' margins.
    for va, vb in zip(ra.verdicts, rb.verdicts, strict=True):
        assert va.stats.keys() == vb.stats.keys()
        for k in va.stats:
            assert va.stats[k] == pytest.approx(vb.stats[k], rel=1e-3, abs=1e-6), k
    assert ra.metrics["prescore_s"] > 0 and rb.metrics["prescore_s"] == 0
    # Same groups, same verdicts: the two policies took the same step.
    for pa, pb in zip(a.learner.model.parameters(), b.learner.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_prescore_catches_what_the_step_would_catch() -> None:
    a, _, engine = trainer_pair()
    batch = batch_from(engine, 0, 2, seed=20)
    forged = batch[1].completions[0]
    batch[1].completions[0] = m.TrainingCompletion(
        token_ids=forged.token_ids, logprobs=[x - 2.0 for x in forged.logprobs],
        finish_reason=forged.finish_reason)
    a.prescore(batch)
    res = a.train(batch)
    assert res.trained == [batch[0].rollout_id]
    assert [v.reason for v in res.verdicts] == ["", R.RESCORE_MISMATCH]


def test_greedy_accuracy_is_held_out_and_batch_independent() -> None:
    model = build_model(SPEC, seed=1)
    prompts = [encode_prompt(SPEC, TASK.prompt(EVAL_PROMPT_BASE + i)) for i in range(5)]
    together = greedy_completions(model, prompts, 3, eos_id=EOS_ID)
    alone = [greedy_completions(model, [p], 3, eos_id=EOS_ID)[0] for p in prompts]
    assert together == alone
    acc = greedy_accuracy(model, SPEC, TASK, n=32)
    assert 0.0 <= acc <= 1.0
