"""How the policy trains: GRPO's hyper-parameters (``[job.grpo]``), how nodes sample rollouts
(``[job.sampling]``) and the supervised format warm-up before GRPO (``[job.warmup]``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GRPOParams(BaseModel):
    """GRPO's hyper-parameters, the ``[job.grpo]`` table: defined once, here, and read by the
    learner as they are (``echo.learner.algorithm.grpo``, whose docstring gives the objective)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # 7e-4, not 1e-3: one version of staleness makes a converged policy's answers swing (late
    # corrections under Adam's lr-sized steps); 7e-4 cut the swings threefold at every lag and
    # the swarm's late answer losses from 5 in 60 runs to none (README, "Answers lost late").
    lr: float = Field(default=7e-4, gt=0, le=1, description="AdamW learning rate")
    betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas")
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient norm clip")
    clip_eps: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="PPO trust region around the behaviour policy: ratio in [1-eps, 1+eps]",
    )
    dual_clip: float = Field(
        default=2.0, ge=1, description="a negative advantage's ratio counts at most this much"
    )
    objective: Literal["ppo", "cispo"] = Field(
        default="ppo",
        description="per-token objective: ppo (clipped surrogate anchored at the behaviour "
        "policy) or cispo (clipped, detached importance weight; every token keeps pushing)",
    )
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="optimizer steps per batch")
    adv_eps: float = Field(default=1e-6, gt=0, description="added to the group's reward std")
    kl_coef: float = Field(
        default=0.0, ge=0, le=10, description="weight of KL(policy || initial policy) (0: none)"
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> GRPOParams:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError("betas must be in [0, 1)")
        return self


class SamplingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(default=1.0, gt=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=8, ge=1, le=8192)


# Format warm-up steps when ``[job.warmup] steps`` is unset, by model kind: a random tiny model
# needs the answer's shape; random labels would damage a pretrained one.
WARMUP_STEPS_BY_KIND = {"tiny": 150, "hf": 0}


class WarmupSection(BaseModel):
    """``[job.warmup]``: supervised format warm-up before GRPO (``echo.learner.warmup``)."""

    model_config = ConfigDict(extra="forbid")
    steps: int | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="format warm-up steps on random-content answers; unset: 150 for the tiny "
        "model, 0 for a pretrained model (kind 'hf'), which random labels would damage: set it "
        "to warm a pretrained model up anyway. A validated job always holds the number",
    )
    lr: float = Field(default=3e-3, gt=0)
