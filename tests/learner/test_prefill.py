"""The shared-prompt prefill (``echo.learner.rescoring.prefill``) gives the log-probs of the
whole-sequence forward the learner trains with, on every architecture the project loads, for ragged
groups: prompts of different lengths, empty and one-token completions, groups of different sizes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from echo.learner.algorithm.grpo import GRPOLearner, TrainGroup
from echo.learner.rescoring.prefill import _whole_sequences, completion_logits
from echo.models.spec import ModelSpec, build_model
from echo.models.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE
from tests.arch_models import ARCHS, make_config, save_model_folder

# The tightest per-engine mismatch threshold is 1e-4 nats (torch on a CPU); the two forwards
# differ only in summation order, so agreement must be far inside it (measured: 2.4e-6 at most).
TOLERANCE = 1e-5


def ragged_groups(seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = random.Random(seed)
    prompts, completions = [], []
    for g in range(5):
        prompts.append([rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 11))])
        group = []
        for _ in range(rng.randint(1, 6)):
            n = rng.choice([0, 1, 2, rng.randint(3, 14)])
            group.append([rng.randrange(3, VOCAB_SIZE) for _ in range(n)])
        if g == 0:
            group[0] = group[0][:1] or [EOS_ID]
        completions.append(group)
    return prompts, completions


def whole_sequence_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[list[int]]]
) -> torch.Tensor:
    """The learner's own definition: one right-padded forward over prompt + completion."""
    learner = GRPOLearner(model)
    groups = [
        TrainGroup(p, cs, [[0.0] * len(c) for c in cs], [0.0] * len(cs), 0)
        for p, cs in zip(prompts, completions, strict=True)
    ]
    return torch.tensor([x for g in learner.score(groups) for c in g for x in c])


def shared_prompt_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[list[int]]]
) -> torch.Tensor:
    with torch.no_grad():
        logits, tokens = completion_logits(model, prompts, completions, PAD_ID)
    logp = torch.log_softmax(logits.float(), dim=-1)
    want = torch.tensor([t for g in completions for c in g for t in c])
    assert torch.equal(tokens, want)
    return logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def test_tiny_model_matches_whole_sequence_forward() -> None:
    model = build_model(ModelSpec(), seed=3)
    for seed in range(4):
        prompts, completions = ragged_groups(seed)
        a = shared_prompt_logprobs(model, prompts, completions)
        b = whole_sequence_logprobs(model, prompts, completions)
        assert a.shape == b.shape and a.numel() > 20
        assert float((a - b).abs().max()) < TOLERANCE, float((a - b).abs().max())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_matches_whole_sequence_forward(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_model_folder(make_config(arch), tmp_path / arch, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, completions = ragged_groups(7)
    a = shared_prompt_logprobs(model, prompts, completions)
    b = whole_sequence_logprobs(model, prompts, completions)
    assert float((a - b).abs().max()) < TOLERANCE, (arch, float((a - b).abs().max()))


def test_only_one_token_completions_need_no_second_pass() -> None:
    model = build_model(ModelSpec(), seed=0)
    prompts, completions = [[1, 5, 6], [1, 7]], [[[9], [EOS_ID]], [[11]]]
    a = shared_prompt_logprobs(model, prompts, completions)
    b = whole_sequence_logprobs(model, prompts, completions)
    assert a.numel() == 3 and float((a - b).abs().max()) < TOLERANCE


def test_bad_input_is_refused() -> None:
    model = build_model(ModelSpec(), seed=0)
    with pytest.raises(ValueError, match="non-empty prompt"):
        completion_logits(model, [[]], [[[5]]], PAD_ID)
    with pytest.raises(ValueError, match="no completion tokens"):
        completion_logits(model, [[1, 2]], [[[], []]], PAD_ID)


def test_the_whole_sequence_fallback_gives_the_same_tokens_and_logits() -> None:
    """What a model with a cache that cannot be shared out by row (linear-attention state) is
    scored with."""
    model = build_model(ModelSpec(), seed=2)
    prompts, completions = ragged_groups(3)
    with torch.no_grad():
        shared, tokens = completion_logits(model, prompts, completions, PAD_ID)
        whole, whole_tokens = _whole_sequences(model, prompts, completions, PAD_ID)
    assert torch.equal(tokens, whole_tokens)
    diff = torch.log_softmax(shared, -1) - torch.log_softmax(whole, -1)
    assert float(diff.abs().max()) < TOLERANCE
