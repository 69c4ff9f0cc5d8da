"""Dataset tasks: formats, field mapping, splits, prompt ids, limits and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo.tasks import make_task
from echo.tasks.base import EVAL_PROMPT_BASE
from echo.tasks.dataset import DatasetTask

DATA = Path(__file__).parents[1] / "data" / "gsm8k_mini.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]


def task(**params: object) -> DatasetTask:
    t = make_task("dataset", {"path": str(DATA), **params})
    assert isinstance(t, DatasetTask)
    return t


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def all_rows(t: DatasetTask) -> list[tuple[str, str, str]]:
    s = t.load()
    return [(r.key, r.prompt, r.answer) for r in s.train + s.eval]


def test_jsonl_rows_fields_and_split() -> None:
    t = task(id_field="id")
    s = t.load()
    assert len(s.train) + len(s.eval) == len(ROWS)
    assert 0 < len(s.eval) < len(ROWS) // 2
    by_id = {r["id"]: r for r in ROWS}
    for row in s.train + s.eval:
        assert row.prompt == by_id[row.key]["question"]
        assert row.answer == str(by_id[row.key]["answer"])  # numbers become text
        assert row.system is None
    # Held-out ids are the eval split in order; training ids never reach it.
    assert t.eval_prompt_ids(1000) == [EVAL_PROMPT_BASE + j for j in range(len(s.eval))]
    assert t.eval_prompt_ids(2) == [EVAL_PROMPT_BASE, EVAL_PROMPT_BASE + 1]
    assert {t.row_id(i) for i in t.eval_prompt_ids(100)} == {r.key for r in s.eval}
    train_keys = {t.row_id(i) for i in range(10 * len(s.train))}
    assert train_keys == {r.key for r in s.train}
    with pytest.raises(ValueError, match="past the eval split"):
        t.prompt(EVAL_PROMPT_BASE + len(s.eval))
    with pytest.raises(ValueError, match="outside"):
        t.prompt(-1)


def test_row_keys_without_an_id_field_are_file_positions() -> None:
    t = task()
    assert sorted(r.key for r in t.load().train + t.load().eval) == sorted(
        f"gsm8k_mini.jsonl#{i}" for i in range(len(ROWS))
    )


def test_held_out_split_depends_only_on_the_row_key(tmp_path: Path) -> None:
    base = task(id_field="id")
    # Reordered and extended with new rows: every old row keeps its side of the split.
    more = ROWS[::-1] + [
        {"id": f"new{i}", "question": f"{i}+1?", "answer": i + 1} for i in range(30)
    ]
    grown = task(path=str(write_jsonl(tmp_path / "grown.jsonl", more)), id_field="id")
    old_eval = {r.key for r in base.load().eval}
    new_eval = {r.key for r in grown.load().eval}
    assert old_eval == new_eval - {f"new{i}" for i in range(30)}
    # A bigger fraction holds out more; the seed does not move the split.
    assert len(task(id_field="id", eval_fraction=0.5).load().eval) > len(old_eval)
    assert {r.key for r in task(id_field="id", seed=9).load().eval} == old_eval


def test_epochs_visit_every_row_once_in_a_seeded_order() -> None:
    t = task(id_field="id")
    n = len(t.load().train)
    first = [t.row_id(i) for i in range(n)]
    second = [t.row_id(i) for i in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == sorted(r.key for r in t.load().train)
    assert first != second  # a fresh order each epoch
    assert first == [task(id_field="id").row_id(i) for i in range(n)]  # same on every machine
    assert first != [task(id_field="id", seed=1).row_id(i) for i in range(n)]
    plain = task(id_field="id", shuffle=False)
    assert [plain.row_id(i) for i in range(n)] == [r.key for r in plain.load().train]


def test_system_prompt_template_and_answer_marker(tmp_path: Path) -> None:
    rows = [
        {"q": "2+2?", "solution": "two and two #### 4", "sys": "Be terse."},
        {"q": "3+3?", "solution": "three and three #### 6", "sys": ""},
    ] * 10
    rows = [dict(r, id=str(i)) for i, r in enumerate(rows)]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    t = make_task(
        "dataset",
        {
            "path": str(path),
            "prompt_field": "q",
            "answer_field": "solution",
            "id_field": "id",
            "system_field": "sys",
            "system_prompt": "Default.",
            "answer_after": "####",
            "prompt_template": "Question: {prompt}\nAnswer in \\boxed{}.",
            "shuffle": False,
            "eval_fraction": 0.3,
        },
    )
    pids = list(range(len(t.load().train))) + t.eval_prompt_ids(100)
    for pid in pids:
        row = rows[int(t.row_id(pid))]
        assert t.prompt(pid) == f"Question: {row['q']}\nAnswer in \\boxed{{}}."
        assert t.answer(pid) == row["solution"].split("####")[1].strip()
        assert t.system_prompt(pid) == (row["sys"] or "Default.")
        assert t.reward(pid, f"so \\boxed{{{t.answer(pid)}}}") == 1.0


def test_csv_parquet_and_saved_datasets_read_the_same_rows(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = all_rows(task(id_field="id"))
    csv_path = tmp_path / "g.csv"
    import csv

    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, ["id", "question", "answer"])
        w.writeheader()
        w.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "g.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    for path in ("g.csv", "g.parquet", "saved"):
        got = all_rows(task(path=str(tmp_path / path), id_field="id"))
        assert got == want, path


def test_eval_from_a_file_or_a_datasetdict_split(tmp_path: Path) -> None:
    import datasets

    evals = write_jsonl(tmp_path / "eval.jsonl", ROWS[:5])
    t = task(eval_path=str(evals), id_field="id")
    assert len(t.load().train) == len(ROWS) and len(t.load().eval) == 5
    assert [t.prompt(i) for i in t.eval_prompt_ids(10)] == [r["question"] for r in ROWS[:5]]

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS[5:]),
            "test": datasets.Dataset.from_list(ROWS[:5]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    t = task(path=str(tmp_path / "dd"), eval_split="test", id_field="id")
    assert {r.key for r in t.load().eval} == {r["id"] for r in ROWS[:5]}
    assert len(t.load().train) == len(ROWS) - 5
    with pytest.raises(ValueError, match="no split 'valid'.*train, test"):
        task(path=str(tmp_path / "dd"), eval_split="valid").load()
    with pytest.raises(ValueError, match="eval_split needs a save_to_disk folder"):
        task(eval_split="test")


def test_errors_name_the_file_row_and_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"task 'dataset'.*nope\.jsonl does not exist"):
        make_task("dataset", {"path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(ValueError, match="path: Field required"):
        make_task("dataset", {})
    with pytest.raises(ValueError, match="cannot tell the format"):
        make_task("dataset", {"path": str(write_jsonl(tmp_path / "rows.txt", ROWS))})
    with pytest.raises(ValueError, match="eval_path or eval_split, not both"):
        task(eval_path=str(DATA), eval_split="x")
    with pytest.raises(ValueError, match=r"'\{prompt\}'"):
        task(prompt_template="no marker")
    with pytest.raises(ValueError, match="colour"):
        task(colour="red")
    # Reading happens on first use, and its errors name file, row and field.
    t = task(answer_field="solution")
    with pytest.raises(
        ValueError,
        match=r"gsm8k_mini\.jsonl: row 0 has no field 'solution' "
        r"\(fields: answer, id, question\)",
    ):
        t.load()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not JSON"):
        task(path=str(bad)).load()
    nulls = write_jsonl(tmp_path / "null.jsonl", [*ROWS[:3], {"question": "q", "answer": None}])
    with pytest.raises(ValueError, match=r"row 3: field 'answer' is empty"):
        task(path=str(nulls)).load()
    dup = write_jsonl(tmp_path / "dup.jsonl", [ROWS[0], ROWS[0]])
    with pytest.raises(ValueError, match=r"id 'g000' \(id\) repeats"):
        task(path=str(dup), id_field="id").load()
    with pytest.raises(ValueError, match=r"row 0: 'answer' has no '####' marker"):
        task(answer_after="####").load()
    with pytest.raises(ValueError, match="the eval split is empty"):
        task(path=str(write_jsonl(tmp_path / "one.jsonl", ROWS[:1])), eval_fraction=0.01).load()


def test_limits_are_checked_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"more than 10 rows \(params.max_rows\)"):
        task(max_rows=10).load()
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"question": "x" * (2 << 20), "answer": 1}) + "\n")
    with pytest.raises(ValueError, match=r"big\.jsonl is 2\.0 MiB, over the limit of 1 MiB"):
        task(path=str(big), max_file_mb=1).load()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "g.parquet")
    with pytest.raises(ValueError, match=r"g\.parquet has 42 rows, more than 10"):
        task(path=str(tmp_path / "g.parquet"), max_rows=10).load()
    with pytest.raises(ValueError, match=r"g\.parquet has no field 'prompt' \(fields: id, "):
        task(path=str(tmp_path / "g.parquet"), prompt_field="prompt").load()


def test_rows_are_read_once_per_process(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "g.jsonl", ROWS)
    a, b = task(path=str(path)), task(path=str(path))
    assert a.load() is b.load()
    # A rewritten file is read again.
    write_jsonl(path, ROWS[:20])
    import os

    os.utime(path, ns=(1, 1))
    assert len(task(path=str(path)).load().train) + len(task(path=str(path)).load().eval) == 20


def test_format_examples_pair_real_prompts_with_other_answers() -> None:
    import random

    t = task(id_field="id")
    prompts = {r.prompt for r in t.load().train}
    answers = {r.answer for r in t.load().train}
    examples = [t.format_example(random.Random(i)) for i in range(20)]
    assert all(p in prompts and a in answers for p, a in examples)
