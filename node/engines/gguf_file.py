"""A GGUF file we wrote: its tensor table, its tensors' bits, patched in place and read back.

:class:`GGUFFile` remembers where each tensor's bytes start in the file, so a new version is
applied by comparing the new bits with the file's and writing only the elements that changed
(:meth:`GGUFFile.update`, through ``numpy.memmap``), and :meth:`GGUFFile.read_state` rebuilds the
state from the file's bytes (undoing the Q/K permutation of :mod:`echo.node.engines.gguf_layout`)
so its digest is that of what llama.cpp maps, not of what we meant to write. F32 holds every
F16/BF16 value exactly, and reading back checks that it still does.

Gemma's norm weights are stored as ``w + 1`` (float32), which is not invertible bit for bit (two
``w`` may round to one sum). For those small 1-D tensors the file keeps the published ``w`` in
memory and :meth:`GGUFFile.read_state` returns it only if the file's bits are exactly
``w + 1``; otherwise it returns the stored sums, so a wrong write still changes the digest.

:func:`file_bits` / :func:`tensor_from_bits` convert between a state tensor and its bits in the
file; :func:`read_tensor_infos` parses the tensor table of a file (never trusting a length).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo.models.weights import dtype_name
from echo.node.engines.gguf_layout import GGUFLayout, TensorSlot, storage_dtype

_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Bit views: patches compare and write bit patterns (so -0.0 and NaNs are exact too).
_UINT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_TORCH_INT = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}

# Elements compared and written per step by GGUFFile.update (bounds its temporary memory).
UPDATE_CHUNK = 1 << 22

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# Limits on what read_tensor_infos accepts: it parses files we wrote, but never trusts a length.
_MAX_TENSORS = 1 << 16
_MAX_KV = 1 << 16
_MAX_STRING = 1 << 20


# ------------------------------------------------------------------------------ tensors <-> bits


def _bits_of(t: torch.Tensor) -> np.ndarray:
    """The raw bits of ``t`` as a flat unsigned-int array (no copy for a contiguous CPU tensor)."""
    name = dtype_name(t.dtype)
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(_TORCH_INT[name]).numpy().view(_UINT[name])


def convert_bits(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``bits`` of dtype ``src`` as bits of dtype ``dst`` (the value cast, round to nearest even).

    Widening to float32 is done on the bits (exact, and faster than a float cast); narrowing goes
    through torch's cast. Returns ``bits`` itself when ``src == dst``.
    """
    if src == dst:
        return bits
    if src == "bfloat16" and dst == "float32":
        return bits.astype(np.uint32) << 16  # a bf16 is the top half of its float32
    if src == "float16" and dst == "float32":
        return bits.view(np.float16).astype(np.float32).view(np.uint32)
    if not bits.flags.writeable:  # torch.from_numpy wants writable memory (a read-only map)
        bits = bits.copy()
    size = np.dtype(_UINT[src]).itemsize
    t = torch.from_numpy(bits.view(np.dtype(f"int{size * 8}"))).view(_TORCH_DTYPE[src])
    return t.to(_TORCH_DTYPE[dst]).view(_TORCH_INT[dst]).numpy().view(_UINT[dst])


def _exact_narrowing(bits: np.ndarray, src: str, dst: str) -> np.ndarray | None:
    """``bits`` (dtype ``src``) as ``dst`` bits if every value survives the cast exactly, else
    None (how read-back detects stored values that are not representable as published)."""
    if src == "float32" and dst == "bfloat16":
        if np.any(bits & np.uint32(0xFFFF)):
            return None
        return (bits >> 16).astype(np.uint16)
    out = convert_bits(bits, src, dst)
    return out if np.array_equal(convert_bits(out, dst, src), bits) else None


