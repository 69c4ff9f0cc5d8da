"""A model the llama.cpp engine cannot run gets the torch engine at join, with one line saying
why (``echo.node.engines.factory.make_engine_or_torch``, used by ``echo.node.engine_slot``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from echo.models.spec import ModelSpec
from echo.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from echo.node.engines.base import GenRequest, SamplingParams
from tests.arch_models import make_config, save_model_folder

needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
    reason="llama-cpp-python is not installed",
)


def gpt2_folder(path: Path) -> Path:
    """A tiny GPT-2 checkpoint: an architecture transformers runs and the GGUF export refuses."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return save_model_folder(config, path)


@needs_llama
def test_unsupported_architecture_falls_back_to_torch(tmp_path: Path) -> None:
    from echo.node.engines.factory import make_engine_or_torch, unsupported_reason
    from echo.node.engines.torch_engine import TorchEngine

    spec = ModelSpec(kind="hf", path=str(gpt2_folder(tmp_path / "gpt2")))
    reason = unsupported_reason("llamacpp", spec)
    assert reason is not None and "'gpt2'" in reason and "\n" not in reason
    assert unsupported_reason("torch", spec) is None

    choice = make_engine_or_torch("llamacpp", spec, threads=1)
    try:
        assert choice.name == "torch" and isinstance(choice.engine, TorchEngine)
        assert choice.fallback.startswith("the llamacpp engine cannot run this model: ")
        assert "gpt2" in choice.fallback and "\n" not in choice.fallback
        # The torch engine it fell back to runs the model.
        from echo.models.spec import build_model
        from echo.models.weights import export_state

        choice.engine.load_state(export_state(build_model(spec)))
        params = SamplingParams(max_new_tokens=4, seed=1)
        (group,) = choice.engine.generate([GenRequest(prompt_ids=[1, 70, 71], n=2, params=params)])
        assert len(group) == 2 and all(c.token_ids for c in group)
    finally:
        choice.engine.close()


@needs_llama
def test_unsupported_feature_falls_back_and_supported_model_does_not(tmp_path: Path) -> None:
    from echo.node.engines.factory import make_engine_or_torch
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    scaled = make_config(
        "llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    )
    spec = ModelSpec(kind="hf", path=str(save_model_folder(scaled, tmp_path / "scaled")))
    choice = make_engine_or_torch("llamacpp", spec, threads=1)
    choice.engine.close()
    assert choice.name == "torch" and "RoPE scaling 'linear'" in choice.fallback

    plain = ModelSpec(kind="hf", path=str(save_model_folder(make_config("qwen3"), tmp_path / "q")))
    for s in (plain, ModelSpec()):
        choice = make_engine_or_torch("llamacpp", s, threads=1)
        choice.engine.close()
        assert choice.name == "llamacpp" and isinstance(choice.engine, LlamaCppEngine)
        assert choice.fallback == ""
