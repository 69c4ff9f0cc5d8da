"""The per-token objective of a GRPO step: what each completion token contributes to the loss.

:func:`token_surrogate` owns the two objectives a job may pick (``[job.grpo] objective``); the
step (:meth:`echo.learner.algorithm.grpo.GRPOLearner.step`) takes the token-mean of its negative
over the batch's trained tokens. Per completion token t, with A the group-normalised advantage, mu_t
the node's behaviour log-prob of t and ratio_t = exp(log pi_theta(t) - mu_t):

``ppo`` (the default): PPO's clipped surrogate with a dual clip, its trust region anchored at
the behaviour policy::

    surr_t = min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    surr_t = max(surr_t, dual_clip * A)   if A < 0

A token whose probability the learner has already moved past the clip in the advantage's
direction stops pushing. A group sampled S versions ago finds part of its trust region used up
by the steps since: on SmolLM2 at S = 2 the clip stopped 4-20% of the tokens of each step.

``cispo``: the policy gradient with a clipped, detached importance weight (CISPO, MiniMax-M1)::

    surr_t = sg(clip(ratio_t, 1 - eps, 1 + eps)) * A * log pi_theta(t)

Every token keeps pushing, weighted as on-policy up to the clip: a stale token's weight is
bounded to [1 - eps, 1 + eps], so the steps since it was sampled cannot grow its pull (an
unbounded weight min(ratio, cap) made stale groups push further the way the last steps went,
and the reward collapsed: docs/learning.md). Measured on SmolLM2 at S = 2 it learned less than
``ppo`` (held-out gain +0.60 against +0.68 over 3 seeds each, intervals apart:
docs/results/2026-12-07-real-learning.md): the tokens ppo stops are the ones the steps since
sampling already moved the advantage's way, and pushing them on overshoots. ``ppo`` stays the
default.

On-policy (ratio 1 up to engine rounding) and with one epoch both give the same gradient,
A * grad log pi: a synchronous run does not depend on the choice.
"""

from __future__ import annotations

from typing import get_args

import torch

from echo.protocol.jobspec import GRPOParams

# The names a job may give (``GRPOParams.objective``), for command lines that offer them.
OBJECTIVES: tuple[str, ...] = get_args(GRPOParams.model_fields["objective"].annotation)


def token_surrogate(
    logp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, cfg: GRPOParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the surrogate to maximise (differentiable through ``logp``) and whether the
    objective's clip stopped or bounded that token (for ``clip_frac``). All three tensors are
    flat and aligned; raises nothing for a known ``cfg.objective``."""
    ratio = torch.exp(logp - behaviour)
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    if cfg.objective == "cispo":
        surrogate = clipped.detach() * adv * logp
        with torch.no_grad():
            bounded = (ratio != clipped) & (adv != 0)
        return surrogate, bounded
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    with torch.no_grad():
        active = torch.where(
            adv >= 0,
            ratio * adv <= clipped * adv,
            (ratio * adv >= clipped * adv) & (ratio <= cfg.dual_clip),
        )
        active |= adv == 0
    return surrogate, ~active
