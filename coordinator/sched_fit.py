"""What fits a node, and how fast it would run a job it has not run yet. Pure.

:func:`param_count` sizes a job's model from its spec (the tiny Llama's shapes, or the weight
files of a local Hugging Face folder); :func:`misfit` says why a node cannot serve a job (its
memory against the model's, its engine against the model's shape) or None; :func:`estimate_rate`
turns a node's measured speed on one job into an estimate for another (generation costs about
in proportion to the parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
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


def estimate_rate(
    measured: Mapping[str, float],
    params: Mapping[str, int],
    tokens_per_rollout: Mapping[str, float],
    job_id: str,
    fallback_tokens_per_s: float,
) -> float | None:
    """Rollouts/s a node would deliver on ``job_id``.

    ``measured`` maps jobs to the node's measured tokens/s on them (its newest first, as
    inserted last); ``params`` and ``tokens_per_rollout`` describe the jobs. The node's own
    measure on the job wins; else its measure on another job scaled by the models' sizes; else
    ``fallback_tokens_per_s`` (what it declared) when positive; else None (unknown).
    """
    tpr = max(tokens_per_rollout.get(job_id, 1.0), 1e-9)
    if measured.get(job_id, 0.0) > 0:
        return measured[job_id] / tpr
    for other in reversed(list(measured)):
        tps = measured[other]
        if tps > 0 and params.get(other) and params.get(job_id):
            return tps * params[other] / params[job_id] / tpr
    if fallback_tokens_per_s > 0:
        return fallback_tokens_per_s / tpr
    return None
