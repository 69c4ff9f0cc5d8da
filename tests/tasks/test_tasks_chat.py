"""Prompts as token ids: chat templates, plain-text fallback, and the coordinator and learner
rendering them the same way (leases, verification rewards, held-out evaluation)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from echo.coordinator.jobs.context import check_job, load_running_job
from echo.coordinator.store import Store
from echo.learner.evaluate import greedy_accuracy
from echo.models.prompts import PromptRenderer
from echo.models.spec import ModelSpec, build_model, encode_prompt, load_tokenizer
from echo.models.tokenizer import encode
from echo.protocol.jobspec import parse_job
from echo.tasks import make_task
from echo.tasks.dataset import DatasetTask

DATA = str(Path(__file__).parents[1] / "data" / "gsm8k_mini.jsonl")
TINY = ModelSpec()


def test_tiny_model_keeps_plain_text() -> None:
    task = make_task("dataset", {"path": DATA, "system_prompt": "Be brief."})
    render = PromptRenderer.for_job(TINY, task, None, "auto")
    assert not render.chat and render.prompt_format == "plain text"
    assert render.ids(0) == encode(f"Be brief.\n\n{task.prompt(0)}", add_bos=True)
    # Tasks without a system prompt encode exactly as before.
    addition = make_task("addition", {})
    assert PromptRenderer.for_job(TINY, addition, None, "auto").ids(3) == encode(
        addition.prompt(3), add_bos=True
    )
    with pytest.raises(ValueError, match="chat = 'always' but the tiny byte model has no chat"):
        PromptRenderer.for_job(TINY, task, None, "always")


def test_chat_template_of_a_real_tokenizer(smollm2_path: Path, caplog) -> None:
    spec = ModelSpec(kind="hf", path=str(smollm2_path))
    tok = load_tokenizer(spec)
    task = make_task("dataset", {"path": DATA, "system_prompt": "Answer in \\boxed{}."})
    with caplog.at_level(logging.INFO):
        render = PromptRenderer.for_job(spec, task, tok, "auto", job="j1")
    assert render.chat and "job j1: prompts use the model's chat template" in caplog.text
    ids = render.ids(0)
    assert tok.decode(ids) == (
        "<|im_start|>system\nAnswer in \\boxed{}.<|im_end|>\n"
        f"<|im_start|>user\n{task.prompt(0)}<|im_end|>\n<|im_start|>assistant\n"
    )
    # Rendered once by the template, not wrapped in a second BOS by the tokenizer.
    assert (
        ids
        == tok.apply_chat_template(
            [
                {"role": "system", "content": "Answer in \\boxed{}."},
                {"role": "user", "content": task.prompt(0)},
            ],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    never = PromptRenderer.for_job(spec, task, tok, "never")
    assert never.ids(0) == list(tok(f"Answer in \\boxed{{}}.\n\n{task.prompt(0)}").input_ids)


def test_a_tokenizer_without_a_template_falls_back_and_says_so(
    smollm2_path: Path, tmp_path: Path, caplog
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(smollm2_path, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    (bare / "chat_template.jinja").unlink()
    spec = ModelSpec(kind="hf", path=str(bare))
    tok = load_tokenizer(spec)
    task = make_task("addition", {})
    with caplog.at_level(logging.WARNING):
        render = PromptRenderer.for_job(spec, task, tok, "auto", job="j2")
    assert not render.chat and render.prompt_format == "plain text"
    assert "job j2: the tokenizer at" in caplog.text and "has no chat template" in caplog.text
    assert render.ids(5) == list(tok(task.prompt(5)).input_ids)
    with pytest.raises(ValueError, match="has no chat template"):
        PromptRenderer.for_job(spec, task, tok, "always")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        encode_prompt(spec, "x", tok, chat=True)


def job_spec(**over: object):
    return parse_job(
        {
            "name": "gsm",
            "task": {
                "name": "dataset",
                "params": {"path": DATA, "id_field": "id", "system_prompt": "Be brief."},
            },
            "reward": [{"kind": "math"}, {"kind": "format", "weight": 0.5}],
            **over,
        }
    )


def test_coordinator_renders_leases_and_scores_with_the_job_reward(tmp_path: Path) -> None:
    spec = job_spec()
    store = Store.open(tmp_path / "db.sqlite")
    try:
        store.create_job("gsm-1", spec.name, spec.model_dump(mode="json"))
        job = load_running_job(store, "gsm-1")
    finally:
        store.close()
    task = job.ctx.task
    assert isinstance(task, DatasetTask) and job.prompt_format == "plain text"
    assert job.prompt_tokens(4) == encode(f"Be brief.\n\n{task.prompt(4)}", add_bos=True)
    answer = task.answer(4)
    texts = [f"<answer>{answer}</answer>", f"\\boxed{{{answer}}}", "<answer>nope</answer>"]
    assert [s.value for s in job.scorer.score(4, texts)] == [1.5, 1.0, 0.5]
    assert job.max_new_tokens == min(spec.sampling.max_new_tokens, task.max_new_tokens)
    job.close()


def test_check_job_names_the_problem_before_a_job_is_stored(tmp_path: Path) -> None:
    check_job(job_spec())
    check_job(parse_job({"name": "g", "task": {"name": "gym:basic_arithmetic"}}))
    bad = [
        (
            {"task": {"name": "dataset", "params": {"path": str(tmp_path / "x.jsonl")}}},
            "x.jsonl does not exist",
        ),
        (
            {"task": {"name": "dataset", "params": {"path": DATA, "prompt_field": "q"}}},
            "row 0 has no field 'q'",
        ),
        (
            {"task": {"name": "dataset", "params": {"path": DATA}, "chat": "always"}},
            "no chat template",
        ),
        (
            {"reward": [{"kind": "python", "entry_point": "not_registered"}]},
            "no reward entry point 'not_registered'",
        ),
        ({"task": {"name": "gym:nope"}}, "unknown reasoning-gym dataset 'nope'"),
    ]
    for over, message in bad:
        with pytest.raises(ValueError, match=message):
            check_job(job_spec(**over))


def test_evaluation_uses_the_eval_split() -> None:
    task = make_task(
        "dataset", {"path": DATA, "id_field": "id", "match": "exact", "max_new_tokens": 4}
    )
    n_eval = len(task.load().eval)
    model = build_model(TINY, seed=0)

    class Recording(DatasetTask):
        seen: list[int] = []

        def reward(self, prompt_id: int, completion: str) -> float:
            self.seen.append(prompt_id)
            return 1.0 if prompt_id % 2 == 0 else 0.0

    rec = Recording(task.params)
    acc = greedy_accuracy(model, TINY, rec, n=100)
    assert sorted(Recording.seen) == task.eval_prompt_ids(100) and len(Recording.seen) == n_eval
    assert acc == sum(1 for p in Recording.seen if p % 2 == 0) / n_eval
    assert greedy_accuracy(model, TINY, task, n=2) == 0.0  # a random tiny model is never right
