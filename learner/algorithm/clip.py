"""Gradient clipping by global norm, with a norm that does not depend on how the gradients are
sharded: :func:`clip_gradients`, which the GRPO step (``echo.learner.algorithm.grpo``) uses on one
process and on the FSDP2 learner's ranks alike.

``torch.nn.utils.clip_grad_norm_`` takes the float32 norm of the per-tensor norms; on FSDP2
ranks each tensor's norm is over its shard and then across the ranks, so the norm, and with it
the scale every gradient is multiplied by, can come out one float32 step apart from one
process's. AdamW then moves each weight whose gradient is near its eps by a share of a step
that such a scale changes (docs/results/2026-12-07-learner-scale.md measured 2.4e-7 in three
steps). Summed in float64, the squares round to the same float32 scale however the tensors are
split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


def _squares(tensors: list[torch.Tensor]) -> float:
    """The sum of the squares of every element of ``tensors``, in float64: per tensor on its
    device, then over the tensors in order (one copy to the CPU)."""
    if not tensors:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return math.fsum(x * x for x in norms.cpu().tolist())


def clip_gradients(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    across: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """Scale the gradients of ``params`` so that their global L2 norm is at most ``max_norm``,
    as ``torch.nn.utils.clip_grad_norm_`` does; returns the norm they had.

    A gradient sharded over processes (a DTensor with every placement a shard) counts its own
    shard's squares, summed over the processes by ``across`` (a float64 CPU tensor in, its sum
    over the processes out; one process: itself); any other gradient counts whole.
    """
    sharded, whole = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local") and all(pl.is_shard() for pl in g.placements):
            sharded.append(g)
        else:
            whole.append(g)
    squares = _squares(whole)
    if sharded:
        mine = torch.tensor([_squares([g.to_local() for g in sharded])], dtype=torch.float64)
        squares += float(across(mine)[0])
    norm = math.sqrt(squares)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in sharded + whole:
            g.mul_(scale)
    return norm
