"""Every architecture the GGUF export claims, through the llama.cpp engine, against transformers.

For each of Llama (also with Llama 3's RoPE scaling), Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and
Phi-3: a tiny random checkpoint
(``tests/arch_models.py``) is loaded by the llama.cpp engine exactly as a real one is (a Hugging
Face folder); the engine's weights read back from its GGUF equal the published state bit for bit;
the log-prob it reports for each sampled token is within the llama.cpp re-scoring threshold of
transformers' teacher-forced one; then two real AdamW versions are applied as in-place patches
and both checks hold again. Also: architectures and features llama.cpp would compute differently
are refused with one line, and Gemma's shifted norms read back exactly (and a wrong byte shows).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state, state_digest
from echo.node.engines.base import GenRequest, SamplingParams
from tests.arch_models import ARCHS, make_config, save_model_folder
from tests.engine_parity import adamw_versions, max_logprob_error

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
HAVE_LLAMA = HAVE_GGUF and importlib.util.find_spec("llama_cpp") is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="gguf is not installed")
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed")

THRESHOLD = MISMATCH_THRESHOLDS["llamacpp"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def requests(seed: int) -> list[GenRequest]:
    """Prompts longer than the Gemma test windows (8), so sliding layers are exercised."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)
    prompts = [
        [1, 52, 46, 54, 64, 70, 71, 72, 80, 81, 90],
        [1, 70, 71],
        [1, *range(100, 113)],
    ]
    return [GenRequest(prompt_ids=p, n=3, params=params) for p in prompts]


@needs_llama
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_parity_and_exact_patches(tmp_path: Path, arch: str) -> None:
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    folder = save_model_folder(make_config(arch), tmp_path / arch)
    spec = ModelSpec(kind="hf", path=str(folder))
    model = build_model(spec)
    base = export_state(model)
    eng = LlamaCppEngine(spec, threads=1, workdir=tmp_path / "llama")
    try:
        eng.load_state(base)
        assert eng.last_load.full_write
        assert eng.state_digest() == state_digest(base)
        reqs = requests(seed=3)
        worst = max_logprob_error(spec, base, reqs, eng.generate(reqs))
        assert worst < THRESHOLD, worst
        previous = base
        for i, state in enumerate(adamw_versions(model, 2, lr=1e-2)):
            eng.load_state(state)
            assert not eng.last_load.full_write, "same layout must patch in place"
            assert eng.state_digest() == state_digest(state), f"version {i + 1}"
            reqs = requests(seed=10 + i)
            results = eng.generate(reqs)
            err = max_logprob_error(spec, state, reqs, results)
            worst = max(worst, err)
            assert err < THRESHOLD, (i, err)
            # The check can fail: the previous version's weights give other log-probs.
            assert max_logprob_error(spec, previous, reqs, results) > 10 * err
            previous = state
        print(f"{arch}: worst |logprob error| {worst:.1e}")
    finally:
        eng.close()


@needs_gguf
def test_mistral_context_is_capped_at_its_window() -> None:
    """llama.cpp's llama graph has no sliding window: the export keeps sequences inside it."""
    from echo.node.engines.gguf_layout import layout_of

    assert layout_of(make_config("mistral", sliding_window=32)).context_length == 32
    assert layout_of(make_config("mistral", sliding_window=None)).context_length == 64


@needs_gguf
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda: __import__("transformers").GPT2Config(), "does not support 'gpt2' models"),
        (
            lambda: make_config(
                "llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
            ),
            "RoPE scaling 'linear'",
        ),
        (lambda: make_config("llama", mlp_bias=True), "MLP biases"),
        (
            lambda: make_config("qwen2", use_sliding_window=True, sliding_window=16),
            "sliding-window",
        ),
        (lambda: make_config("qwen3", attention_bias=True), "attention biases"),
        (lambda: make_config("gemma2", query_pre_attn_scalar=32), "query_pre_attn_scalar"),
        (
            lambda: make_config("gemma3", layer_types=["full_attention"] * 6),
            "layer_types differ",
        ),
        (lambda: make_config("llama", hidden_act="gelu"), "activation 'gelu'"),
    ],
)
def test_unsupported_models_are_refused_in_one_line(config, message: str) -> None:
    from echo.node.engines.gguf_layout import UnsupportedArchitecture, layout_of

    with pytest.raises(UnsupportedArchitecture, match=message) as info:
        layout_of(config())
    assert "\n" not in str(info.value)


@needs_gguf
def test_gemma_norm_shift_reads_back_exactly_and_shows_a_wrong_write(tmp_path: Path) -> None:
    """The file holds float32(w + 1) for Gemma's norms; read-back gives w exactly while the file
    holds that, and a changed byte there changes the digest."""
    from echo.node.engines.gguf_export import write_gguf
    from echo.node.engines.gguf_vocab import byte_vocab

    config = make_config("gemma2", vocab_size=259)
    folder = save_model_folder(config, tmp_path / "g")
    state = export_state(build_model(ModelSpec(kind="hf", path=str(folder))), "bfloat16")
    f = write_gguf(config, state, tmp_path / "m.gguf", vocab=byte_vocab())
    assert state_digest(f.read_state()) == state_digest(state)
    name = "model.layers.0.input_layernorm.weight"
    e = f.entries[name]
    assert e.slot.shift == 1.0 and e.file_dtype == "float32"
    mm = np.memmap(f.path, dtype=np.uint8, mode="r+")
    stored = mm[e.offset : e.offset + e.nbytes].view(np.float32)
    assert np.array_equal(stored, state[name].float().numpy() + np.float32(1.0))
    stored[3] = np.nextafter(stored[3], np.float32(np.inf))
    mm.flush()
    del mm
    assert state_digest(f.read_state()) != state_digest(state)
