"""A GRPO step computed in parts (``GRPOLearner.parts``, the arithmetic of that many FSDP2 ranks)
and the float64 gradient clipping (``echo.learner.algorithm.clip``): the same update as one part,
and the same clipping as torch's. That the parts reproduce the ranks bit for bit is
``tests/learner/test_learner_fsdp.py``'s (under torchrun)."""

from __future__ import annotations

import copy

import pytest
import torch

from echo.learner.algorithm.clip import clip_gradients
from echo.learner.algorithm.grpo import Across, GRPOConfig, GRPOLearner, shares
from echo.models.spec import ModelSpec, build_model
from tests.learner.test_grpo import make_groups

SPEC = ModelSpec()
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]


def test_shares_split_contiguously_larger_first() -> None:
    assert shares(3, 2) == [range(0, 2), range(2, 3)]
    assert shares(5, 2) == [range(0, 3), range(3, 5)]
    assert shares(1, 2) == [range(0, 1), range(1, 1)]
    assert shares(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert shares(0, 1) == [range(0, 0)]


def test_a_step_in_parts_is_the_same_update() -> None:
    """Parts change only the float32 order of the sums: the weights agree within a thousandth
    of an Adam step (lr 1e-2), and parts beyond the group count are left empty."""
    model = build_model(SPEC, seed=1)
    learners = {n: GRPOLearner(copy.deepcopy(model), GRPOConfig(lr=1e-2)) for n in (1, 2, 5)}
    groups = make_groups(learners[1], REWARDS)
    metrics = {}
    for n, learner in learners.items():
        learner.parts = n
        metrics[n] = learner.step(copy.deepcopy(groups))
    one = dict(learners[1].model.named_parameters())
    for n in (2, 5):
        assert metrics[n]["tokens"] == metrics[1]["tokens"]
        assert metrics[n]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)
        assert metrics[n]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-5)
        for name, p in learners[n].model.named_parameters():
            assert float((p - one[name]).abs().max()) <= 1e-5, (n, name)
    moved = max(float((p - q).abs().max()) for p, q in zip(
        learners[1].model.parameters(), model.parameters(), strict=True))  # fmt: skip
    assert moved > 1e-3  # the step did move the weights


def test_parts_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 part"):
        GRPOLearner(build_model(SPEC, seed=1), parts=0)


def grads_of(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((64, 32), (32,), (7, 3, 5))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left out
    return params


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_clip_gradients_clips_as_torch_does(scale: float) -> None:
    mine, theirs = grads_of(0, scale), grads_of(0, scale)
    before = [p.grad.clone() for p in mine[:3]]
    norm = clip_gradients(mine, 1.0, Across().sum)
    want = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert norm == pytest.approx(want, rel=1e-6)
    for p, q, b in zip(mine[:3], theirs[:3], before, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)
        if norm < 1.0:
            assert torch.equal(p.grad, b)  # under the limit: untouched, to the bit
    total = float(torch.cat([p.grad.flatten() for p in mine[:3]]).norm())
    assert total == pytest.approx(min(norm, 1.0), rel=1e-5)
