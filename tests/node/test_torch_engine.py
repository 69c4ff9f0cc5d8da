"""TorchEngine: batched KV-cache sampling whose log-probs the learner reproduces."""

from __future__ import annotations

import pytest
import torch

from echo.learner.algorithm.grpo import GRPOLearner, TrainGroup
from echo.models.spec import ModelSpec, build_model
from echo.models.tokenizer import EOS_ID, encode
from echo.models.weights import export_state, state_digest
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine

SPEC = ModelSpec()


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    eng = TorchEngine(SPEC)
    eng.load_state(export_state(build_model(SPEC, seed=7)))
    return eng


def requests(temperature: float = 1.0, top_p: float = 1.0, max_new: int = 12) -> list[GenRequest]:
    prompts = ["1+2=", "rev abcdef=", "x", "a much longer prompt than the others="]
    return [
        GenRequest(encode(p, add_bos=True), 8, SamplingParams(max_new, temperature, top_p, i))
        for i, p in enumerate(prompts)
    ]


def as_groups(reqs: list[GenRequest], out) -> list[TrainGroup]:
    return [
        TrainGroup(r.prompt_ids, [c.token_ids for c in cs], [c.logprobs for c in cs], [0.0] * r.n)
        for r, cs in zip(reqs, out, strict=True)
    ]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_logprobs_match_learner_score(engine: TorchEngine, temperature: float, top_p: float):
    reqs = requests(temperature, top_p)
    out = engine.generate(reqs)
    learner = GRPOLearner(build_model(SPEC, seed=7), temperature=temperature)
    scored = learner.score(as_groups(reqs, out))
    diffs = [
        abs(a - b)
        for cs, sc in zip(out, scored, strict=True)
        for c, s in zip(cs, sc, strict=True)
        for a, b in zip(c.logprobs, s, strict=True)
    ]
    assert len(diffs) > 100
    assert max(diffs) < 1e-5


def test_stop_and_length(engine: TorchEngine) -> None:
    # Near-uniform random weights: EOS comes up about once in 259 tokens, so some of 256 rows stop.
    reqs = [
        GenRequest(encode(str(i), add_bos=True), 16, SamplingParams(16, 1.0, 1.0, i))
        for i in range(16)
    ]
    out = engine.generate(reqs)
    flat = [c for cs in out for c in cs]
    assert [len(cs) for cs in out] == [16] * 16
    stops = [c for c in flat if c.finish_reason == "stop"]
    assert stops and len(stops) < len(flat)
    for c in flat:
        assert len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS_ID and EOS_ID not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 16 and EOS_ID not in c.token_ids
    assert engine.last_stats["tokens"] == sum(len(c.token_ids) for c in flat)
    assert engine.tokens_per_s > 0


def test_seeded_and_batch_independent(engine: TorchEngine) -> None:
    reqs = requests()
    first = engine.generate(reqs)
    assert engine.generate(reqs) == first
    # A request's samples depend on its own seed, not on the other requests in the batch.
    alone = engine.generate([reqs[1]])
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in first[1]]
    reseeded = GenRequest(reqs[1].prompt_ids, 8, SamplingParams(12, 1.0, 1.0, 99))
    assert engine.generate([reseeded])[0] != first[1]


def test_greedy_and_tiny_top_p_pick_the_argmax(engine: TorchEngine) -> None:
    greedy = engine.generate(requests(temperature=0.0))
    narrow = engine.generate(requests(temperature=1.0, top_p=1e-9))
    for g, n in zip(greedy, narrow, strict=True):
        assert all(c.token_ids == g[0].token_ids for c in g + n)  # all samples the same
        for a, b in zip(g[0].logprobs, n[0].logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-6)  # greedy reports temperature-1 log-probs


def test_max_new_tokens_per_request(engine: TorchEngine) -> None:
    reqs = [
        GenRequest(encode("a", add_bos=True), 4, SamplingParams(2, 1.0, 1.0, 1)),
        GenRequest(encode("b", add_bos=True), 4, SamplingParams(7, 1.0, 1.0, 2)),
    ]
    short, long_ = engine.generate(reqs)
    assert all(len(c.token_ids) <= 2 for c in short)
    assert any(len(c.token_ids) > 2 for c in long_)
    assert all(len(c.token_ids) <= 7 for c in long_)


def test_state_digest_follows_loaded_weights() -> None:
    eng = TorchEngine(SPEC)
    model = build_model(SPEC, seed=3)
    for dtype in ("float32", "bfloat16"):
        state = export_state(model, dtype)
        eng.load_state(state)
        assert eng.state_digest() == state_digest(state)
    with torch.no_grad():
        eng.model.model.norm.weight[0] += 1.0  # weights the engine really holds
    assert eng.state_digest() != state_digest(state)


def test_bad_input() -> None:
    eng = TorchEngine(SPEC)
    with pytest.raises(ValueError, match="outside"):
        eng.generate([GenRequest([1, 999], 1)])
    with pytest.raises(ValueError):
        GenRequest([], 1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    assert eng.generate([]) == []


def test_each_prompt_is_prefilled_once_for_its_group(engine: TorchEngine) -> None:
    # The prefill runs one row per request (not per sample); every later step one row per sample.
    reqs = requests()
    batch_rows: list[tuple[int, int]] = []

    def record(_module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        batch_rows.append(tuple(ids.shape))

    handle = engine.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = engine.generate(reqs)
    finally:
        handle.remove()
    width = max(len(r.prompt_ids) for r in reqs)
    assert batch_rows[0] == (len(reqs), width)
    assert batch_rows[1:] and all(shape == (8 * len(reqs), 1) for shape in batch_rows[1:])
    # The group's samples still differ (their own random draws on the shared prompt cache).
    assert len({tuple(c.token_ids) for c in out[0]}) > 1
