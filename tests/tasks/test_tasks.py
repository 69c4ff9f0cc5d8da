"""echo.tasks: deterministic prompts, rewards, format examples, registry errors."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from echo.tasks import TASKS, make_task

DATA = str(Path(__file__).parents[1] / "data" / "gsm8k_mini.jsonl")
# The smallest valid params of every registered task: a new task must add itself here.
CASES = {
    "addition": {},
    "reverse": {},
    "dataset": {"path": DATA},
    "gym": {"dataset": "basic_arithmetic"},
}


def test_every_task_has_a_case() -> None:
    assert set(CASES) == set(TASKS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_prompts_are_pure_and_answers_score_one(name: str) -> None:
    task, again = make_task(name, CASES[name]), make_task(name, CASES[name])
    # Procedural tasks take any id; a dataset's held-out ids end with its eval split.
    big = [] if name == "dataset" else [10**12, 2**63 - 1]
    for pid in [0, 1, 2, 17, *task.eval_prompt_ids(2), *big]:
        assert task.prompt(pid) == again.prompt(pid)
        assert task.reward(pid, task.answer(pid)) == 1.0
        assert task.reward(pid, f" {task.answer(pid)}\n") == 1.0
        assert 0.0 <= task.reward(pid, "zz") <= 1.0
    assert len({task.prompt(i) for i in range(200)}) > 10
    with pytest.raises(ValueError):
        task.prompt(-1)
    with pytest.raises(TypeError):
        task.prompt("3")  # type: ignore[arg-type]


def test_prompts_depend_on_params() -> None:
    small, big = make_task("addition", {"max_operand": 3}), make_task("addition", {})
    assert all(int(x) < 3 for i in range(100) for x in small.prompt(i)[:-1].split("+"))
    assert [small.prompt(i) for i in range(20)] != [big.prompt(i) for i in range(20)]


def test_addition() -> None:
    task = make_task("addition", {"max_operand": 10})
    a, b = map(int, task.prompt(5)[:-1].split("+"))
    assert task.prompt(5) == f"{a}+{b}=" and task.answer(5) == str(a + b)
    assert task.reward(5, str(a + b + 1)) == 0.0
    assert task.reward(5, f"{a + b}0") == 0.0
    assert task.max_new_tokens == 4  # "18" + EOS + slack
    assert make_task("addition", {"max_new_tokens": 9}).max_new_tokens == 9


def test_reverse_partial_credit() -> None:
    task = make_task("reverse", {})
    for pid in range(50):
        word = task.prompt(pid)[4:-1]
        assert task.prompt(pid).startswith("rev ") and 3 <= len(word) <= 6 and word.islower()
    pid = next(i for i in range(100) if len(task.answer(i)) == 4)
    ans = task.answer(pid)
    assert task.reward(pid, ans[:2]) == 0.5
    assert task.reward(pid, ans + "xxxx") == 0.5  # extra characters cost
    assert task.reward(pid, "") == 0.0


FORMATS = {
    "addition": (r"\d\+\d=", r"\d{1,2}"),
    "reverse": (r"rev [a-z]{3,6}=", r"[a-z]{3,6}"),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_examples(name: str) -> None:
    task = make_task(name, {})
    prompt_re, completion_re = FORMATS[name]
    assert all(re.fullmatch(prompt_re, task.prompt(i)) for i in range(100))
    assert all(re.fullmatch(completion_re, task.answer(i)) for i in range(100))
    rng = random.Random(0)
    examples = [task.format_example(rng) for _ in range(200)]
    assert examples == [task.format_example(r) for r in [random.Random(0)] for _ in range(200)]
    assert all(re.fullmatch(prompt_re, p) and re.fullmatch(completion_re, c) for p, c in examples)
    mean = sum(task.reward(0, c) for _, c in examples) / len(examples)
    assert mean < 0.5  # random content, not the answer
    assert all(len(c.encode()) + 1 <= task.max_new_tokens for _, c in examples)


def test_registry_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'.*addition"):
        make_task("nope", {})
    with pytest.raises(ValueError, match="max_operand"):
        make_task("addition", {"max_operand": 0})
    with pytest.raises(ValueError, match="colour"):
        make_task("addition", {"colour": "red"})
    with pytest.raises(ValueError, match="min_len"):
        make_task("reverse", {"min_len": 7, "max_len": 3})
    with pytest.raises(ValueError, match="mapping"):
        make_task("addition", [1, 2])  # type: ignore[arg-type]
    assert make_task("addition", None).describe() == {
        "name": "addition",
        "params": {"max_operand": 10, "max_new_tokens": None},
    }
