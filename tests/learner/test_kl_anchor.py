"""The KL term (``[job.grpo] kl_coef``): it holds the policy near the one GRPO started from, and a
learner restored from a checkpoint holds it near that same policy, not near the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner, TrainGroup
from echo.learner.checkpoints import checkpoint
from echo.learner.trainer import Trainer
from echo.models.spec import ModelSpec, build_model
from echo.models.tokenizer import EOS_ID, encode
from echo.protocol.jobspec import JobSpec

SPEC = ModelSpec()


def groups_of(learner: GRPOLearner) -> list[TrainGroup]:
    """Two groups with a spread of rewards, their behaviour log-probs the learner's own."""
    out = []
    for g in range(2):
        comps = [encode(str(i)) + [EOS_ID] for i in range(4)]
        out.append(
            TrainGroup(encode(f"{g}+1=", add_bos=True), comps, [[0.0] * 2] * 4, [1.0, 0, 0, 1.0])
        )
    for grp, scored in zip(out, learner.score(out), strict=True):
        grp.behaviour_logprobs = scored
    return out


def test_kl_is_zero_at_the_start_and_grows_as_the_policy_moves() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1), GRPOConfig(lr=1e-2, kl_coef=0.1))
    start = [p.detach().clone() for p in learner.model.parameters()]
    kls = [learner.step(groups_of(learner))["kl"] for _ in range(4)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the policy is its own reference
    assert kls[-1] > 1e-4
    assert learner.reference is not None
    for p, q in zip(learner.reference.parameters(), start, strict=True):
        assert torch.equal(p, q) and not p.requires_grad  # the anchor never trains


def test_without_kl_there_is_no_reference() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1))
    assert learner.reference is None
    assert "kl" not in learner.step(groups_of(learner))


def test_a_restored_learner_keeps_the_starting_policy_as_its_anchor(tmp_path: Path) -> None:
    job = JobSpec(name="t", staleness=2, grpo={"kl_coef": 0.1, "lr": 1e-2}, warmup={"steps": 3})
    trainer, ckpt = Trainer.build(job, SPEC, tmp_path / "job")
    assert ckpt is None and trainer.learner.reference is not None
    anchor = [p.detach().clone() for p in trainer.learner.reference.parameters()]
    for _ in range(3):
        trainer.learner.step(groups_of(trainer.learner))
    checkpoint.save(tmp_path / "job" / "checkpoints", trainer.make_checkpoint(0, b""))
    again, ckpt = Trainer.build(job, SPEC, tmp_path / "job")
    assert ckpt is not None and again.version == 3
    assert again.learner.reference is not None
    for p, q in zip(again.learner.reference.parameters(), anchor, strict=True):
        assert torch.equal(p, q)
    moved = any(
        not torch.equal(p, q) for p, q in zip(again.learner.model.parameters(), anchor, strict=True)
    )
    assert moved  # the restored policy is the checkpoint's, not the anchor
