"""What fits a node, and how fast it would run a job it has not run yet. Pure.

:func:`param_count` sizes a job's model from its spec (the tiny Llama's shapes, or the weight
files of a local Hugging Face folder); :func:`misfit` says why a node cannot serve a job (its
memory against the model's, its engine against the model's shape) or None; :func:`delivered_rate`
is the throughput a node delivered on a job, from the groups the coordinator accepted from it;
:func:`estimate_rate` turns what is known of a node (what it delivered, what it reports, what it
declared) into the rollouts/s it would deliver on a job, one it has not run yet included
(generation costs about in proportion to the parameters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from echo.models.tokenizer import VOCAB_SIZE

# Bytes per parameter of the weights nodes receive, by the job's publish dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A node holds the verified state and the engine's own copy, and needs room to generate: the
# model takes this many times its published size in the node's memory.
MEMORY_FACTOR = 3.0
# vLLM's CPU attention needs a head size of at least this (README, vLLM engine).
VLLM_CPU_MIN_HEAD = 32
# A node's delivered throughput counts the groups accepted from it over this recent window of its
# time on a job: long enough to hold many groups of a slow node (in benchmarks/scheduling.py the
# slowest node returned a group every 1-3 s on the largest job; a real model's group takes far
# longer), short enough that a node whose pace changes (other work on its machine, a throttle) is
# planned at its new pace within about a minute.
DELIVERY_WINDOW_S = 60.0
# ... and only once the window holds this many accepted groups: groups come in bursts (two leases
# at once return together; after a switch a node returned 8 groups within 0.2 s), so two or
# three groups are not a rate. Before that the node's report (or declaration) stands in.
DELIVERY_MIN_GROUPS = 4
# Weight files of a Hugging Face folder (stored in 16-bit floats, as published checkpoints are).
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def param_count(model: Mapping[str, Any]) -> int:
    """Parameters of the model a job spec's ``model_spec_dict()`` names.

    A tiny Llama is counted from its shapes; a Hugging Face folder from the size of its weight
    files at 2 bytes a parameter (0 when the folder cannot be read: it then fits anywhere).
    """
    if model.get("kind") == "hf":
        folder = Path(str(model.get("path", "")))
        try:
            size = sum(
                f.stat().st_size
                for f in folder.iterdir()
                if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)
            )
        except OSError:
            return 0
        return size // 2
    hidden = int(model.get("hidden", 64))
    layers = int(model.get("layers", 2))
    heads = int(model.get("heads", 4))
    kv_heads = int(model.get("kv_heads") or heads)
    inter = int(model.get("intermediate") or 4 * hidden)
    vocab = int(model.get("vocab", VOCAB_SIZE))
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if model.get("tie_embeddings") else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden


def model_bytes(model: Mapping[str, Any], publish_dtype: str) -> int:
    """Memory a node needs for the model: published size times :data:`MEMORY_FACTOR`."""
    return int(param_count(model) * DTYPE_BYTES.get(publish_dtype, 4) * MEMORY_FACTOR)


def node_memory(hardware: Mapping[str, Any], engine: str) -> int:
    """The memory a node's engine runs the model in: GPU memory for vLLM on a GPU, else RAM
    (0: unknown, which fits anything)."""
    vram = int(hardware.get("vram_bytes", 0) or 0)
    if engine == "vllm" and vram > 0:
        return vram
    return int(hardware.get("ram_bytes", 0) or 0)


def misfit(
    model: Mapping[str, Any], publish_dtype: str, hardware: Mapping[str, Any], engine: str
) -> str | None:
    """Why a node with ``hardware`` and ``engine`` cannot serve a job's ``model``, or None."""
    need, have = model_bytes(model, publish_dtype), node_memory(hardware, engine)
    if have and need > have:
        return f"the model needs {need / 1e9:.1f} GB, the node has {have / 1e9:.1f} GB"
    if engine == "vllm" and not hardware.get("gpu") and model.get("kind", "tiny") == "tiny":
        head = int(model.get("hidden", 64)) // int(model.get("heads", 4))
        if head < VLLM_CPU_MIN_HEAD:
            return f"vLLM on a CPU needs a head size of {VLLM_CPU_MIN_HEAD}, the model has {head}"
    return None


