"""A real pretrained model (SmolLM2-135M-Instruct, Llama architecture, vocabulary 49,152, tied
embeddings, published in bf16) on the torch and llama.cpp engines.

Both engines load the same published bf16 state and hold it bit for bit (digests), generate
from a chat-templated prompt, and report per-token log-probs that transformers' teacher-forced
float32 re-scoring (what the learner computes) matches within each engine's re-scoring threshold
(``learner/rescoring/rescore.py``). A version one small update away is then applied in place to the
llama.cpp engine's GGUF, exactly, and parity holds again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.models.spec import ModelSpec, build_model, eos_token_id, load_tokenizer
from echo.models.weights import export_state, load_state, state_digest
from echo.node.engines.base import GenRequest, SamplingParams

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

QUESTIONS = ["What is 7 + 5? Answer with a number.", "Name a colour of the sky."]


def chat_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of ``question`` rendered with the model's chat template (generation prompt
    appended), as a node receives them in a lease."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@torch.inference_mode()
def max_error(model: torch.nn.Module, reqs: list[GenRequest], results) -> float:
    """Largest |reported - teacher-forced float32 transformers| log-prob (temperature 1)."""
    worst = 0.0
    for req, group in zip(reqs, results, strict=True):
        for c in group:
            ids = torch.tensor([req.prompt_ids + c.token_ids])
            logits = model(input_ids=ids).logits[0, len(req.prompt_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(c.token_ids)[:, None])
            got = torch.tensor(c.logprobs, dtype=torch.float32)
            worst = max(worst, float((ref[:, 0] - got).abs().max()))
    return worst


@pytest.fixture(scope="module")
def real(smollm2_path: Path):
    """(spec, published bf16 state, the learner's float32 model holding it, requests)."""
    spec = ModelSpec(kind="hf", path=str(smollm2_path))
    model = build_model(spec)
    state = export_state(model, "bfloat16")
    load_state(model, state)  # the learner's float32 copy of what it published
    tokenizer = load_tokenizer(spec)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
    reqs = [GenRequest(prompt_ids=chat_prompt(tokenizer, q), n=2, params=params) for q in QUESTIONS]
    return spec, state, model, reqs


def test_chat_prompt_is_templated(real) -> None:
    spec, _, _, reqs = real
    tokenizer = load_tokenizer(spec)
    text = tokenizer.decode(reqs[0].prompt_ids)
    assert text.count("<|im_start|>") == 3 and text.endswith("<|im_start|>assistant\n")
    assert eos_token_id(spec) == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("engine_name", ["torch", "llamacpp"])
def test_real_model_parity_on_each_engine(real, tmp_path: Path, engine_name: str) -> None:
    from echo.node.engines.factory import make_engine

    spec, state, model, reqs = real
    engine = make_engine(engine_name, spec, threads=1)
    try:
        engine.load_state(state)
        assert engine.state_digest() == state_digest(state)
        results = engine.generate(reqs)
        tokens = sum(len(c.token_ids) for g in results for c in g)
        assert tokens >= len(reqs)
        worst = max_error(model, reqs, results)
        print(f"{engine_name}: worst |logprob error| {worst:.1e} over {tokens} tokens")
        assert worst < MISMATCH_THRESHOLDS[engine_name], worst

        if engine_name == "llamacpp":
            # A small update (as a learner step at lr ~1e-6 makes) applied in place, exactly.
            g = torch.Generator().manual_seed(0)
            new = dict(state)
            for name in ("model.layers.3.mlp.down_proj.weight", "model.norm.weight"):
                t = state[name].float()
                new[name] = (t + 1e-3 * torch.randn(t.shape, generator=g) * t.abs()).to(
                    torch.bfloat16
                )
            engine.load_state(new)
            assert not engine.last_load.full_write and engine.last_load.changed > 0
            assert engine.state_digest() == state_digest(new)
            results = engine.generate(reqs)
            load_state(model, new)
            try:
                assert max_error(model, reqs, results) < MISMATCH_THRESHOLDS[engine_name]
            finally:
                load_state(model, state)
    finally:
        engine.close()
