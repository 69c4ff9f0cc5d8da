"""The scoring sandbox against hostile answers: every reasoning-gym dataset, math-verify, regex.

What a node sends as a completion reaches scorers that eval, parse with sympy or run a regex. In
the sandbox (tasks/sandbox.py) such a text must leave no trace outside the scoring process, end
with a reason code within its time budget, and leave honest answers scored as before; and the
coordinator's loop must go on answering while a group is being scored.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import trio

from echo.coordinator.config import JobsSection
from echo.coordinator.metrics import Metrics
from echo.coordinator.submissions import scoring as scoring_mod
from echo.coordinator.submissions.scoring import NEW_NODE_SLOTS, NewNodesBusy, Scoring
from echo.protocol.jobspec import SpecError
from echo.tasks import gym_guards, jail, make_task
from echo.tasks.gym import gym_datasets
from echo.tasks.sandbox import OUTCOMES, Recipe, Sandbox
from echo.tasks.scoring import RewardTerm

DATA = str(Path(__file__).parents[1] / "data" / "gsm8k_mini.jsonl")
# Datasets that cannot be built without a config of their own.
NEEDS_CONFIG = {"composite"}


def hostile(trap: Path) -> list[str]:
    """Answers written to hurt: code (a file write, a shell), a power tower, deep nesting and a
    1 MB string, each as the tagged answer the gym task extracts."""
    texts = [
        f"open('{trap}/pwned-open','w').write(str(__import__('os').getpid()))",
        f"[__import__('os').system('touch {trap}/pwned-shell')]",
        "9**9**9**9",
        "[" * 50_000 + "]" * 50_000,
        "7" * (1 << 20),
    ]
    return [f"<answer>{t}</answer>" for t in texts]


@pytest.fixture
def trap(tmp_path: Path) -> Path:
    """A folder anyone may write to: only confinement keeps hostile code out of it."""
    d = tmp_path / "trap"
    d.mkdir()
    d.chmod(0o777)
    return d


def test_the_sandbox_is_confined_here_and_stops_when_idle() -> None:
    task = make_task("addition", {})
    with Sandbox(Recipe("addition", {})) as sandbox:
        assert sandbox.start() == list(jail.STRONG)
        # Below us: our loop takes the core back from a scorer at once.
        zygote = sandbox._zygote.proc.pid
        assert os.getpriority(os.PRIO_PROCESS, zygote) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        assert not sandbox.close_if_idle(idle_s=60)
        assert sandbox.close_if_idle(idle_s=0)  # its job's libraries leave memory
        assert sandbox.score(3, [task.answer(3)])[0].value == 1.0  # a new zygote


def test_the_idle_check_never_waits_for_a_sandbox_in_use() -> None:
    """The coordinator's housekeeping asks on its event loop: a score or a zygote start holding
    the lock (a start under load took 29 s) must not freeze the loop behind it."""
    sandbox = Sandbox(Recipe("addition", {}))
    with ThreadPoolExecutor(1) as pool:
        sandbox._lock.acquire()
        try:
            t0 = time.monotonic()
            idle = pool.submit(sandbox.close_if_idle, 0).result(timeout=5)
            assert not idle and time.monotonic() - t0 < 1.0
        finally:
            sandbox._lock.release()


@pytest.mark.slow  # about 2 minutes on 2 cores: a sandbox started for each of ~100 datasets
def test_every_gym_dataset_meets_hostile_answers_without_a_trace(trap: Path) -> None:
    names = [n for n in gym_datasets() if n not in NEEDS_CONFIG]
    texts = hostile(trap)

    def one(name: str) -> tuple[str, float, float, list[str], float]:
        task = make_task(f"gym:{name}", {})
        reference = f"<answer>{task.answer(0)}</answer>"
        expected = task.reward(0, reference)  # our own text, scored here
        t0 = time.monotonic()
        with Sandbox(Recipe(f"gym:{name}", {})) as sandbox:
            honest = sandbox.score(0, [reference], task.scoring_context(0))[0].value
            # One call per text: each must end on its own, not behind a failure before it.
            outcomes = [sandbox.score(0, [t])[0].outcome for t in texts]
        return name, expected, honest, outcomes, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, names))
    assert len(results) > 90  # reasoning-gym ships about a hundred
    for name, expected, honest, outcomes, took in results:
        assert honest == expected, f"{name}: the sandbox scored the reference {honest}"
        assert set(outcomes) <= OUTCOMES, name
        budget = Recipe(f"gym:{name}", {}).budget_s()
        assert took < 20 + len(texts) * budget, f"{name} took {took:.1f} s"
    assert os.listdir(trap) == []


def test_guards_turn_interpreted_answers_into_plain_failures() -> None:
    assert gym_guards.literal_only("[[1, 2], [3, 4]]") == [[1, 2], [3, 4]]
    for text in ("__import__('os').getpid()", "[" * 10_000 + "]" * 10_000, "9**9**9"):
        with pytest.raises(ValueError):
            gym_guards.literal_only(text)
    assert gym_guards.check_expression("x**2/2 + sin(x) + C") == "x**2/2 + sin(x) + C"
    for text in ("9**9**9**9", "9^(9^9)", "__import__('os')", "x.real", "open(x)", "a[0]"):
        with pytest.raises(ValueError):
            gym_guards.check_expression(text)
    # Guarded in the dataset modules themselves, so an in-process caller is covered too.
    for name in gym_guards.EVAL_LITERAL:
        make_task(f"gym:{name}", {})
        assert gym_guards._module(name).eval is gym_guards.literal_only
    assert gym_guards.scorer_hazards("codeio") == ("exec",)
    assert gym_guards.scorer_hazards("spiral_matrix") == ()


def test_math_verify_and_regex_meet_hostile_answers(trap: Path) -> None:
    recipe = Recipe(
        "dataset",
        {"path": DATA, "shuffle": False},
        (
            RewardTerm("math", timeout_s=1),
            RewardTerm("regex", pattern="(a+)+$"),  # a researcher's pattern that backtracks
            RewardTerm("format", weight=0.5),
        ),
    )
    task = make_task("dataset", {"path": DATA, "shuffle": False})
    answer = task.answer(0)
    texts = [
        *hostile(trap),
        "\\frac{" * 20_000 + "1" + "}{2}" * 20_000,
        "a" * 40 + "!",  # exponential for the pattern above
        "<answer>" * 100_000,  # quadratic for a regex over tags, linear here
    ]
    with Sandbox(recipe) as sandbox:
        honest = sandbox.score(0, [f"<answer>{answer}</answer>"])[0]
        assert (honest.value, honest.outcome) == (1.5, "ok")
        scores = [sandbox.score(0, [t])[0] for t in texts]
    # Nothing hostile is a right answer; a well-formed tag still earns its format weight.
    assert all(s.outcome in OUTCOMES and s.value in (0.0, 0.5) for s in scores), scores
    regex_bomb = scores[-2]
    assert regex_bomb.outcome == "scorer_timeout"
    assert scores[-1].outcome == "ok"  # a quadratic scan would overrun the budget
    assert os.listdir(trap) == []


def test_the_loop_answers_while_a_group_is_scored() -> None:
    """A group that takes its whole budget holds one slot, not the event loop."""
    recipe = Recipe("addition", {}, (RewardTerm("regex", pattern="(a+)+$"),))
    metrics = Metrics()
    scoring = Scoring(metrics, trusted_slots=1)
    ticks = 0

    async def main(sandbox: Sandbox) -> list:
        async def tick() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            scores = await scoring.score(sandbox, "bomber", 0, ["a" * 40 + "!"], trusted=False)
            nursery.cancel_scope.cancel()
        return scores

    with Sandbox(recipe) as sandbox:
        sandbox.start()
        scores = trio.run(main, sandbox)
    assert scores[0].outcome == "scorer_timeout"
    assert ticks > 100  # the loop ran through the ~2 s the group took
    assert scoring.budget_left("bomber") < scoring.budget_left("someone else") - 1.5
    failures = {
        s.labels["outcome"]: s.value
        for s in metrics.scoring_failures.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert NEW_NODE_SLOTS == 1 and failures == {"scorer_timeout": 1}


def test_new_identities_share_one_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fresh identity brings a full budget of its own: what bounds a stream of them is
    the budget new nodes share. A trusted node scores all the same."""
    monkeypatch.setattr(scoring_mod, "NEW_NODES_BURST_S", 3.0)
    monkeypatch.setattr(scoring_mod, "NEW_NODES_S_PER_MINUTE", 0.6)
    recipe = Recipe("addition", {}, (RewardTerm("regex", pattern="(a+)+$"),))
    scoring = Scoring(Metrics(), trusted_slots=1)
    bomb = ["a" * 40 + "!"]  # runs to its 2 s budget

    async def main(sandbox: Sandbox) -> tuple[list, list]:
        outcomes = []
        for i in range(3):
            try:
                scores = await scoring.score(sandbox, f"fresh-{i}", 0, bomb, trusted=False)
                outcomes.append(scores[0].outcome)
            except NewNodesBusy:
                outcomes.append("busy")
        trusted = await scoring.score(sandbox, "veteran", 0, bomb, trusted=True)
        return outcomes, trusted

    with Sandbox(recipe) as sandbox:
        sandbox.start()
        outcomes, trusted = trio.run(main, sandbox)
    # 3 s of burst: two 2 s groups, then refused before the sandbox saw a third.
    assert outcomes == ["scorer_timeout", "scorer_timeout", "busy"]
    assert scoring.new_nodes_left() < 0
    assert scoring.budget_left("fresh-2") == scoring_mod.SCORING_BURST_S  # charged nothing
    assert trusted[0].outcome == "scorer_timeout"


def test_gym_datasets_with_unguarded_interpreters_need_the_operators_leave() -> None:
    jobs = JobsSection()
    with pytest.raises(SpecError, match=r"'codeio' calls exec on answers.*\[jobs\] allow_gym"):
        jobs.check_gym("gym:codeio", {})
    with pytest.raises(SpecError, match="codeio"):
        jobs.check_gym("gym", {"dataset": "codeio"})
    jobs.check_gym("gym:spiral_matrix", {})  # guarded: literal_eval
    jobs.check_gym("gym:basic_arithmetic", {})
    JobsSection(allow_gym=["codeio"]).check_gym("gym:codeio", {})
    jobs.check_gym("gym:no_such_dataset", {})  # left to the task's own check, which names it
