"""How the llama.cpp engine samples: temperature, top-p and a random stream per sample.

llama.cpp hands the engine each step's logits; :func:`sample` picks one token per row and reports
``log_softmax(logits / temperature)`` of it over the full vocabulary before top-p truncation (the
convention of :mod:`echo.node.engines.base`). :func:`sample_rng` gives each sample its own stream,
seeded from the request's seed and the sample's index, so results do not depend on batching.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from echo.node.engines.base import SamplingParams


def sample_rng(params: SamplingParams, sample: int) -> np.random.Generator | None:
    """Sample ``sample``'s own random stream: from (seed, sample index), so it does not depend on
    batching; None for greedy."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng([seed, sample])


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    rngs: list[np.random.Generator | None],
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` (rows, vocab) and its log-prob under the engine convention.

    The log-prob is ``log_softmax(logits / temperature)`` over the full vocabulary, before top-p
    (temperature 0: greedy argmax and the raw ``log_softmax``). Top-p keeps the smallest prefix of
    the sorted distribution whose mass reaches ``top_p`` (the top token always stays) and samples
    from it by inverse CDF with one uniform draw from the row's generator.
    """
    logits = logits.float()
    temps = torch.tensor([p.temperature or 1.0 for p in params]).unsqueeze(1)
    logp = torch.log_softmax(logits / temps, dim=-1)
    toks = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    if sampled:
        idx = torch.tensor(sampled)
        lp = logp[idx].double()
        probs = lp.exp()
        top_p = torch.tensor([params[i].top_p for i in sampled], dtype=torch.float64)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_p.cumsum(-1) - sorted_p
            drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(
                1, order, mass_before >= top_p.unsqueeze(1)
            )
            probs = probs.masked_fill(drop, 0.0)
        cdf = probs.cumsum(-1)
        u = torch.tensor([rngs[i].random() for i in sampled], dtype=torch.float64)  # type: ignore[union-attr]
        draw = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        toks[idx] = draw.clamp(max=logits.shape[1] - 1)
    chosen = logp.gather(1, toks.unsqueeze(1)).squeeze(1)
    return toks.tolist(), chosen.tolist()
