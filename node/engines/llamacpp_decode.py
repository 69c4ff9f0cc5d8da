"""Decoding GRPO groups on llama.cpp: one KV sequence per sample, one batch per step.

llama-cpp-python's high-level ``Llama`` holds one sequence per context, so the engine drives the
C API directly through a :class:`~echo.node.engines.llamacpp_context.LlamaContext` of
``max_seqs`` sequences. :func:`decode_groups` owns the schedule: the samples of all requests are
cut into chunks of at most ``max_seqs``; in each, every request's prompt is prefilled once and
its KV cells copied to the other samples of its group (``llama_memory_seq_cp``), then every step
decodes one token for every unfinished sample in a single batch, and a finished sample's cells
are freed. Each step runs on the thread count that
:class:`~echo.node.engines.step_threads.StepThreads` finds fastest at the moment (1 or the engine's
``threads``). Logits of each step come back to Python (only the rows asked for, so
``logits_all`` is not needed) and are sampled by :mod:`echo.node.engines.llamacpp_sampler` in
NumPy. A sample ends on the model's EOS id (kept in its tokens) or at ``max_new_tokens``.
:func:`unified_cells` says, for the same schedule, how many cells a unified KV cache would hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from echo.node.engines.base import Completion, GenRequest
from echo.node.engines.llamacpp_context import LlamaContext
from echo.node.engines.llamacpp_sampler import sample, sample_rng
from echo.node.engines.step_threads import StepThreads


@dataclass
class _Row:
    """One sample being generated: its request, its KV sequence slot and what it produced."""

    req: int
    slot: int
    rng: np.random.Generator | None
    pos: int
    tokens: list[int]
    logprobs: list[float]
    finish: str | None = None


def decode_groups(
    ll: Any,
    llama: LlamaContext,
    requests: list[GenRequest],
    max_seqs: int,
    eos_id: int,
    threads: StepThreads,
) -> list[list[Completion]]:
    """Every request's ``n`` completions, decoded on ``llama``'s context (``ll``: the
    ``llama_cpp`` module), whose cells per sequence must hold each prompt and its
    ``max_new_tokens``; ``threads`` picks each step's thread count from the steps' times.
    :raises RuntimeError: llama.cpp fails to decode."""
    rows = [
        _Row(req=i, slot=-1, rng=sample_rng(r.params, j), pos=0, tokens=[], logprobs=[])
        for i, r in enumerate(requests)
        for j in range(r.n)
    ]
    for lo in range(0, len(rows), max_seqs):
        _run_chunk(ll, llama, requests, rows[lo : lo + max_seqs], eos_id, threads)
    result: list[list[Completion]] = [[] for _ in requests]
    for row in rows:
        result[row.req].append(
            Completion(
                token_ids=row.tokens,
                logprobs=row.logprobs,
                finish_reason="stop" if row.finish == "stop" else "length",
            )
        )
    return result


def unified_cells(requests: list[GenRequest], max_seqs: int) -> int:
    """The most KV cells a unified cache holds in any chunk of :func:`decode_groups`' schedule:
    each request's prompt once (its samples share the prompt's cells, ``llama_memory_seq_cp``
    adds sequence ids to cells there), plus ``max_new_tokens`` cells per sample. Every token of
    a unified cache attends over this many cells (the other sequences' masked), where one
    stream per sequence attends over its own prompt + completion."""
    reqs = [i for i, r in enumerate(requests) for _ in range(r.n)]
    most = 0
    for lo in range(0, len(reqs), max_seqs):
        chunk = reqs[lo : lo + max_seqs]
        prompts = sum(len(requests[i].prompt_ids) for i in set(chunk))
        most = max(most, prompts + sum(requests[i].params.max_new_tokens for i in chunk))
    return most


def _run_chunk(
    ll: Any,
    llama: LlamaContext,
    requests: list[GenRequest],
    rows: list[_Row],
    eos_id: int,
    threads: StepThreads,
) -> None:
    """Generate ``rows`` (at most ``max_seqs``, one KV sequence each) to completion."""
    mem = ll.llama_get_memory(llama.ctx)
    ll.llama_memory_clear(mem, True)
    for slot, row in enumerate(rows):
        row.slot = slot
    # Prefill each request's prompt once, into the slot of its first row in this chunk.
    groups: dict[int, list[_Row]] = {}
    for row in rows:
        groups.setdefault(row.req, []).append(row)
    prefill = [
        (g[0].slot, tok, pos, pos == len(requests[req].prompt_ids) - 1)
        for req, g in groups.items()
        for pos, tok in enumerate(requests[req].prompt_ids)
    ]
    llama.set_threads(threads.chosen)
    logits = llama.decode(prefill)
    for (req, g), lg in zip(groups.items(), logits, strict=True):
        plen = len(requests[req].prompt_ids)
        for row in g[1:]:
            # Whole range: across KV streams (kv_unified=False) llama.cpp copies only whole
            # sequences; the source holds just the prompt anyway.
            ll.llama_memory_seq_cp(mem, g[0].slot, row.slot, -1, -1)
        for row in g:
            row.pos = plen
        _step(requests, g, np.broadcast_to(lg, (len(g), lg.shape[0])), eos_id)
    active = [r for r in rows if r.finish is None]
    while active:
        n = threads.threads()
        llama.set_threads(n)
        t0 = time.perf_counter()
        logits = llama.decode([(r.slot, r.tokens[-1], r.pos, True) for r in active])
        threads.observe(n, time.perf_counter() - t0)
        for r in active:
            r.pos += 1
        _step(requests, active, logits, eos_id)
        for r in active:
            if r.finish is not None:
                # Frees its cells (matters for a unified cache; cheap otherwise).
                ll.llama_memory_seq_rm(mem, r.slot, -1, -1)
        active = [r for r in active if r.finish is None]


def _step(requests: list[GenRequest], rows: list[_Row], logits: np.ndarray, eos_id: int) -> None:
    """Sample one token for each of ``rows`` from its logits row; mark finished rows."""
    params = [requests[r.req].params for r in rows]
    toks, lps = sample(logits, params, [r.rng for r in rows])
    for r, p, t, lp in zip(rows, params, toks, lps, strict=True):
        r.tokens.append(t)
        r.logprobs.append(lp)
        if t == eos_id:
            r.finish = "stop"
        elif len(r.tokens) >= p.max_new_tokens:
            r.finish = "length"
