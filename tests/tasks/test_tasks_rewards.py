"""Job rewards: extraction, math-verify, exact/regex/format, weighted sums, researcher rewards
registered as real entry points and run in a child process with a time limit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from echo.protocol.jobspec import RewardSection, SpecError, load_job_toml
from echo.tasks import make_task
from echo.tasks import rewards as rw
from echo.tasks.sandbox import Recipe, Sandbox, SandboxError
from echo.tasks.scoring import JobReward, RewardTerm

DATA = str(Path(__file__).parents[1] / "data" / "gsm8k_mini.jsonl")


def test_answer_extraction() -> None:
    assert rw.tagged("a <answer> 1 </answer> b <answer>2</answer>") == "2"
    assert rw.tagged("no tags") is None
    assert rw.final_answer("think\n<answer>\n42\n</answer>\n") == "42"
    assert rw.final_answer("step one\nstep two\n  17  \n\n") == "17"
    assert rw.final_answer("") == ""
    assert rw.final_answer("x <sol>5</sol>", tag="sol") == "5"


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("The total is \\boxed{48}.", "48", 1.0),
        ("so 3 + 5 = 8 apples", "8", 1.0),  # the last number
        ("$\\frac{1}{2}$", "0.5", 1.0),  # LaTeX against a decimal
        ("<answer>2.5</answer>", "\\frac{5}{2}", 1.0),
        ("I think \\boxed{47}", "48", 0.0),
        ("no number here", "48", 0.0),
    ],
)
def test_math_verify(completion: str, answer: str, score: float) -> None:
    assert rw.math_score(completion, answer) == score


def test_math_verify_off_the_main_thread_runs_in_a_bounded_process() -> None:
    # math-verify's own timeouts need the main thread; elsewhere the call goes to a child.
    got: list[float] = []
    cases = [("\\boxed{48}", "48"), ("47", "48"), ("$\\frac{1}{2}$", "0.5")]
    thread = threading.Thread(target=lambda: got.extend(rw.math_score(c, a) for c, a in cases))
    thread.start()
    thread.join(120)
    assert got == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("The answer is 12, since 8 + 4 = 12.", "12", 1.0),
        ("12", "12", 1.0),
        ("<answer>-3.5</answer> then 7", "-3.5", 1.0),  # the tag wins
        ("To find 8 + 4,", "12", 0.0),  # math-verify scores this 1.0: it sums the echo
        ("The answer is 112", "12", 0.0),
        ("x12 and 1.2.3", "12", 0.0),  # glued to a word or a dotted run: not a number
        ("5-3", "3", 1.0),
        ("no number here", "12", 0.0),
        ("12", "twelve", 0.0),  # a reference that is not a number matches nothing
    ],
)
def test_last_number(completion: str, answer: str, score: float) -> None:
    assert rw.last_number_score(completion, answer) == score


def test_the_dataset_task_scores_by_the_last_number_when_asked() -> None:
    task = make_task("dataset", {"path": DATA, "match": "number", "max_new_tokens": 4})
    answer = task.answer(0)
    assert task.reward(0, f"So it is {answer}.") == 1.0
    assert task.reward(0, f"So it is {answer}, not {int(float(answer)) + 1}") == 0.0


def test_exact_regex_and_format() -> None:
    assert rw.exact_score("work\n<answer> 12 </answer>", "12") == 1.0
    assert rw.exact_score("12.0", "12") == 0.0
    assert rw.regex_score("the answer: 3.5 kg", r"answer: {answer}\b", "3.5") == 1.0
    assert rw.regex_score("the answer: 3x5 kg", r"answer: {answer}\b", "3.5") == 0.0  # escaped
    assert rw.format_score("thinking... <answer>7</answer>") == 1.0
    assert rw.format_score("<answer>7</answer> and more") == 0.0
    assert rw.format_score("<answer> </answer>") == 0.0
    assert rw.format_score("<answer>1</answer><answer>2</answer>") == 0.0
    assert rw.format_score("<final>1</final>", tag="final") == 1.0


def test_weighted_sum_and_default() -> None:
    task = make_task("dataset", {"path": DATA, "shuffle": False})
    answer = task.answer(0)
    plain = JobReward(task)
    assert plain.describe() == "1*task"
    assert plain(0, f"\\boxed{{{answer}}}") == 1.0
    job = JobReward(
        task,
        [
            RewardSection(kind="math", weight=1.0),
            RewardSection(kind="format", weight=0.2),
            RewardSection(kind="regex", weight=-0.5, pattern="(?i)sorry"),
            RewardSection(kind="exact", weight=0.3),
        ],
    )
    good = f"Adding up. <answer>{answer}</answer>"
    assert job.breakdown(0, good) == {
        "math#0": 1.0,
        "format#1": 1.0,
        "regex#2": 0.0,
        "exact#3": 1.0,
    }
    assert job(0, good) == pytest.approx(1.5)
    # math finds the number; exact wants the whole last line to be the answer.
    assert job(0, f"Sorry, {answer}") == pytest.approx(1.0 - 0.5)
    assert job(0, f"Sorry.\n{answer}") == pytest.approx(1.0 - 0.5 + 0.3)
    assert job(0, "no idea") == 0.0


REWARD_MODULE = """
import os, time

