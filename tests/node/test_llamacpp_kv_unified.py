"""The llama.cpp engine's choice between a unified KV cache and one KV stream per sequence.

A unified cache decodes short groups faster; with long completions of many sequences every token
attends over all sequences' cells, so the engine (``kv_unified=None``) chooses per call from the
cells a unified cache would hold. What the coordinator re-scores must not depend on that choice:
both settings give the same tokens, and log-probs within float rounding of each other (the
attention sums run over other cells) and within the parity tolerance of transformers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from tests.engine_parity import max_logprob_error, peaked_model

HAVE_LLAMA = (
    importlib.util.find_spec("gguf") is not None
    and importlib.util.find_spec("llama_cpp") is not None
)
needs_llama = pytest.mark.skipif(
    not HAVE_LLAMA, reason="llama-cpp-python is not installed (pip install 'echo-swarm[llamacpp]')"
)

# As in test_llamacpp_engine.py: F32 KV cache, no flash attention.
LOGPROB_TOL = 1e-4
# Largest |unified - streams| log-prob accepted. Not 0: a unified cache puts a sample's cells
# elsewhere in a wider (masked) attention row, so the sums round differently; measured ~5e-7,
# four orders below the re-scoring threshold for llama.cpp (rescore.MISMATCH_THRESHOLDS, 1e-2).
SETTINGS_TOL = 1e-5
SPEC = ModelSpec()


def requests(seed: int, max_new: int = 12, n: int = 4) -> list[GenRequest]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.9, top_p=0.95, seed=seed)
    prompts = [[1, 52, 46, 54, 64], [1, 70, 71], [1, 100, 101, 102, 103, 104, 105]]
    return [GenRequest(prompt_ids=p, n=n, params=params) for p in prompts]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def peaked(one_torch_thread) -> torch.nn.Module:
    return peaked_model(SPEC)


def test_unified_cells_counts_each_prompt_once_per_chunk() -> None:
    from echo.node.engines.llamacpp_decode import unified_cells

    p = SamplingParams(max_new_tokens=10)
    reqs = [
        GenRequest(prompt_ids=[1] * 5, n=4, params=p),
        GenRequest(prompt_ids=[1] * 3, n=4, params=p),
    ]
    assert unified_cells(reqs, 32) == 5 + 3 + 8 * 10
    # Chunks of 3 samples: [a a a] [a b b] [b b]; the middle one holds both prompts.
    assert unified_cells(reqs, 3) == 5 + 3 + 3 * 10
    assert unified_cells(reqs, 1) == 5 + 10


def same_results(a, b) -> float:
    """Assert equal tokens and finish reasons; return the largest log-prob difference."""
    worst = 0.0
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.token_ids == y.token_ids
            assert x.finish_reason == y.finish_reason
            worst = max(worst, float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))))
    return worst


@needs_llama
def test_both_settings_report_the_same_logprobs(tmp_path: Path, peaked) -> None:
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    state = export_state(peaked)
    engines = {
        u: LlamaCppEngine(SPEC, threads=1, workdir=tmp_path / str(u), kv_unified=u)
        for u in (False, True)
    }
    try:
        for e in engines.values():
            e.load_state(state)
        for seed in (3, 4):
            reqs = requests(seed)
            streams, unified = engines[False].generate(reqs), engines[True].generate(reqs)
            assert engines[True]._llama.kv_unified and not engines[False]._llama.kv_unified
            diff = same_results(streams, unified)
            assert diff < SETTINGS_TOL, diff
            assert max_logprob_error(SPEC, state, reqs, unified) < LOGPROB_TOL
    finally:
        for e in engines.values():
            e.close()


@needs_llama
def test_the_choice_follows_the_shape_and_keeps_results(tmp_path: Path) -> None:
    """``kv_unified=None``: a small call decodes on a unified cache, one whose unified cache
    would hold more than UNIFIED_MAX_CELLS on per-sequence streams, and back; each call's
    samples equal those of an engine fixed on per-sequence streams."""
    from echo.node.engines.llamacpp_engine import UNIFIED_MAX_CELLS, LlamaCppEngine

    spec = ModelSpec(max_position=1024)
    state = export_state(build_model(spec))
    auto = LlamaCppEngine(spec, threads=1, workdir=tmp_path / "auto", max_seqs=16)
    fixed = LlamaCppEngine(
        spec, threads=1, workdir=tmp_path / "fixed", max_seqs=16, kv_unified=False
    )
    try:
        auto.load_state(state)
        fixed.load_state(state)
        big_new = UNIFIED_MAX_CELLS // 16 + 1
        assert big_new + 8 <= 1024
        params = SamplingParams(max_new_tokens=big_new, seed=9)
        big = [GenRequest(prompt_ids=[1, 70, 71, 72], n=8, params=params)] * 2
        for reqs, unified in ((requests(5), True), (big, False), (requests(6), True)):
            out = auto.generate(reqs)
            assert auto._llama.kv_unified is unified
            assert same_results(out, fixed.generate(reqs)) < SETTINGS_TOL
        assert max_logprob_error(spec, state, big, auto.generate(big)) < LOGPROB_TOL
    finally:
        auto.close()
        fixed.close()
