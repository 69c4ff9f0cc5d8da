"""Engines pick each decode step's thread count (1 or their ``threads``) by timing the steps.

:class:`StepThreads` is fed step times as a loaded or an idle machine would give them and must
settle on the faster count, probe the other rarely once it is settled, and follow a change of
load. The engines (real torch, real llama.cpp on the tiny model) must time both counts while
generating and keep their results' contract.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.step_threads import StepThreads

HAVE_LLAMA = all(importlib.util.find_spec(m) is not None for m in ("gguf", "llama_cpp"))


def run(st: StepThreads, seconds: dict[int, float], steps: int) -> list[int]:
    """``steps`` steps whose time depends only on the thread count; the counts used."""
    used = []
    for _ in range(steps):
        n = st.threads()
        st.observe(n, seconds[n])
        used.append(n)
    return used


def test_settles_on_one_thread_when_two_are_slower_and_probes_rarely() -> None:
    st = StepThreads(2, min_interval=8)
    used = run(st, {1: 0.01, 2: 0.08}, 2000)  # a loaded machine: 2 threads 8x slower
    assert st.current == 1 and st.switches == 1
    # After the switch, probes of 2 threads back off: each costs 7 steps' time, so the next
    # waits 350 steps (2% of the time).
    assert used[:8] == [2] * 8 and used[8] == 1
    assert used[-1000:].count(2) <= 1000 // 350 + 1


@pytest.mark.parametrize("slowdown", [2.0, 10.0, 100.0])
def test_probes_of_a_slow_count_cost_a_small_share_of_the_time(slowdown: float) -> None:
    st = StepThreads(2)
    seconds = {1: 0.01, 2: 0.01 * slowdown}
    used = run(st, seconds, 20_000)
    assert st.current == 1
    spent = sum(seconds[n] for n in used[1000:])
    assert spent <= 1.03 * 0.01 * len(used[1000:])


def test_stays_on_the_maximum_when_it_is_faster() -> None:
    st = StepThreads(4)
    used = run(st, {1: 0.05, 4: 0.02}, 500)
    assert st.current == 4 and st.switches == 0
    assert used.count(1) <= 7  # probes only, backing off 8, 16, 32, ...


def test_follows_a_change_of_load() -> None:
    st = StepThreads(2, min_interval=4, max_interval=64)
    run(st, {1: 0.01, 2: 0.05}, 300)
    assert st.current == 1
    run(st, {1: 0.03, 2: 0.01}, 300)  # the other processes left: 2 threads win again
    assert st.current == 2
    assert st.switches == 2


def test_a_close_probe_does_not_switch() -> None:
    st = StepThreads(2, min_interval=4)
    run(st, {1: 0.0100, 2: 0.0097}, 200)  # within the noise margin
    assert st.current == 2 and st.switches == 0


def test_fixed_when_not_adapting_or_single_threaded() -> None:
    for st in (StepThreads(2, adapt=False), StepThreads(1)):
        assert run(st, {1: 0.01, 2: 1.0}, 100) == [st.max_threads] * 100
        assert st.estimate == {}
        assert st.chosen == st.max_threads


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError):
        StepThreads(0)
    with pytest.raises(ValueError):
        StepThreads(2, min_interval=8, max_interval=4)


def requests() -> list[GenRequest]:
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    return [GenRequest([1, 52, 46, 54, 64], 4, params), GenRequest([1, 70, 71], 4, params)]


def check(results: list, reqs: list[GenRequest]) -> None:
    for req, group in zip(reqs, results, strict=True):
        assert len(group) == req.n
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= req.params.max_new_tokens
            assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("name", ["torch", "llamacpp"])
def test_engines_time_both_thread_counts_while_generating(name: str, tmp_path: Path) -> None:
    before = torch.get_num_threads()
    if name == "torch":
        from echo.node.engines.torch_engine import TorchEngine

        engine = TorchEngine(ModelSpec(), threads=2, adapt_threads=True)
    else:
        if not HAVE_LLAMA:
            pytest.skip("llama-cpp-python is not installed (pip install 'echo-swarm[llamacpp]')")
        from echo.node.engines.llamacpp_engine import LlamaCppEngine

        engine = LlamaCppEngine(ModelSpec(), threads=2, workdir=tmp_path / "llama")
    try:
        engine.load_state(export_state(build_model(ModelSpec())))
        st = engine.step_threads
        assert st.adapt and st.max_threads == 2
        torch.set_num_threads(2)
        reqs = requests()
        for _ in range(3):
            check(engine.generate(reqs), reqs)
        # Both counts were timed on real steps (the second by at least one probe), and torch's
        # process-wide count is as the caller left it.
        assert set(st.estimate) == {1, 2}
        assert all(s > 0 for s in st.estimate.values())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        if hasattr(engine, "close"):
            engine.close()


@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed")
def test_llamacpp_results_do_not_depend_on_the_thread_count(tmp_path: Path) -> None:
    """ggml computes each output element on one thread, so switching counts between steps
    changes no bit: an adapting engine reproduces a fixed one-thread engine exactly."""
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    state = export_state(build_model(ModelSpec()))
    adapting = LlamaCppEngine(ModelSpec(), threads=2, workdir=tmp_path / "a")
    fixed = LlamaCppEngine(ModelSpec(), threads=1, workdir=tmp_path / "b")
    try:
        adapting.load_state(state)
        fixed.load_state(state)
        reqs = requests()
        for _ in range(3):
            assert adapting.generate(reqs) == fixed.generate(reqs)
        assert set(adapting.step_threads.estimate) == {1, 2}
    finally:
        adapting.close()
        fixed.close()
