"""The sampling-shape test's z part under a peaked policy (its false rejections were real).

A long benchmarks/attack.py run trained the tiny model until its median token probability was
0.998; honest groups of 16 tokens with one rare token then scored z -5.0 to -5.5 against the
normal tail's -5, and enough were rejected to exclude every honest node. These tests sample
honest groups from such a policy and check the Bernstein decision never rejects them, while
tokens the policy would not sample still fail.
"""

from __future__ import annotations

import math

import torch

from echo.learner.rescore import (
    SHAPE_CLIP,
    SHAPE_MIN_EXPONENT,
    SHAPE_MIN_Z,
    shape_exponent,
    token_stats,
)

VOCAB = 50
TOKENS = 16


def _peaked_policy(top_p: float) -> torch.Tensor:
    """(TOKENS, VOCAB) log-probs: one token at ``top_p`` in every row, the rest spread evenly."""
    p = torch.full((TOKENS, VOCAB), (1.0 - top_p) / (VOCAB - 1), dtype=torch.float64)
    p[:, 0] = top_p
    return p.log()


def _scores(logp: torch.Tensor, chosen: torch.Tensor) -> tuple[float, float]:
    """(Bernstein exponent, normal z) of a group that chose ``chosen`` (one token per row)."""
    ent, _q, m2 = token_stats(logp)
    lp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    clipped = (lp + ent).clamp(min=-SHAPE_CLIP)
    z = float(clipped.sum() / math.sqrt(float(m2.sum()) + 1e-9))
    return shape_exponent(float(clipped.sum()), float(m2.sum())), z


def test_one_rare_honest_token_under_a_peaked_policy_passes() -> None:
    logp = _peaked_policy(0.998)
    chosen = torch.zeros(TOKENS, dtype=torch.long)
    chosen[5] = 7  # one rare token, as the policy samples now and then
    exponent, z = _scores(logp, chosen)
    assert z < SHAPE_MIN_Z  # the normal tail rejected this honest group
    assert exponent < SHAPE_MIN_EXPONENT


def test_honest_samples_are_never_rejected_and_foreign_tokens_are() -> None:
    gen = torch.Generator().manual_seed(0)
    for top_p in (0.998, 0.99, 0.9, 0.5):
        logp = _peaked_policy(top_p)
        normal_rejects = bernstein_rejects = 0
        for _ in range(2000):
            chosen = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            exponent, z = _scores(logp, chosen)
            normal_rejects += z < SHAPE_MIN_Z
            bernstein_rejects += exponent > SHAPE_MIN_EXPONENT
        assert bernstein_rejects == 0, (top_p, bernstein_rejects)
        if top_p == 0.998:
            assert normal_rejects > 0  # the flaw the Bernstein decision fixes
    # Tokens the policy gives almost nothing (random tokens, another model's): rejected.
    for top_p in (0.998, 0.99, 0.9):
        logp = _peaked_policy(top_p)
        foreign = torch.randint(1, VOCAB, (TOKENS,), generator=gen)
        assert _scores(logp, foreign)[0] > SHAPE_MIN_EXPONENT, top_p