def good(prompt, completion, answer, prompt_id):
    return 1.0 if completion.strip() == answer else 0.25

def slow(prompt, completion, answer, prompt_id):
    if completion == "hang":
        time.sleep(600)
    return 0.5

def broken(prompt, completion, answer, prompt_id):
    if completion == "die":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    raise RuntimeError("grader bug")
"""


@pytest.fixture
def entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real entry point group: a module and a ``*.dist-info`` on sys.path, which is how
    ``importlib.metadata`` finds installed distributions (the child process inherits the path)."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    info = tmp_path / "my_rewards-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rewards\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[echo_swarm.rewards]\ngood = my_rewards:good\nslow = my_rewards:slow\n"
        "broken = my_rewards:broken\nmissing = my_rewards:nope\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _python(name: str, **kw: object) -> Recipe:
    return Recipe(
        "dataset", {"path": DATA, "shuffle": False}, (RewardTerm("python", **kw, entry_point=name),)
    )


def test_python_reward_from_an_entry_point(entry_points: Path) -> None:
    task = make_task("dataset", {"path": DATA, "shuffle": False})
    with Sandbox(_python("good", weight=2.0)) as sandbox:
        scores = sandbox.score(0, [task.answer(0), "wrong"])
    assert [(s.value, s.outcome) for s in scores] == [(2.0, "ok"), (0.5, "ok")]


def test_a_hanging_reward_is_killed_scores_zero_and_the_group_goes_on(entry_points: Path) -> None:
    with Sandbox(_python("slow", timeout_s=1)) as sandbox:
        t0 = time.monotonic()
        scores = sandbox.score(0, ["fine", "hang", "fine"])
        assert time.monotonic() - t0 < 10
    assert [(s.value, s.outcome) for s in scores] == [
        (0.5, "ok"),
        (0.0, "scorer_timeout"),
        (0.5, "ok"),  # scored in a fresh child
    ]
    assert 1.0 <= scores[1].seconds < 3.0  # what the node is charged
    with Sandbox(_python("slow", timeout_s=1)) as sandbox:
        capped = sandbox.score(0, ["hang", "fine", "fine"], max_s=0.5)  # all its sender had
    assert [s.outcome for s in capped] == ["scorer_timeout", "scorer_skipped", "scorer_skipped"]
    assert capped[0].seconds < 1.0


def test_failing_rewards_score_zero_with_the_reason(entry_points: Path) -> None:
    with Sandbox(_python("broken")) as sandbox:
        scores = sandbox.score(0, ["x", "nan", "die", "x", "die", "x"])
    assert [s.outcome for s in scores] == [
        "scorer_error",  # raised
        "scorer_error",  # returned nan
        "scorer_crashed",  # killed its process
        "scorer_error",  # a new child goes on
        "scorer_crashed",  # the second death ends the group:
        "scorer_skipped",
    ]
    assert all(s.value == 0.0 for s in scores)
    with pytest.raises(SandboxError, match="cannot load the job's reward: AttributeError"):
        Sandbox(_python("missing")).start()


def test_unknown_entry_point_is_named_at_job_load(entry_points: Path) -> None:
    task = make_task("dataset", {"path": DATA})
    with pytest.raises(
        ValueError,
        match=r"no reward entry point 'nope' in group "
        r"'echo_swarm.rewards' \(registered: .*broken, good",
    ):
        JobReward(task, [RewardSection(kind="python", entry_point="nope")])


def test_reward_sections_in_job_toml() -> None:
    spec = load_job_toml(
        '[job]\nname = "gsm"\n[job.task]\nname = "dataset"\nchat = "always"\n'
        f'params = {{ path = "{DATA}" }}\n'
        '[[job.reward]]\nkind = "math"\nweight = 1.0\ntimeout_s = 3\n'
        '[[job.reward]]\nkind = "format"\nweight = 0.1\ntag = "answer"\n'
    )
    assert [(r.kind, r.weight) for r in spec.reward] == [("math", 1.0), ("format", 0.1)]
    assert spec.task.chat == "always"
    assert load_job_toml('[job]\nname = "x"\n').reward == []
    for body, message in [
        ('kind = "regex"', "kind 'regex' needs 'pattern'"),
        ('kind = "regex"\npattern = "("', "pattern does not compile"),
        ('kind = "math"\npattern = "x"', "pattern does not apply to kind 'math'"),
        ('kind = "python"', "kind 'python' needs 'entry_point'"),
        ('kind = "exact"\ntimeout_s = 3', "timeout_s does not apply to kind 'exact'"),
        ('kind = "math"\nweight = inf', "reward.0.weight"),
        ('kind = "bleu"', "reward.0.kind"),
        ('kind = "math"\ncolour = 1', "reward.0.colour: unknown key"),
    ]:
        with pytest.raises(SpecError, match=message):
            load_job_toml(f'[job]\nname = "x"\n[[job.reward]]\n{body}\n')
    with pytest.raises(SpecError, match="task.chat"):
        load_job_toml('[job]\nname = "x"\n[job.task]\nchat = "sometimes"\n')
