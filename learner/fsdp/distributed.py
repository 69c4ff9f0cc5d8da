"""The FSDP2 learner's process group: joining it, sharding a model over it, and talking across it.

A learner with ``backend = "fsdp2"`` runs as several ranks started by ``torch.distributed.run``
(torchrun), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address in each
process's environment. :func:`init` joins the default process group (NCCL on CUDA, gloo on the
CPU) and opens a second, gloo-only group for the small host-side messages the ranks exchange
(commands from rank 0, verdicts, metrics): those are bytes on the CPU whatever the device, and
the command group waits as long as a learner may wait for rollouts (:data:`COMMAND_TIMEOUT`).

:func:`shard_model` applies ``fully_shard`` to every decoder layer and then the root, with bf16
parameters and fp32 gradient reduction where the device computes in bf16 (:func:`mixed_precision`).
Everything here is PyTorch's own machinery; nothing is a collective of our own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from echo.learner.algorithm.grpo import shares

# Followers wait on the command group while rank 0 waits for rollouts, which may take long on
# a quiet swarm; a rank that dies is noticed by torchrun (it ends the others), not by this.
COMMAND_TIMEOUT = timedelta(days=7)
# Collectives of the step itself: generous for a slow first step of a big model.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# The longest message one rank sends another (a batch of groups is well under it).
MAX_MESSAGE_BYTES = 1 << 30


@dataclass
class Dist:
    """This process's place in the learner's process group."""

    rank: int
    world: int
    device: torch.device
    commands: dist.ProcessGroup  # gloo, for host-side bytes
    # ``[learner] activation_checkpointing``: the policy's decoder layers recompute their
    # activations in the backward (see :func:`recompute_in_backward`).
    checkpoint_layers: bool = False

    @property
    def leader(self) -> bool:
        """Rank 0: the one that talks to the coordinator, publishes and commits checkpoints."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether this process's environment names its rank and the group's size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: torch.device, checkpoint_layers: bool = False) -> Dist:
    """Join the process group torchrun set up; ``device`` is the one the learner resolved
    (``cuda`` becomes ``cuda:LOCAL_RANK``); ``checkpoint_layers``: see :class:`Dist`.

    :raises ValueError: not started by torchrun (a restart cannot help).
    :raises RuntimeError: the rendezvous failed.
    """
    if not launched_by_torchrun():
        raise ValueError(
            "backend fsdp2 runs under torchrun (python -m torch.distributed.run); "
            "RANK and WORLD_SIZE are not set"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT, device_id=_device_id(device))
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return Dist(dist.get_rank(), dist.get_world_size(), device, commands, checkpoint_layers)


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def close() -> None:
    """Leave the process group (each rank, once its work is done)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 parameters with fp32 gradient reduction on a device that computes in bf16 (a CUDA
    GPU that supports it); None elsewhere: the CPU computes in fp32, exactly as the single
    learner does."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers`` of a Hugging Face causal LM).

    :raises ValueError: the model has no such list.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.layers to shard")
    return list(layers)


def recompute_in_backward(layer: torch.nn.Module) -> None:
    """Make ``layer`` keep only its inputs in a forward with grad, and recompute its
    activations in the backward (``torch.utils.checkpoint``, non-reentrant): memory for time.

    Its ``forward`` is wrapped in place rather than the module wrapped in another, so parameter
    names, state dicts and checkpoints stay those of the plain model. A no-grad forward
    (re-scoring, evaluation) runs as before.
    """
    forward = layer.forward

    def forward_recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # A training forward keeps no KV cache (its output is only the logits): a cache that
        # the recomputation appended to a second time would give it other shapes.
        if "cache" in kwargs:
            kwargs["cache"], kwargs["use_cache"] = None, False
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = forward_recomputed


def shard_model(
    model: torch.nn.Module,
    policy: MixedPrecisionPolicy | None = None,
    checkpoint_layers: bool = False,
) -> torch.nn.Module:
    """``model`` sharded in place over the default process group: ``fully_shard`` per decoder
    layer (each is gathered only while it computes), then the root (embeddings, final norm and
    LM head). Gradients are summed, not averaged, across ranks: the step divides its loss by
    the token count of the whole batch (see :class:`~echo.learner.algorithm.grpo.GRPOLearner`). With
    ``checkpoint_layers`` each layer recomputes its activations in the backward
    (:func:`recompute_in_backward`; FSDP gathers the layer's weights again for it)."""
    kw = {"mp_policy": policy} if policy is not None else {}
    layers = decoder_layers(model)
    for layer in layers:
        if checkpoint_layers:
            recompute_in_backward(layer)
        fully_shard(layer, **kw)
    # The root too gives its weights back after each forward: left gathered (the default) it
    # holds plain tensors that loading a state or a no-grad forward then trips over.
    fully_shard(model, reshard_after_forward=True, **kw)
    for module in [*layers, model]:  # each FSDP module reduces its own parameters' gradients
        module.set_gradient_divide_factor(1.0)
        # A plain SUM: gloo has no pre-multiplied sum, and a factor of 1 needs no scaling.
        module.set_force_sum_reduction_for_comms(True)
    return model


# ---------------------------------------------------------------------- host-side messages


def broadcast_bytes(d: Dist, data: bytes | None) -> bytes:
    """``data`` from rank 0 to every rank (others pass None). Length first, then the bytes."""
    size = torch.tensor([len(data) if d.leader and data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=d.commands)
    n = int(size.item())
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise RuntimeError(f"a message of {n} bytes from rank 0 is over the limit")
    if d.leader:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=0, group=d.commands)
    return bytes(buf.numpy().tobytes()) if n else b""


def all_gather_bytes(d: Dist, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(d.world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=d.commands)
    lengths = [int(s.item()) for s in sizes]
    if any(not 0 <= n <= MAX_MESSAGE_BYTES for n in lengths):
        raise RuntimeError(f"a gathered message is over the limit: {lengths}")
    width = max(max(lengths), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(d.world)]
    dist.all_gather(out, mine, group=d.commands)
    return [bytes(t[:n].numpy().tobytes()) for t, n in zip(out, lengths, strict=True)]


def all_sum(d: Dist, values: torch.Tensor) -> torch.Tensor:
    """``values`` (float64, on the CPU) summed over the ranks: the step's metrics and token
    counts, which are sums over each rank's share of the batch."""
    out = values.detach().to("cpu", torch.float64).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=d.commands)
    return out


def share(n: int, rank: int, world: int) -> range:
    """The indices of ``n`` items (groups) that ``rank`` of ``world`` takes: contiguous, sizes
    differing by at most one, the larger shares first (:func:`~echo.learner.algorithm.grpo.shares`,
    the split a single learner's step with ``parts = world`` computes in)."""
    return shares(n, world)[rank]
