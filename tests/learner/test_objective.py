"""The per-token objectives: ppo and cispo agree on-policy and part where a group is stale."""

from __future__ import annotations

import pytest
import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner
from echo.learner.algorithm.objective import token_surrogate
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state, state_digest
from echo.protocol.jobspec import JobSpec
from tests.learner.test_grpo import make_groups

SPEC = ModelSpec()


def gradient(objective: str, shift: float, adv: float) -> torch.Tensor:
    """d surrogate / d logp for one token whose behaviour log-prob is ``shift`` below logp."""
    logp = torch.tensor([-1.0], requires_grad=True)
    cfg = GRPOConfig(objective=objective)
    surrogate, _ = token_surrogate(logp, logp.detach() - shift, torch.tensor([adv]), cfg)
    surrogate.sum().backward()
    assert logp.grad is not None
    return logp.grad


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_on_policy_both_objectives_give_the_policy_gradient(adv: float) -> None:
    for objective in ("ppo", "cispo"):
        assert gradient(objective, 0.0, adv).item() == pytest.approx(adv, rel=1e-6)


def test_a_stale_token_past_the_clip_keeps_a_bounded_weight_under_cispo() -> None:
    # The policy made the token e^0.5 = 1.65 times likelier since it was sampled.
    assert gradient("ppo", 0.5, 1.0).item() == 0.0  # ppo: stopped by the trust region
    assert gradient("cispo", 0.5, 1.0).item() == pytest.approx(1.2)  # 1 + clip_eps
    # ... and e^-0.5 = 0.61 as likely, with a negative advantage: pushed down at 0.8, not 0.61.
    assert gradient("ppo", -0.5, -1.0).item() == 0.0
    assert gradient("cispo", -0.5, -1.0).item() == pytest.approx(-0.8)
    # Inside the region both push with the ratio itself.
    r = float(torch.tensor(0.1).exp())
    assert gradient("ppo", 0.1, 1.0).item() == pytest.approx(r, rel=1e-6)
    assert gradient("cispo", 0.1, 1.0).item() == pytest.approx(r, rel=1e-6)


def test_the_step_trains_a_group_ppo_stops_and_counts_its_bounded_tokens() -> None:
    """The group that ppo's trust region leaves untouched (test_grpo's anchored case) still
    trains under cispo, and clip_frac counts every token as bounded."""
    for objective, moves in (("ppo", False), ("cispo", True)):
        learner = GRPOLearner(build_model(SPEC, seed=1), GRPOConfig(objective=objective))
        groups = make_groups(learner, [[1.0, 0.0, 1.0, 0.0]], shift=-3.0)
        before = state_digest(export_state(learner.model))
        m = learner.step(groups)
        assert m["clip_frac"] == 1.0
        assert (state_digest(export_state(learner.model)) != before) is moves


def test_an_unknown_objective_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="objective"):
        JobSpec.model_validate({"steps": 2, "grpo": {"objective": "reinforce"}})
