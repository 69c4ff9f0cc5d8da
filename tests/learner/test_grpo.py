"""GRPO learner: advantages, objective pieces, warm-up cache, and a short run that must learn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner, TrainGroup, group_advantages
from echo.learner.warmup import warmup
from echo.models.spec import ModelSpec, build_model
from echo.models.tokenizer import EOS_ID, encode
from echo.models.weights import export_state, state_digest
from echo.tasks import make_task

SPEC = ModelSpec()


def test_group_advantages() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(group_advantages([0.1] * 3), torch.zeros(3))  # exactly zero, no rounding
    assert torch.equal(group_advantages([]), torch.zeros(0))
    assert abs(float(group_advantages([0.0, 0.2, 0.9, 0.3]).sum())) < 1e-5


def make_groups(learner: GRPOLearner, rewards: list[list[float]], shift: float = 0.0):
    """Fixed completions whose behaviour log-probs are the learner's own plus ``shift``."""
    groups = []
    for g, rs in enumerate(rewards):
        prompt = encode(f"{g}+1=", add_bos=True)
        comps = [encode(str(i % 10)) + ([EOS_ID] if i % 2 else []) for i in range(len(rs))]
        groups.append(TrainGroup(prompt, comps, [[0.0] * len(c) for c in comps], rs, version=0))
    for grp, scored in zip(groups, learner.score(groups), strict=True):
        grp.behaviour_logprobs = [[x + shift for x in lp] for lp in scored]
    return groups


def test_score_shapes_and_step_metrics() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1))
    groups = make_groups(learner, [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.0, 1.0]])
    scored = learner.score(groups)
    assert [[len(x) for x in g] for g in scored] == [
        [len(c) for c in g.completions] for g in groups
    ]
    m = learner.step(groups)
    tokens = sum(len(c) for g in groups for c in g.completions)
    assert m["tokens"] == tokens
    assert m["reward"] == pytest.approx(0.5)
    assert m["mismatch"] < 1e-5 and m["is_w"] == pytest.approx(1.0, abs=1e-4)
    assert m["clip_frac"] == 0.0  # one epoch: ratio is 1
    # With ratio 1 and is_w 1 the loss is minus the token-weighted mean advantage.
    adv = [a for g in groups for a in group_advantages(g.rewards).tolist()]
    lens = [len(c) for g in groups for c in g.completions]
    expected = -sum(a * n for a, n in zip(adv, lens, strict=True)) / tokens
    assert m["loss"] == pytest.approx(expected, abs=1e-4)
    assert learner.version == 1
    assert learner.score(groups) != scored  # weights moved


def test_trust_region_is_anchored_at_the_behaviour_policy() -> None:
    """Tokens the policy already made far likelier than the node's sampling policy did (a stale
    group) are outside the trust region for a positive advantage and past the dual clip for a
    negative one: they no longer push, so the step leaves the weights as they were."""
    learner = GRPOLearner(build_model(SPEC, seed=1), GRPOConfig(dual_clip=2.0))
    learner.version = 5
    groups = make_groups(learner, [[1.0, 0.0, 1.0, 0.0]], shift=-3.0)  # node thought it unlikely
    before = state_digest(export_state(learner.model))
    m = learner.step(groups)
    assert m["mismatch"] == pytest.approx(3.0, abs=1e-4)
    assert m["is_w"] == pytest.approx(float(torch.tensor(3.0).exp()), rel=1e-3)
    assert m["is_w_outside"] == 1.0 and m["clip_frac"] == 1.0
    assert m["staleness_max"] == 5.0 and m["staleness_mean"] == 5.0
    assert state_digest(export_state(learner.model)) == before


def test_inside_the_trust_region_a_stale_group_still_trains() -> None:
    """A small shift (a slightly stale group) keeps every token inside the region: it trains."""
    learner = GRPOLearner(build_model(SPEC, seed=1))
    groups = make_groups(learner, [[1.0, 0.0, 1.0, 0.0]], shift=-0.05)
    before = state_digest(export_state(learner.model))
    m = learner.step(groups)
    assert m["clip_frac"] == 0.0 and m["is_w_outside"] == 0.0
    assert state_digest(export_state(learner.model)) != before


