"""Held-out greedy accuracy: whether the policy has learned the task, not just its samples.

Sampled reward mixes what the policy knows with how much it still explores; greedy accuracy on
prompts it never trained on is the figure a researcher watches. The prompts are the task's
held-out ids (:meth:`echo.tasks.base.Task.eval_prompt_ids`): for procedural tasks ids from
:data:`EVAL_PROMPT_BASE` on, which are never leased (the coordinator numbers training prompts
from 0); for dataset tasks their eval split. Either way the set is disjoint from the training
stream and the same on every run of a task. Prompts are rendered as the coordinator renders
training prompts (:class:`echo.models.prompts.PromptRenderer`, the same chat setting), and scored
with the task's own scorer (a job's extra reward components, such as a format bonus or a
researcher's function that runs on the coordinator only, do not count towards accuracy).
The synchronous baseline (``tools/grpo_local.py``) and the swarm's learner both call
:func:`greedy_accuracy`, so their figures are comparable.
"""

from __future__ import annotations

from typing import Any

import torch

from echo.models.kv_cache import forward_with_cache
from echo.models.prompts import PromptRenderer
from echo.models.spec import (
    ChatMode,
    ModelSpec,
    decode_completion,
    eos_token_id,
    use_chat_template,
)
from echo.tasks.base import EVAL_PROMPT_BASE, Task

__all__ = ["EVAL_PROMPT_BASE", "EVAL_BATCH", "greedy_accuracy", "greedy_completions"]
# Prompts per forward: bounds memory on real models while keeping the tiny model's calls few.
EVAL_BATCH = 64


@torch.no_grad()
def greedy_completions(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_id: int
) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids), cut after the first EOS (kept out).

    Prompts are left-padded so every row's next token is predicted from the last column; the
    attention mask and explicit positions make each row independent of its neighbours' lengths.
    The model is only read; its mode is left as it was.
    """
    out: list[list[int]] = []
    dev = next(model.parameters()).device
    for at in range(0, len(prompts), EVAL_BATCH):
        chunk = prompts[at : at + EVAL_BATCH]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), eos_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=dev)
        gen: list[torch.Tensor] = []
        # A KV cache: without one each new token re-reads the whole prompt, which made 4 eval
        # prompts of a real model (150-token chat prompts, 48 new tokens) take 75-93 s on 2
        # CPU cores, longer than the training steps between them.
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = None
        for _ in range(max_new_tokens):
            out_, cache = forward_with_cache(
                model, cache, input_ids=ids, attention_mask=mask, position_ids=pos
            )
            tok = torch.where(done, eos_id, out_.logits[:, -1].argmax(-1))
            gen.append(tok)
            done |= tok == eos_id
            if bool(done.all()):
                break
            ids = tok.unsqueeze(1)  # the cache holds everything before it
            pos = pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(tok).unsqueeze(1)], 1)
        rows = torch.stack(gen, 1).cpu().tolist()
        for row in rows:
            out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


def greedy_accuracy(
    model: torch.nn.Module,
    spec: ModelSpec,
    task: Task,
    n: int = 256,
    tokenizer: Any = None,
    chat: ChatMode = "auto",
) -> float:
    """Mean task reward of greedy answers to the task's first ``n`` held-out prompts (fewer when
    a dataset's eval split is smaller), rendered with the job's ``chat`` setting.

    :raises ValueError: if ``n`` is not positive, the task has no held-out prompt, an ``hf``
        spec comes without its tokenizer, or ``chat = "always"`` meets a model without a
        chat template.
    """
    if n <= 0:
        raise ValueError("need at least one evaluation prompt")
    pids = task.eval_prompt_ids(n)
    if not pids:
        raise ValueError(f"task {task.name!r} has no held-out prompts")
    render = PromptRenderer(spec, task, tokenizer, use_chat_template(spec, tokenizer, chat))
    prompts = [render.ids(i) for i in pids]
    eos = eos_token_id(spec)
    comps = greedy_completions(model, prompts, task.max_new_tokens, eos)
    texts = [decode_completion(spec, c, tokenizer) for c in comps]
    return sum(task.reward(i, t) for i, t in zip(pids, texts, strict=True)) / len(pids)