def delivered_rate(accepted: Sequence[tuple[float, int]], since: float, now: float) -> float | None:
    """Completions/s a node delivered on one job, from ``(accepted_at, completions)`` of the
    groups the coordinator accepted from it there (oldest first), counting only those of its
    current stint on the job (from ``since``) within the last :data:`DELIVERY_WINDOW_S`.

    With :data:`DELIVERY_MIN_GROUPS` groups or more: the groups after the first over the time
    from the first to ``now`` (the time before its first group -- a model to download, an engine
    to start -- is not the node's pace; the time since its last one is, so a node that stops
    delivering decays towards 0). With fewer, after a whole window on the job: its groups over
    the window (0.0 for none). Else None: too early to say.

    A lower bound on what the node could do: on a job whose buffer is full (the learner is
    the bottleneck) a node delivers what the job takes.
    """
    start = max(since, now - DELIVERY_WINDOW_S)
    recent = [(t, c) for t, c in accepted if start <= t <= now]
    if len(recent) >= DELIVERY_MIN_GROUPS:
        span = now - recent[0][0]
        return sum(c for _, c in recent[1:]) / span if span > 0 else None
    if now - since >= DELIVERY_WINDOW_S:
        return sum(c for _, c in recent) / DELIVERY_WINDOW_S
    return None


def estimate_rate(
    measured: Mapping[str, float],
    params: Mapping[str, int],
    tokens_per_rollout: Mapping[str, float],
    job_id: str,
    fallback_tokens_per_s: float,
    delivered: Mapping[str, float] | None = None,
) -> float | None:
    """Rollouts/s a node would deliver on ``job_id``.

    ``delivered`` maps jobs to the completions/s the coordinator accepted from the node there
    (:func:`delivered_rate`); ``measured`` maps jobs to the tokens/s the node reports on them;
    both newest last, as inserted. ``params`` and ``tokens_per_rollout`` describe the jobs.

    What the node delivered on the job wins: the coordinator counts it itself, from groups it
    verified and accepted, so a node cannot inflate it by reporting more than it does (a report
    is the node's word; honest ones overstated delivery 2-7x too, since lease round trips,
    submissions and weight loads are not in an engine's tokens/s, and node processes sharing
    cores each count their own speed). Else the node's report on the job, or on another job
    scaled by the models' sizes, or ``fallback_tokens_per_s`` (what it declared) -- scaled by
    the share of its report the node delivered on a job where both are known (never above 1),
    so that a node found to deliver a tenth of its word is taken at a tenth of it elsewhere
    too. Else what it delivered on another job, scaled by the sizes. Else None (unknown).
    """
    delivered = delivered or {}
    tpr = max(tokens_per_rollout.get(job_id, 1.0), 1e-9)
    if delivered.get(job_id, 0.0) > 0:
        return delivered[job_id]

    def scaled(other: str, tps: float) -> float | None:
        if tps > 0 and params.get(other) and params.get(job_id):
            return tps * params[other] / params[job_id] / tpr
        return None

    reported = None
    if measured.get(job_id, 0.0) > 0:
        reported = measured[job_id] / tpr
    for other in reversed(list(measured)):
        if reported is None:
            reported = scaled(other, measured[other])
    if reported is None and fallback_tokens_per_s > 0:
        reported = fallback_tokens_per_s / tpr
    if reported is not None:
        for other in reversed(list(delivered)):  # the newest job with both measures
            if (
                delivered[other] > 0
                and measured.get(other, 0.0) > 0
                and other in tokens_per_rollout
            ):
                kept = delivered[other] * tokens_per_rollout[other] / measured[other]
                return reported * min(1.0, kept)
        return reported
    for other in reversed(list(delivered)):
        if other in tokens_per_rollout:
            rate = scaled(other, delivered[other] * tokens_per_rollout[other])
            if rate is not None:
                return rate
    return None