def test_equal_rewards_leave_weights_unchanged() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1))
    before = state_digest(export_state(learner.model))
    learner.step(make_groups(learner, [[1.0] * 4, [0.0] * 4]))
    assert state_digest(export_state(learner.model)) == before


def test_ppo_epochs_clip() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1), GRPOConfig(lr=5e-2, ppo_epochs=4))
    m = learner.step(make_groups(learner, [[1.0, 0.0, 0.0, 1.0]] * 4))
    assert m["clip_frac"] > 0


def test_bad_groups_rejected() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=1))
    good = make_groups(learner, [[1.0, 0.0]])[0]
    cases = [
        TrainGroup(good.prompt_ids, good.completions, good.behaviour_logprobs, [1.0]),
        TrainGroup(good.prompt_ids, good.completions, [[0.0], [0.0]], good.rewards),
        TrainGroup(good.prompt_ids, [[300], [3]], [[-1.0], [-1.0]], good.rewards),
        TrainGroup(good.prompt_ids, [[4], [3]], [[1.0], [-1.0]], good.rewards),
        TrainGroup(good.prompt_ids, [[4], [3]], [[-1.0], [-1.0]], [float("nan"), 0.0]),
        TrainGroup([], good.completions, good.behaviour_logprobs, good.rewards),
    ]
    for bad in cases:
        with pytest.raises(ValueError):
            learner.step([bad])


def test_warmup_caches(tmp_path: Path) -> None:
    task = make_task("addition", {"max_operand": 5})
    kw = dict(steps=5, lr=3e-3, seed=0, cache_dir=tmp_path)
    first = warmup(build_model(SPEC), SPEC, task, **kw)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    second = warmup(build_model(SPEC), SPEC, task, **kw)
    digest = state_digest(export_state(first))
    assert (
        state_digest(export_state(second))
        == digest
        != state_digest(export_state(build_model(SPEC)))
    )
    warmup(build_model(SPEC), SPEC, task, **{**kw, "seed": 1})
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert not list(tmp_path.glob(".warmup-*"))  # no temporary files left behind


@pytest.mark.parametrize("lag", [0, 1])
def test_short_run_learns(tmp_path: Path, lag: int) -> None:
    """The local loop (engine samples, learner steps, weights copied back) raises the reward, on
    policy and with the samples one version behind the learner, as a swarm's are (lag 1).

    Seed 0 goes from about 0.15 (first 20 steps) to 0.53 on policy and 0.62 at lag 1 (last 20; the
    default lr of 7e-4). The seed matters: some seeds sit longer near "always answer the
    commonest sum" (over seeds 0-5 the rise at step 160 was 0.11-0.68), so the seed is fixed; the
    run is bit-reproducible for 1 and 2 threads.
    """
    from echo.tools.grpo_local import LocalConfig, run

    cfg = LocalConfig(
        task="addition",
        task_params={"max_operand": 4},
        steps=160,
        seed=0,
        lag=lag,
        cache_dir=str(tmp_path),
        eval_every=0,
        threads=1,  # tiny matrices gain little from a second thread, and lose a lot when shared
    )
    threads = torch.get_num_threads()
    try:
        history, _ = run(cfg, log=False)
    finally:
        torch.set_num_threads(threads)
    first = sum(h["reward"] for h in history[:20]) / 20
    last = sum(h["reward"] for h in history[-20:]) / 20
    if lag == 0:
        assert max(h["mismatch"] for h in history) < 1e-4  # engine and learner agree
    else:
        assert all(h["staleness_max"] == 1 for h in history[1:])
    assert last > first + 0.15, (first, last)


