"""Engines sample from the distribution whose log-probs they report.

The learner corrects for staleness and engine mismatch with the behaviour log-probs a node
reports; that is only right if the engine drew its tokens from exactly that distribution. Each
engine here draws many first tokens after one prompt, and every token's observed frequency must
match the probability the engine itself reported for it, within sampling error.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from echo.models.spec import ModelSpec
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from tests.engine_parity import peaked_model

SPEC = ModelSpec()
DRAWS = 4000
HAVE_LLAMA = (importlib.util.find_spec("gguf") is not None
              and importlib.util.find_spec("llama_cpp") is not None)


def make_engine(name: str, tmp_path: Path):
    if name == "torch":
        from echo.node.engines.torch_engine import TorchEngine

        return TorchEngine(SPEC, threads=1)
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed (pip install 'echo-swarm[llamacpp]')")
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    return LlamaCppEngine(SPEC, threads=1, workdir=tmp_path / "llama")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", ["torch", "llamacpp"])
def test_draws_follow_the_reported_probabilities(name: str, temperature: float,
                                                 tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = make_engine(name, tmp_path)
    try:
        engine.load_state(export_state(peaked_model(SPEC)))
        prompt = [1, 52, 46, 54, 64]
        reqs = [GenRequest(prompt, 250, SamplingParams(max_new_tokens=1, temperature=temperature,
                                                       seed=seed))
                for seed in range(DRAWS // 250)]
        counts: Counter[int] = Counter()
        reported: dict[int, float] = {}
        for group in engine.generate(reqs):
            for c in group:
                tok, lp = c.token_ids[0], c.logprobs[0]
                counts[tok] += 1
                # One prompt, one position: every draw of a token reports the same log-prob.
                assert reported.setdefault(tok, lp) == pytest.approx(lp, abs=1e-5)
    finally:
        engine.close()
        torch.set_num_threads(threads)
    probs = {t: math.exp(lp) for t, lp in reported.items()}
    # The tokens drawn carry almost all the mass the engine reported for them...
    assert sum(probs.values()) > 0.95, sum(probs.values())
    # ... and each frequent one is drawn as often as its reported probability says (5 sigma,
    # plus a little for the rare ones).
    checked = 0
    for tok, p in probs.items():
        if p < 0.01:
            continue
        freq = counts[tok] / DRAWS
        sigma = math.sqrt(p * (1 - p) / DRAWS)
        assert abs(freq - p) < 5 * sigma + 1e-3, (tok, freq, p)
        checked += 1
    assert checked >= 2  # the peaked model spreads its mass over more than one token