def _permute_bits(bits: np.ndarray, slot: TensorSlot, inverse: bool = False) -> np.ndarray:
    """Apply (or with ``inverse`` undo) the Q/K row permutation of ``slot`` to flat row-major
    ``bits``: the official converter's permute(), rotate-half halves -> adjacent pairs."""
    if slot.permute_heads is None:
        return bits
    n = slot.permute_heads
    rows, rest = slot.shape[0], slot.shape[1:]
    split = (n, rows // n // 2, 2) if inverse else (n, 2, rows // n // 2)
    return np.ascontiguousarray(bits.reshape(*split, *rest).swapaxes(1, 2)).reshape(-1)


def file_bits(t: torch.Tensor, slot: TensorSlot, file_dtype: str) -> np.ndarray:
    """The flat bit pattern (unsigned ints) ``t`` has in the file: shifted, permuted, cast,
    row-major. A shifted slot is computed as transformers does it, ``w.float() + shift``, and
    must be stored as float32 (ValueError otherwise).

    May share memory with ``t`` (same dtype, not permuted): treat it as read-only."""
    if slot.shift:
        if file_dtype != "float32":
            raise ValueError(f"shifted tensor {slot.gguf_name!r} must be stored as float32")
        shifted = t.detach().to("cpu", torch.float32) + slot.shift
        return _permute_bits(_bits_of(shifted), slot)
    bits = _permute_bits(_bits_of(t), slot)
    return convert_bits(bits, dtype_name(t.dtype), file_dtype)


def tensor_from_bits(bits: np.ndarray, slot: TensorSlot, dtype: str) -> torch.Tensor:
    """Inverse of :func:`file_bits` without the cast: flat file ``bits`` of ``dtype`` as a new
    tensor of that dtype with the state's shape, unpermuted."""
    flat = _permute_bits(np.asarray(bits), slot, inverse=True)
    size = np.dtype(_UINT[dtype]).itemsize
    signed = np.array(flat, copy=True).view(np.dtype(f"int{size * 8}"))
    return torch.from_numpy(signed).view(_TORCH_DTYPE[dtype]).reshape(slot.shape)


# ---------------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ggml dims (innermost first), ggml type, absolute byte offset."""

    dims: tuple[int, ...]
    ggml_type: int
    offset: int


def read_tensor_infos(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse a GGUF file's header, skip its metadata and return its tensor table with absolute
    data offsets. Raises ValueError on anything that is not a well-formed little-endian GGUF v2/v3
    (every count and length is bounded before it is used)."""
    with open(path, "rb") as f:
        data = f.read(24)
        if len(data) < 24 or data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", data[4:])
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise ValueError(f"{path}: {n_tensors} tensors / {n_kv} keys exceed the limits")
        reader = _Reader(f)
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = reader.string()
            vtype = reader.unpack("<I")
            value = reader.value(vtype)
            if key == "general.alignment":
                if not isinstance(value, int) or value <= 0 or value & (value - 1):
                    raise ValueError(f"{path}: bad general.alignment {value!r}")
                alignment = value
        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for _ in range(n_tensors):
            name = reader.string()
            n_dims = reader.unpack("<I")
            if not 1 <= n_dims <= 4:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(reader.unpack("<Q") for _ in range(n_dims))
            ggml_type, rel = reader.unpack("<I"), reader.unpack("<Q")
            infos[name] = (dims, ggml_type, rel)
        start = -(-f.tell() // alignment) * alignment
    return {n: TensorInfo(d, t, start + rel) for n, (d, t, rel) in infos.items()}


class _Reader:
    """Little-endian GGUF metadata reader over a file object (values it skips are discarded)."""

    _SCALARS = {
        0: "<B",
        1: "<b",
        2: "<H",
        3: "<h",
        4: "<I",
        5: "<i",
        6: "<f",
        7: "<?",
        10: "<Q",
        11: "<q",
        12: "<d",
    }

    def __init__(self, f: Any) -> None:
        self.f = f

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("GGUF file ends inside its header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise ValueError(f"GGUF string of {n} bytes exceeds the limit")
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("GGUF file ends inside a string")
        return data.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in self._SCALARS:
            return self.unpack(self._SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            sub, count = self.unpack("<I"), self.unpack("<Q")
            if count > 1 << 26:
                raise ValueError(f"GGUF array of {count} items exceeds the limit")
            if sub in self._SCALARS:
                size = struct.calcsize(self._SCALARS[sub]) * count
                self.f.seek(size, os.SEEK_CUR)  # arrays are only skipped
                return None
            for _ in range(count):
                self.value(sub)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")


@dataclass(frozen=True)
class Entry:
    """A state tensor's place in the file."""

    slot: TensorSlot
    file_dtype: str
    offset: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(_UINT[self.file_dtype]).itemsize


@dataclass
class UpdateStats:
    """What :meth:`GGUFFile.update` wrote: changed elements, their bytes, tensors touched."""

    changed: int = 0
    bytes_written: int = 0
    tensors: int = 0


class GGUFFile:
    """A GGUF written by :func:`write_gguf`: the path, the model layout, each state tensor's
    :class:`Entry`, and the dtype each tensor was published in (what digests are computed in)."""

    def __init__(
        self,
        path: Path,
        layout: GGUFLayout,
        entries: dict[str, Entry],
        published: dict[str, str],
        override: str | None,
        state: Mapping[str, torch.Tensor],
    ) -> None:
        self.path = path
        self.layout = layout
        self.entries = entries
        self.published = published
        self.override = override
        self._unshifted: dict[str, torch.Tensor] = {}
        self._remember_unshifted(state)

    def _remember_unshifted(self, state: Mapping[str, torch.Tensor]) -> None:
        """Keep a copy of the published values of shifted tensors (see the module docstring)."""
        for name, e in self.entries.items():
            if e.slot.shift:
                self._unshifted[name] = state[name].detach().to("cpu").clone()

    def fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``state`` (already checked against the layout) can be written in place: every
        tensor would be stored in the dtype the file already holds it in."""
        if set(state) != set(self.entries):
            return False
        return all(
            storage_dtype(dtype_name(t.dtype), t.dim(), self.override) == self.entries[n].file_dtype
            for n, t in state.items()
        )

    def update(self, state: Mapping[str, torch.Tensor]) -> UpdateStats:
        """Write into the file only the elements of ``state`` whose bits differ from the file's.

        ``state`` must satisfy :meth:`fits` (ValueError otherwise). Tensors are compared in
        chunks of ``UPDATE_CHUNK`` elements, so the temporary memory stays small however large
        the embedding. Nothing is re-read here to confirm the write: :meth:`read_state` (the
        engine's digest) reads the file back and catches a wrong one.
        """
        if not self.fits(state):
            raise ValueError("state does not fit this GGUF file's layout; rewrite it instead")
        stats = UpdateStats()
        mm = np.memmap(self.path, dtype=np.uint8, mode="r+")
        try:
            for name in sorted(state):
                e = self.entries[name]
                if e.slot.shift:
                    changed = _update_whole(mm, e, file_bits(state[name], e.slot, e.file_dtype))
                    if changed:
                        stats.changed += changed
                        stats.bytes_written += changed * np.dtype(_UINT[e.file_dtype]).itemsize
                        stats.tensors += 1
                    continue
                src_dtype = dtype_name(state[name].dtype)
                src = _permute_bits(_bits_of(state[name]), e.slot)
                view = mm[e.offset : e.offset + e.nbytes].view(_UINT[e.file_dtype])
                changed = 0
                for lo in range(0, e.count, UPDATE_CHUNK):
                    hi = min(lo + UPDATE_CHUNK, e.count)
                    new = convert_bits(src[lo:hi], src_dtype, e.file_dtype)
                    dst = view[lo:hi]
                    diff = dst != new
                    n = int(np.count_nonzero(diff))
                    if n:
                        # Masked copy: pages without a changed element are never written.
                        np.copyto(dst, new, where=diff)
                        changed += n
                if changed:
                    stats.changed += changed
                    stats.bytes_written += changed * view.itemsize
                    stats.tensors += 1
            # No msync: llama.cpp maps the same page cache, so the bytes are visible to it now.
        finally:
            del mm
        self.published = {n: dtype_name(t.dtype) for n, t in state.items()}
        self._remember_unshifted(state)
        return stats

    def read_state(self) -> dict[str, torch.Tensor]:
        """The state as the file holds it: each tensor unpermuted and in its published dtype.

        A tensor whose stored values do not survive the cast to the published dtype exactly is
        returned in the stored dtype, so its digest differs from the learner's rather than
        hiding the difference.
        """
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        out: dict[str, torch.Tensor] = {}
        try:
            for name in sorted(self.entries):
                e = self.entries[name]
                bits = mm[e.offset : e.offset + e.nbytes].view(_UINT[e.file_dtype])
                want = self.published[name]
                if e.slot.shift:
                    kept = self._unshifted[name]
                    if np.array_equal(np.asarray(bits), file_bits(kept, e.slot, e.file_dtype)):
                        out[name] = kept.clone()
                        continue
                    # Not what the published values map to: the stored sums, visibly different.
                    out[name] = tensor_from_bits(bits, e.slot, e.file_dtype)
                    continue
                if want != e.file_dtype:
                    narrow = _exact_narrowing(np.asarray(bits), e.file_dtype, want)
                    if narrow is not None:
                        out[name] = tensor_from_bits(narrow, e.slot, want)
                        continue
                out[name] = tensor_from_bits(bits, e.slot, e.file_dtype)
        finally:
            del mm
        return out


def _update_whole(mm: np.memmap, e: Entry, new: np.ndarray) -> int:
    """Write the elements of ``new`` (the entry's whole file bits) that differ from the file's;
    return how many did."""
    view = mm[e.offset : e.offset + e.nbytes].view(_UINT[e.file_dtype])
    diff = view != new
    n = int(np.count_nonzero(diff))
    if n:
        np.copyto(view, new, where=diff)
    return n