def test_on_step_probe_sees_every_step_and_adds_figures(tmp_path: Path) -> None:
    """``run(on_step=...)`` calls the probe after each step with the learner that took it, and
    a figure the probe adds to the step's metrics is in the history."""
    from echo.tools.grpo_local import LocalConfig, run

    seen: list[int] = []

    def probe(learner: GRPOLearner, metrics: dict[str, float]) -> None:
        seen.append(learner.version)
        metrics["probe"] = float(learner.version)

    cfg = LocalConfig(task_params={"max_operand": 4}, steps=3, seed=0, cache_dir=str(tmp_path),
                      eval_every=0, threads=1)
    threads = torch.get_num_threads()
    try:
        history, _ = run(cfg, log=False, on_step=probe)
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 2, 3]
    assert [h["probe"] for h in history] == [1.0, 2.0, 3.0]


def test_skip_uniform_trains_on_groups_with_signal(tmp_path: Path, monkeypatch) -> None:
    """Dynamic sampling in the local loop: a batch holds only groups whose rewards differ,
    drawn over as many rounds of prompts as that takes (MAX_DRAWS at most), and the run says how
    many groups it sampled."""
    from echo.learner.algorithm.grpo import GRPOLearner
    from echo.tools.grpo_local import MAX_DRAWS, LocalConfig, run

    batches: list[list[list[float]]] = []
    step = GRPOLearner.step

    def recording_step(self, groups, *args, **kwargs):
        batches.append([list(g.rewards) for g in groups])
        return step(self, groups, *args, **kwargs)

    monkeypatch.setattr(GRPOLearner, "step", recording_step)
    cfg = LocalConfig(
        task_params={"max_operand": 4},
        steps=4,
        seed=0,
        cache_dir=str(tmp_path),
        eval_every=0,
        threads=1,
        skip_uniform=True,
    )
    threads = torch.get_num_threads()
    try:
        history, _ = run(cfg, log=False)
    finally:
        torch.set_num_threads(threads)
    assert len(batches) == 4
    for rewards, h in zip(batches, history, strict=True):
        assert len(rewards) == cfg.prompts_per_step
        assert h["groups_sampled"] % cfg.prompts_per_step == 0
        if h["groups_sampled"] < MAX_DRAWS * cfg.prompts_per_step:
            assert all(min(r) < max(r) for r in rewards), rewards
    # At the start most groups are all wrong: filling a batch takes more than one round.
    assert max(h["groups_sampled"] for h in history) > cfg.prompts_per_step


def test_the_step_counts_the_groups_that_carry_a_signal() -> None:
    """A group whose samples all scored the same has no advantage: the step reports how many of
    its groups the policy gradient saw (late in a run most are uniform)."""
    learner = GRPOLearner(build_model(SPEC, seed=1))
    groups = make_groups(learner, [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0], [0.0] * 4])
    assert learner.step(groups)["signal_groups"] == 1.0


def test_sequential_prompts_and_the_start_accuracy(tmp_path: Path, monkeypatch) -> None:
    """``sequential_prompts`` samples prompt ids 0, 1, 2, ... in order (the coordinator's
    order, the one the real-learning benchmark gives every way), and ``on_start`` gets the
    held-out accuracy before the first step, the figure the final one is compared with."""
    from echo.tools import grpo_local
    from echo.tools.grpo_local import LocalConfig, run

    asked: list[int] = []
    prompt = grpo_local._Codec.prompt

    def recording(self, prompt_id: int) -> list[int]:
        asked.append(prompt_id)
        return prompt(self, prompt_id)

    monkeypatch.setattr(grpo_local._Codec, "prompt", recording)
    starts: list[float] = []
    cfg = LocalConfig(task_params={"max_operand": 4}, steps=3, seed=0, cache_dir=str(tmp_path),
                      eval_every=0, threads=1, prompts_per_step=4, sequential_prompts=True)
    threads = torch.get_num_threads()
    try:
        run(cfg, log=False, on_start=starts.append)
    finally:
        torch.set_num_threads(threads)
    assert asked == list(range(12))
    assert len(starts) == 1 and 0.0 <= starts[0] <= 1.0
