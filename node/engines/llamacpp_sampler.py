"""How the llama.cpp engine samples: temperature, top-p and a random stream per sample.

llama.cpp hands the engine each step's logits; :func:`sample` picks one token per row and reports
``log_softmax(logits / temperature)`` of it over the full vocabulary before top-p truncation (the
convention of :mod:`echo.node.engines.base`). :func:`sample_rng` gives each sample its own stream,
seeded from the request's seed and the sample's index, so results do not depend on batching.

Sampling runs in NumPy on the calling thread, never in torch: torch's intra-op threads (OpenMP,
one per core by default) would wake for each step's few hundred microseconds of work and then
spin beside ggml's own threads, so on a machine with no idle core the two thread pools took
turns at each other's barriers (see ``docs/results/2026-12-07-engines-best.md``).
"""

from __future__ import annotations

import os

import numpy as np

from echo.node.engines.base import SamplingParams


def sample_rng(params: SamplingParams, sample: int) -> np.random.Generator | None:
    """Sample ``sample``'s own random stream: from (seed, sample index), so it does not depend on
    batching; None for greedy."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng([seed, sample])


def sample(
    logits: np.ndarray,
    params: list[SamplingParams],
    rngs: list[np.random.Generator | None],
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` (rows, vocab; float32) and its log-prob under the engine
    convention. ``logits`` is only read, so it may be a view of llama.cpp's own buffer.

    The log-prob is ``log_softmax(logits / temperature)`` over the full vocabulary, before top-p
    (temperature 0: greedy argmax and the raw ``log_softmax``), computed in float64. Top-p keeps
    the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (the top token
    always stays) and samples from it by inverse CDF with one uniform draw from the row's
    generator.
    """
    toks: list[int] = []
    lps: list[float] = []
    for row, p, rng in zip(logits, params, rngs, strict=True):
        z = row.astype(np.float64)
        if p.temperature not in (0, 1):
            z /= p.temperature
        z -= z.max()
        probs = np.exp(z)
        log_total = float(np.log(probs.sum()))
        if p.temperature == 0:
            tok = int(row.argmax())
        else:
            assert rng is not None
            tok = _draw(probs, p.top_p, rng)
        toks.append(tok)
        lps.append(float(z[tok]) - log_total)
    return toks, lps


def _draw(probs: np.ndarray, top_p: float, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from unnormalised ``probs``, truncated to the top-p nucleus."""
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        kept = probs[order]
        mass_before = np.cumsum(kept) - kept
        # Kept: the tokens whose preceding mass is below top_p of the total (the top one always).
        n = max(1, int(np.count_nonzero(mass_before < top_p * kept.sum())))
        cdf = np.cumsum(kept[:n])
        i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(order[min(i, n - 1)])
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, len(probs) - 1)
