"""The real-model learning benchmark's recipe, run folders and figures
(benchmarks/real_learning.py), without running a model."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from benchmarks import word_problems
from benchmarks.real_learning import (
    DATA_FILE,
    FULL,
    QUICK,
    check_recipe,
    job_toml,
    keep,
    kept,
    make_recipe,
    mean_interval,
    plot,
    plot_title,
    run_sync,
    run_trl,
    summarize,
    swarm_result,
    throughput,
    with_data,
)
from echo.protocol.jobspec import parse_job


def test_the_recipe_is_the_quick_or_full_budget_and_refuses_an_empty_run() -> None:
    quick, full = make_recipe(True), make_recipe(False)
    assert {k: quick[k] for k in QUICK} == QUICK and {k: full[k] for k in FULL} == FULL
    assert quick["task_params"]["max_new_tokens"] == QUICK["max_new"]
    assert make_recipe(False, steps=7, lr=3e-5, group=None)["steps"] == 7
    assert make_recipe(False, group=None)["group"] == FULL["group"]
    with pytest.raises(ValueError, match="at least one step"):
        make_recipe(True, steps=0)
    with pytest.raises(ValueError, match="at least 2 samples"):
        make_recipe(True, group=1)
    with pytest.raises(ValueError, match="not a recipe setting: lr_decay"):
        make_recipe(True, lr_decay=0.5)


def test_a_folder_takes_its_own_recipe_again_and_refuses_another(tmp_path: Path) -> None:
    recipe = make_recipe(True)
    check_recipe(tmp_path, recipe)
    check_recipe(tmp_path, make_recipe(True))  # a rerun goes on from the runs there
    with pytest.raises(SystemExit, match="another recipe"):
        check_recipe(tmp_path, make_recipe(True, lr=2 * QUICK["lr"]))
    assert json.loads((tmp_path / "recipe.json").read_text()) == recipe


def test_kept_runs_are_read_back_instead_of_run_again(tmp_path: Path) -> None:
    """A finished run in the folder is the result: no model is built (none is installed for
    this path), and a half-written one (the .tmp) does not count."""
    recipe = make_recipe(True)
    done = {"eval_first": 0.25, "eval_last": 0.5, "eval_curve": [[0, 0.25], [2, 0.5]],
            "rewards": [0.1, 0.2], "wall_s": 3.0}  # fmt: skip
    keep(tmp_path / "sync-seed0.json", done)
    keep(tmp_path / "trl-seed0.json", done)
    assert run_sync(recipe, 0, tmp_path / "sync-seed0.json") == done
    assert run_trl(recipe, 0, tmp_path / "trl-seed0.json") == done
    assert not list(tmp_path.glob("*.tmp"))
    assert kept(tmp_path / "sync-seed1.json") is None


def test_the_task_reads_the_committed_problems_and_refuses_another_file(tmp_path: Path) -> None:
    recipe = with_data(make_recipe(True))
    assert recipe["task_params"]["path"] == str(DATA_FILE.resolve())
    assert "path" not in make_recipe(True)["task_params"]  # recipe.json names no machine path
    other = word_problems.write(tmp_path / "p.jsonl", n=recipe["data"]["rows"], seed=1)
    with pytest.raises(ValueError, match="not the recipe's problems"):
        with_data(make_recipe(True), other)
    rows = word_problems.rows()
    assert len(rows) == word_problems.ROWS
    assert len({r["question"] for r in rows}) > 0.9 * len(rows)  # few repeats across splits
    assert all(isinstance(r["answer"], int) and r["answer"] > 0 for r in rows)
    with pytest.raises(ValueError, match="at least one row"):
        word_problems.rows(0)


def test_a_subset_of_operations_is_its_own_recipe_and_file(tmp_path: Path) -> None:
    """--ops add,sub: only sums and differences, the default file untouched, another folder's
    recipe; the system prompt by name or as text."""
    assert "ops" not in make_recipe(True)["data"]  # folders made before --ops still match
    easy = make_recipe(True, ops=["add", "sub"], system="number")
    assert easy["data"]["ops"] == ["add", "sub"] and easy != make_recipe(True)
    assert easy["task_params"]["system_prompt"] == "Answer with just the number."
    assert make_recipe(True, system="Be brief.")["task_params"]["system_prompt"] == "Be brief."
    rows = word_problems.rows(40, ops=["add", "sub"])
    assert rows[:2] == word_problems.rows(2, ops=["add", "sub"])  # the same from the seed
    assert all(("more" in r["question"] or "all" in r["question"] or "find" in r["question"])
               if i % 2 == 0 else r["answer"] >= 1 for i, r in enumerate(rows))
    assert rows != word_problems.rows(40)
    path = word_problems.write(tmp_path / "easy.jsonl", ops=["add", "sub"])
    assert with_data(easy, path)["task_params"]["path"] == str(path.resolve())
    with pytest.raises(ValueError, match="not the recipe's problems"):
        with_data(easy, DATA_FILE)
    with pytest.raises(ValueError, match="ops must name"):
        make_recipe(True, ops=["pow"])
    with pytest.raises(ValueError, match="ops must name"):
        word_problems.rows(4, ops=[])


def test_bare_arithmetic_is_named_on_its_own_and_scored_by_the_recipes_match() -> None:
    """--ops add1: "What is a + b?" with single digits, from the same seed every time, never in
    the default file; --match number is recorded, math (the default) is not."""
    rows = word_problems.rows(200, ops=["add1", "mul1"])
    assert rows == word_problems.rows(200, ops=["add1", "mul1"])
    assert rows[0] == {"id": "w0000", "question": "What is 5 + 4?", "answer": 9}
    for r in rows:
        a, sign, b = r["question"].removeprefix("What is ").removesuffix("?").split()
        assert 1 <= int(a) <= 9 and 1 <= int(b) <= 9
        assert r["answer"] == (int(a) + int(b) if sign == "+" else int(a) * int(b))
    two = word_problems.rows(50, ops=["add2"])
    assert all(r["answer"] >= 20 for r in two) and len({r["question"] for r in two}) > 45
    assert not any("What is" in r["question"] for r in word_problems.rows())
    bare = make_recipe(True, ops=["add1"], match="number")
    assert bare["data"]["ops"] == ["add1"] and bare["task_params"]["match"] == "number"
    assert "match" not in make_recipe(True)["task_params"]  # older folders still match
    with pytest.raises(ValueError, match="match must be"):
        make_recipe(True, match="fuzzy")


def test_the_swarm_job_is_the_recipe(tmp_path: Path) -> None:
    recipe = with_data(make_recipe(False))
    job = parse_job(tomllib.loads(job_toml(recipe, str(tmp_path), staleness=2)))
    assert (job.steps, job.group_size, job.batch_groups, job.staleness) == (
        recipe["steps"], recipe["group"], recipe["prompts"], 2)
    assert job.grpo.lr == recipe["lr"] and job.publish_dtype == "bfloat16"
    assert job.sampling.max_new_tokens == recipe["max_new"]
    assert job.sampling.temperature == recipe["temperature"]
    assert (job.eval.every, job.eval.prompts) == (recipe["eval_every"], recipe["eval_prompts"])
    assert job.task.params == recipe["task_params"]


def test_throughput_reads_the_versions_publication_times() -> None:
    versions = [
        {"version": 0, "published_at": 100.0, "eval_s": 5.0},
        {"version": 1, "published_at": 160.0, "step_s": 20.0, "encode_s": 1.0},
        {"version": 2, "published_at": 220.0, "step_s": 20.0, "encode_s": 1.0, "eval_s": 8.0},
    ]
    per_hour, busy = throughput(versions)
    assert per_hour == pytest.approx(3600 * 2 / 120)
    assert busy == pytest.approx(50 / 120)  # v0's evaluation came before the span
    assert throughput(versions[:1]) == (None, None)
    assert throughput([{"version": v["version"]} for v in versions]) == (None, None)


def test_a_swarm_summary_gives_the_figures_the_table_reads() -> None:
    s = {"eval_first": 0.2, "eval_last": 0.4, "bench_wall_s": 50.0, "versions": 2,
         "eval_by_version": [{"version": 0, "accuracy": 0.2}, {"version": 2, "accuracy": 0.4}],
         "learner_by_version": [
             {"version": 0, "published_at": 0.0},
             {"version": 1, "published_at": 10.0, "step_s": 5.0, "reward": 0.3,
              "staleness_mean": 0.5},
             {"version": 2, "published_at": 20.0, "step_s": 5.0, "reward": 0.5,
              "staleness_mean": 1.0}],
         "rollouts_accepted": 9, "rollouts_trained": 8,
         "accepted_by_engine": {"torch": 6, "llamacpp": 3}}  # fmt: skip
    r = swarm_result(s, 2)
    assert r["rewards"] == [0.3, 0.5] and r["eval_curve"] == [[0, 0.2], [2, 0.4]]
    assert r["versions_per_hour"] == pytest.approx(360) and r["learner_busy_share"] == 0.5
    assert r["staleness_mean"] == 0.75
    summary = summarize([r, {**r, "eval_last": 0.6}])
    assert summary["gain"] == pytest.approx([0.2, 0.4])
    lo, hi = summary["gain_interval"]
    assert 0.2 <= lo <= summary["gain_mean"] <= hi <= 0.4


def test_the_gain_interval_straddles_zero_when_runs_disagree() -> None:
    lo, hi = mean_interval([-0.1, 0.1, -0.05, 0.08])
    assert lo < 0 < hi
    assert mean_interval([0.1, 0.1, 0.1]) == pytest.approx((0.1, 0.1))


def test_the_curves_name_the_task_and_plot_every_way(tmp_path: Path) -> None:
    sums = make_recipe(False, ops=["add1"], match="number")
    assert plot_title(sums).startswith("SmolLM2-135M-Instruct, one-digit sums: 4 x 8")
    assert "word problems (add, sub" in plot_title(make_recipe(False, ops=["add", "sub"]))
    run = {"eval_first": 0.1, "eval_last": 0.8, "wall_s": 1.0,
           "eval_curve": [[0, 0.1], [6, 0.5], [12, 0.8]]}
    late = {**run, "eval_curve": [[0, 0.1], [7, 0.6], [12, 0.8]]}  # no common versions: no mean
    png = plot({"sync": summarize([run, run]), "swarm/S1": summarize([run, late])},
               tmp_path / "curves.png", plot_title(sums))
    pytest.importorskip("matplotlib")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
