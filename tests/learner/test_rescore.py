"""Re-scoring (verification step 5): honest groups pass, each kind of forgery fails with its
reason, and the fused gate inside the learner step keeps failed groups out of the update."""

from __future__ import annotations

import random

import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner, TrainGroup
from echo.learner.rescoring.rescore import Rescorer, token_stats
from echo.learner.warmup import warmup
from echo.models.spec import ModelSpec, build_model, encode_prompt
from echo.models.tokenizer import EOS_ID
from echo.models.weights import export_state, state_digest
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.protocol import reasons as R
from echo.tasks.registry import make_task

SPEC = ModelSpec()
TASK = make_task("addition", {"max_operand": 5})


def _setup(seed: int = 0, warm: bool = True):
    torch.manual_seed(seed)
    model = build_model(SPEC, seed=seed)
    if warm:  # a policy with a shape: random tokens are improbable under it, not under noise
        warmup(model, SPEC, TASK, steps=30, seed=seed)
    engine = TorchEngine(SPEC, threads=1)
    state = export_state(model)
    engine.load_state(state)
    rescorer = Rescorer(SPEC, keep=2, temperature=1.0)
    rescorer.remember(0, state)
    return model, engine, rescorer


def _groups(engine, n: int = 4, max_new: int = 8) -> list[TrainGroup]:
    reqs = [GenRequest(encode_prompt(SPEC, TASK.prompt(i)), 16,
                       SamplingParams(max_new_tokens=max_new, seed=i)) for i in range(n)]
    return [TrainGroup(r.prompt_ids, [c.token_ids for c in cs], [c.logprobs for c in cs],
                       [float(k % 2) for k in range(len(cs))], version=0)
            for r, cs in zip(reqs, engine.generate(reqs), strict=True)]


def _finish(g: TrainGroup) -> list[str]:
    return ["stop" if c and c[-1] == EOS_ID else "length" for c in g.completions]


def test_honest_groups_pass_and_forgeries_fail() -> None:
    _, engine, rescorer = _setup()
    honest = _groups(engine, n=6)
    assert all(v.ok for v in rescorer.check(honest, [_finish(g) for g in honest]))
    rng = random.Random(0)
    fabricated = [TrainGroup(g.prompt_ids, g.completions,
                             [[-0.01] * len(c) for c in g.completions], g.rewards, 0)
                  for g in honest]
    verdicts = rescorer.check(fabricated, [_finish(g) for g in fabricated])
    assert [v.reason for v in verdicts] == [R.RESCORE_MISMATCH] * len(fabricated)
    # Random tokens scored with the true model's own log-probs: only the shape test sees them.
    randoms = []
    for g in honest:
        comps = [[rng.randrange(3, 259) for _ in range(7)] + [EOS_ID] for _ in g.completions]
        lps = [[0.0] * len(c) for c in comps]
        probe = TrainGroup(g.prompt_ids, comps, lps, g.rewards, 0)
        (stats,) = rescorer._token_stats([probe])
        true_lp = stats[0].split([len(c) for c in comps])
        randoms.append(TrainGroup(g.prompt_ids, comps, [t.tolist() for t in true_lp],
                                  g.rewards, 0))
    verdicts = rescorer.check(randoms, [_finish(g) for g in randoms])
    assert {v.reason for v in verdicts} == {R.SAMPLING_SHAPE}
    # A version the learner no longer holds is dropped without blame.
    stale = [TrainGroup(g.prompt_ids, g.completions, g.behaviour_logprobs, g.rewards, 7)
             for g in honest[:1]]
    assert rescorer.check(stale, [_finish(stale[0])])[0].reason == R.UNSCORABLE


def test_fused_gate_excludes_failed_groups_from_the_update() -> None:
    model, engine, rescorer = _setup()
    learner = GRPOLearner(model, GRPOConfig(lr=1e-2))
    groups = _groups(engine, n=4)
    forged = [TrainGroup(g.prompt_ids, g.completions, [[-0.01] * len(c) for c in g.completions],
                         g.rewards, 0) for g in groups]
    before = state_digest(export_state(model))
    seen = []

    def gate(stats):
        verdicts = [rescorer.judge(g, _finish(g), "torch", *st) for g, st in zip(forged, stats,
                                                                                  strict=True)]
        seen.extend(v.reason for v in verdicts)
        return [v.ok for v in verdicts]

    m = learner.step(forged, gate=gate, gate_stats=token_stats)
    assert seen == [R.RESCORE_MISMATCH] * 4 and m["gated_groups"] == 4
    assert state_digest(export_state(model)) == before  # nothing trained
    # The same gate lets honest groups through and the weights move.
    m = learner.step(groups, gate=lambda stats: [True] * len(stats), gate_stats=token_stats)
    assert m["gated_groups"] == 0 and state_digest(export_state(model)) != before
