"""The published policy state: export, exact load, bytes, digests, and bit views.

A *state* is ``dict[str, torch.Tensor]`` of contiguous CPU tensors: what the learner publishes as a
version, what a patch transforms, and what a node loads. Its identity is :func:`state_digest`, a
sha256 over names, dtypes, shapes and the raw stored bytes of every tensor, so two machines agree
on "the same weights" bit for bit (bfloat16 included), whatever engine they run.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Unsigned integer views by item size: a patch compares and replaces bit patterns, not floats.
_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TensorMeta(NamedTuple):
    """What :func:`from_bits` needs to rebuild a tensor: torch dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling used in digests and metadata."""
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def export_state(model: torch.nn.Module, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The model's weights as a state: floating tensors cast to ``dtype``, others kept as they are.

    Tied parameters (one tensor under two names, e.g. embeddings and LM head) appear once, under the
    first name in ``state_dict`` order; names are sorted so the order never depends on the model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    target = DTYPES[dtype]
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            src = t.detach()
            out_t = src.to("cpu", dtype=target) if src.is_floating_point() else src.to("cpu")
            out_t = out_t.contiguous()
            # The state must not alias live parameters that the optimizer keeps changing.
            if out_t.data_ptr() == src.data_ptr():
                out_t = out_t.clone()
            out[name] = out_t
    return dict(sorted(out.items()))


def state_meta(state: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    """Name -> (dtype, shape) of every tensor."""
    return {n: TensorMeta(dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}


def load_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` exactly (casting to the model's dtype where they differ).

    The names must be exactly those :func:`export_state` gives for this model and every shape must
    match; otherwise ValueError names the first bad tensor and the model is left unchanged.
    """
    params = model.state_dict(keep_vars=True)
    expected: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in params.items():
        if id(t) not in seen:
            seen.add(id(t))
            expected[name] = t
    for name in sorted(expected):
        if name not in state:
            raise ValueError(f"state is missing tensor {name!r}")
    for name in state:
        if name not in expected:
            raise ValueError(f"state has unexpected tensor {name!r}")
        if tuple(state[name].shape) != tuple(expected[name].shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(state[name].shape)}, "
                f"the model expects {tuple(expected[name].shape)}"
            )
        if state[name].is_floating_point() != expected[name].is_floating_point():
            raise ValueError(
                f"tensor {name!r} has dtype {state[name].dtype}, "
                f"the model holds {expected[name].dtype}"
            )
    with torch.no_grad():
        for name, src in state.items():
            expected[name].copy_(src)


def state_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors serialisation (deterministic for a given state)."""
    from safetensors.torch import save

    return save({n: t.contiguous() for n, t in state.items()})


def state_from_bytes(data: bytes, *, max_tensors: int = 4096) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes from an untrusted source.

    The header is checked (size, JSON, tensor count) before any tensor is allocated; every problem
    raises ValueError.
    """
    if len(data) < 8:
        raise ValueError("safetensors data shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError(f"safetensors header length {header_len} exceeds the data")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    count = sum(1 for k in header if k != "__metadata__")
    if count > max_tensors:
        raise ValueError(f"safetensors data holds {count} tensors, more than {max_tensors}")
    from safetensors.torch import load

    try:
        return load(bytes(data))
    except Exception as e:  # safetensors raises its own error type (and others) on bad data
        raise ValueError(f"bad safetensors data: {e}") from None


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The stored bytes of ``t`` (native little-endian), as a flat uint8 array without copying
    when ``t`` is already contiguous on the CPU."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 hex of the raw stored bytes (so bfloat16 and float32 of equal values differ)."""
    return hashlib.sha256(_raw_bytes(t).data).hexdigest()


def state_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Name -> :func:`tensor_digest`, in sorted name order."""
    return {n: tensor_digest(state[n]) for n in sorted(state)}


def digest_entries(meta: Mapping[str, TensorMeta], digests: Mapping[str, str]) -> str:
    """:func:`state_digest` from metadata and per-tensor digests alone (e.g. from a manifest)."""
    if set(meta) != set(digests):
        raise ValueError("metadata and digests name different tensors")
    entries = [[n, meta[n].dtype, list(meta[n].shape), digests[n]] for n in sorted(meta)]
    # JSON of a list is unambiguous however names look, unlike joining strings.
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The identity of a state: sha256 over sorted (name, dtype, shape, tensor digest)."""
    return digest_entries(state_meta(state), state_digests(state))


def to_bits(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Flat unsigned-integer views of every tensor's bits (uint16 for bf16/f16, uint32 for f32).

    The arrays are copies, safe to modify.
    """
    out: dict[str, np.ndarray] = {}
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous().reshape(-1)
        size = t.element_size()
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        out[name] = t.view(_TORCH_INT_BY_SIZE[size]).numpy().view(_UINT_BY_SIZE[size]).copy()
    return out


def from_bits(
    bits: Mapping[str, np.ndarray],
    like: Mapping[str, torch.Tensor] | Mapping[str, TensorMeta],
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_bits`: tensors with the dtypes and shapes of ``like`` (a state or
    :func:`state_meta`). Raises ValueError on missing/extra names or wrong sizes."""
    meta = {
        n: (state_meta({n: m})[n] if isinstance(m, torch.Tensor) else TensorMeta(*m))
        for n, m in like.items()
    }
    if set(bits) != set(meta):
        missing = sorted(set(meta) - set(bits))
        extra = sorted(set(bits) - set(meta))
        raise ValueError(f"bit arrays do not match the state: missing {missing}, extra {extra}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(meta):
        dtype = _torch_dtype(meta[name].dtype)
        shape = tuple(meta[name].shape)
        size = torch.empty((), dtype=dtype).element_size()
        arr = np.ascontiguousarray(bits[name]).reshape(-1)
        if arr.dtype != _UINT_BY_SIZE[size]:
            raise ValueError(
                f"tensor {name!r}: bits are {arr.dtype}, expected {np.dtype(_UINT_BY_SIZE[size])}"
            )
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"tensor {name!r}: {arr.size} values for shape {shape}")
        t = torch.from_numpy(arr.view(np.dtype(f"int{size * 8}")).copy())
        t = t.to(torch.bool) if dtype == torch.bool else t.view(dtype)
        out[name] = t.reshape(shape)
    return out
