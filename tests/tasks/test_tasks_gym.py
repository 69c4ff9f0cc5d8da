"""reasoning-gym tasks: names, config pass-through, determinism across processes, scoring."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from echo.tasks import make_task
from echo.tasks.gym import CHUNK, GymTask

PIDS = [0, 1, CHUNK - 1, CHUNK, 7 * CHUNK + 3, 10**9, 10**9 + 1, 2**63 - 1]


def test_names_and_params() -> None:
    short = make_task("gym:basic_arithmetic", {"max_terms": 3})
    long = make_task("gym", {"dataset": "basic_arithmetic", "max_terms": 3})
    assert isinstance(short, GymTask)
    assert short.describe() == long.describe()
    assert short.describe()["params"]["max_terms"] == 3
    assert [short.prompt(i) for i in PIDS] == [long.prompt(i) for i in PIDS]
    # The dataset's config reaches reasoning-gym: at most 3 terms means at most 2 operators.
    for i in range(50):
        expr = short.prompt(i).removeprefix("Calculate ").rstrip(".")
        assert sum(expr.count(f" {op} ") for op in "+-*/") <= 2, expr
    other = make_task("gym:basic_arithmetic", {"seed": 1, "max_terms": 3})
    assert [other.prompt(i) for i in range(10)] != [short.prompt(i) for i in range(10)]


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'.*basic_arithmetic"):
        make_task("gym:nope", {})
    with pytest.raises(ValueError, match="'colour' is not a setting of .*max_terms"):
        make_task("gym:basic_arithmetic", {"colour": "red"})
    with pytest.raises(ValueError, match="'size' is not a setting"):  # the task owns size
        make_task("gym:basic_arithmetic", {"size": 5})
    with pytest.raises(ValueError, match="basic_arithmetic.*min_terms must be positive"):
        make_task("gym:basic_arithmetic", {"min_terms": 0})
    with pytest.raises(ValueError, match="contradicts the name"):
        make_task("gym:basic_arithmetic", {"dataset": "chain_sum"})
    with pytest.raises(ValueError, match="dataset: Field required"):
        make_task("gym", {})


def test_scoring_extracts_the_answer_first() -> None:
    task = make_task("gym:basic_arithmetic", {})
    for pid in PIDS[:4]:
        answer = task.answer(pid)
        assert task.reward(pid, f"Let me add.\n<answer>{answer}</answer>") == 1.0
        assert task.reward(pid, f"Let me add.\n{answer}\n") == 1.0  # last line
        assert task.reward(pid, f"{answer}\nor maybe not") == 0.0
        assert task.reward(pid, "<answer>0.123456</answer>") == 0.0
    assert "<answer>" in (task.system_prompt(0) or "")
    assert make_task("gym:basic_arithmetic", {"system_prompt": "Hi"}).system_prompt(0) == "Hi"


def test_other_datasets_score_their_own_answers() -> None:
    for name in ("chain_sum", "word_sorting", "leg_counting"):
        task = make_task(f"gym:{name}", {})
        for pid in (0, 1, 10**9):
            assert task.reward(pid, f"<answer>{task.answer(pid)}</answer>") == 1.0, name


def test_prompts_are_the_same_in_another_process() -> None:
    code = (
        "import json; from echo.tasks import make_task\n"
        f"pids = {PIDS!r}\n"
        "out = {}\n"
        "for n in ('basic_arithmetic', 'word_sorting', 'chain_sum'):\n"
        "    t = make_task('gym:' + n, {})\n"
        "    out[n] = [[t.prompt(i), t.answer(i)] for i in pids]\n"
        "print(json.dumps(out))\n"
    )
    runs = []
    for seed in ("1", "2"):  # string hashing differs between the two
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        runs.append(json.loads(res.stdout))
    assert runs[0] == runs[1]
    here = {
        n: [
            [make_task("gym:" + n, {}).prompt(i), make_task("gym:" + n, {}).answer(i)] for i in PIDS
        ]
        for n in runs[0]
    }
    assert here == runs[0]
