"""The weight patch encoder: :func:`encode_patch` turns two states into a patch.

This module owns the encoder's choices: per tensor a position coding (ALL, BITMAP for dense
changes, GAPS for sparse ones, whose byte-sized quotients zstd entropy-codes well) and a value
coding: NEW (the new bits) or DIFF (RL steps move most changed bf16 values by one unit in the
last place, so a sign bit, a "moved further" bit and the rare larger distances cost about 2 bits
per change, against about 11 for the new bits). It picks from cheap entropy estimates and, for
bitmap against gaps, a small trial compression, then writes the layout of
:mod:`echo.protocol.patch.format`. The decoder needs none of this: it reads whatever codings
the table names.

Errors: ``ValueError`` for arguments it cannot encode (see :func:`encode_patch`), nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import zstandard

from echo.protocol.patch.format import (
    ESCAPE,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    MAX_NAME_BYTES,
    MAX_PATCH_TENSORS,
    MAX_TENSOR_ELEMENTS,
    METHOD_STORED,
    METHOD_ZSTD,
    N_STREAMS,
    POS_ALL,
    POS_BITMAP,
    POS_GAPS,
    POS_NONE,
    STREAM_ENTRY,
    VAL_DIFF,
    VAL_NEW,
    Stream,
    TensorEntry,
    bits_view,
    pack_low_bits,
)

# Escaped gaps cost about this many bits once zstd has squeezed the u64's zero bytes.
_ESCAPE_BITS = 40
# The GAPS parameter L is chosen so the mean quotient is about this: large enough that the
# quotient bytes carry ~6 bits (zstd's literal coder is near entropy there, while very skewed
# small alphabets lose to spurious matches), small enough that escapes are rare.
_TARGET_QUOTIENT = 32
# Below this density a bitmap (>= 1 bit per element) never beats gap coding; above it we compare.
_BITMAP_MIN_DENSITY = 1 / 16
# Between bitmap and gaps the encoder compresses both for the first this-many elements and keeps
# the smaller: entropy estimates mislead there (zstd loses 10-25% on the skewed small alphabets
# of dense gaps and bitmaps alike), and 2**20 elements cost 1-5 ms to try.
_TRIAL_ELEMENTS = 1 << 20
# Coding choices are estimated on at most this many strided samples per tensor.
_SAMPLE = 1 << 18
# Elements compared per step when diffing: bounds the temporary mask and keeps it in cache.
_DIFF_CHUNK = 1 << 18


def _entropy_bits(x: np.ndarray) -> float:
    """Estimated bits to entropy-code the byte array ``x`` (order 0, from a strided sample)."""
    if x.size == 0:
        return 0.0
    s = x[:: max(1, x.size // _SAMPLE)]
    counts = np.bincount(s, minlength=256)
    p = counts[counts > 0] / s.size
    return float(-(p * np.log2(p)).sum()) * x.size


def _planes(values: np.ndarray) -> np.ndarray:
    """Return the (width, n) byte planes of little-endian unsigned ``values``."""
    w = values.dtype.itemsize
    return np.ascontiguousarray(np.ascontiguousarray(values).view(np.uint8).reshape(-1, w).T)


@dataclass
class _Planned:
    """One tensor's table entry and its segments of each stream."""

    entry: TensorEntry
    segments: dict[int, np.ndarray] = field(default_factory=dict)


def _changed_positions(o: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where ``o`` and ``n`` differ (compared in cache-sized chunks)."""
    parts = []
    for i in range(0, o.size, _DIFF_CHUNK):
        p = np.flatnonzero(o[i : i + _DIFF_CHUNK] != n[i : i + _DIFF_CHUNK])
        if p.size:
            parts.append(p + i)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _gap_split(s: np.ndarray, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Quotient bytes (255 = escape) and the escape mask of gaps ``s`` for parameter ``shift``."""
    q = s >> np.uint64(shift)
    esc = q >= ESCAPE
    return np.where(esc, ESCAPE, q).astype(np.uint8), esc


def _plan_gaps(pos: np.ndarray, numel: int) -> tuple[int, np.ndarray]:
    """Pick the GAPS parameter for ``pos``: return it and the gaps as uint64."""
    m = pos.size
    s = np.empty(m, np.uint64)
    s[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=s[1:], casting="unsafe")
    s[1:] -= np.uint64(1)
    mean = numel / m
    centre = max(0, round(math.log2(mean / _TARGET_QUOTIENT))) if mean > _TARGET_QUOTIENT else 0
    sample = s[:: max(1, m // _SAMPLE)]
    scale = m / sample.size
    best: tuple[float, int] | None = None
    for shift in range(max(0, centre - 1), centre + 2):
        q, esc = _gap_split(sample, shift)
        cost = m * shift + _entropy_bits(q) * scale + int(esc.sum()) * scale * _ESCAPE_BITS
        if best is None or cost < best[0]:
            best = (cost, shift)
    assert best is not None
    return best[1], s


def _plan_values(ov: np.ndarray, nv: np.ndarray) -> tuple[int, dict[int, np.ndarray]]:
    """Pick NEW or DIFF for changed values ``ov`` -> ``nv``; return the coding and its segments."""
    step = max(1, ov.size // _SAMPLE)
    so, sn = ov[::step], nv[::step]
    scale = ov.size / so.size
    new_cost = sum(_entropy_bits(p) for p in _planes(sn)) * scale
    neg, big, rest = _split_diff(so, sn)
    p_big = big.mean()
    big_bits = (
        -(p_big * math.log2(p_big) + (1 - p_big) * math.log2(1 - p_big)) if 0 < p_big < 1 else 0
    )
    diff_cost = ov.size * (1 + big_bits) + sum(_entropy_bits(p) for p in _planes(rest)) * scale
    if new_cost <= diff_cost:
        return VAL_NEW, {Stream.PLANE0 + k: p for k, p in enumerate(_planes(nv))}
    neg, big, rest = _split_diff(ov, nv)
    segs = {Stream.PLANE0 + k: p for k, p in enumerate(_planes(rest))}
    segs[Stream.SIGN] = np.packbits(neg, bitorder="little")
    segs[Stream.BIG] = np.packbits(big, bitorder="little")
    return VAL_DIFF, segs


def _split_diff(ov: np.ndarray, nv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DIFF parts of changed values: sign, ``|d| > 1`` flags, and ``|d| - 2`` where flagged.

    ``d = nv - ov`` modulo 2**bits, read as a signed integer, so the coding is exact for any bits.
    """
    d = nv - ov
    neg = d.view(d.dtype.str.replace("u", "i")) < 0
    mag = np.where(neg, -d, d)
    big = mag > 1
    return neg, big, mag[big] - d.dtype.type(2)


def _bitmap_wins(
    pos: np.ndarray, numel: int, s: np.ndarray, shift: int, cctx: zstandard.ZstdCompressor
) -> bool:
    """Whether a bitmap compresses smaller than gaps over the tensor's first elements."""
    region = min(numel, _TRIAL_ELEMENTS)
    k = int(np.searchsorted(pos, region))
    if k == 0:
        return False
    mask = np.zeros(region, bool)
    mask[pos[:k]] = True
    bitmap_bytes = len(cctx.compress(np.packbits(mask, bitorder="little").data))
    q, esc = _gap_split(s[:k], shift)
    gap_bytes = len(cctx.compress(q.data)) + k * shift / 8 + int(esc.sum()) * _ESCAPE_BITS / 8
    return bitmap_bytes < gap_bytes


def _plan_tensor(
    name: str, o: np.ndarray, n: np.ndarray, width: int, cctx: zstandard.ZstdCompressor
) -> _Planned:
    """Choose codings for one tensor and build its stream segments."""
    numel = o.size
    pos = _changed_positions(o, n)
    m = pos.size
    e = TensorEntry(name, width, POS_NONE, VAL_NEW, 0, numel, m)
    plan = _Planned(e)
    if m == 0:
        return plan
    if m == numel:
        e.pos = POS_ALL
        e.val, plan.segments = _plan_values(o, n)
        return plan
    shift, s = _plan_gaps(pos, numel)
    bitmap = None
    if m >= numel * _BITMAP_MIN_DENSITY and _bitmap_wins(pos, numel, s, shift, cctx):
        mask = np.zeros(numel, bool)
        mask[pos] = True
        bitmap = np.packbits(mask, bitorder="little")
    if bitmap is not None:
        e.pos = POS_BITMAP
        plan.segments[Stream.BITMAP] = bitmap
    else:
        e.pos, e.param = POS_GAPS, shift
        q, esc = _gap_split(s, shift)
        plan.segments[Stream.GAP_Q] = q
        plan.segments[Stream.GAP_R] = pack_low_bits(s, shift)
        if esc.any():
            plan.segments[Stream.GAP_X] = s[esc].astype("<u8").view(np.uint8)
    e.val, segs = _plan_values(o[pos], n[pos])
    plan.segments.update(segs)
    return plan


def encode_patch(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], *, level: int = 3
) -> bytes:
    """Encode the change from ``old`` to ``new`` as a patch (see the module docstring).

    Both mappings must hold the same names, each a 1-D bit view of the same dtype and size.
    Tensors are written in ``old``'s iteration order. ``level`` is the zstd level.

    :raises ValueError: if the names, dtypes or sizes differ, an array is not a supported 1-D bit
        view, a name is too long, or a count exceeds this module's limits.
    """
    if set(old) != set(new):
        missing = sorted(set(old) ^ set(new))[:5]
        raise ValueError(f"old and new must hold the same tensor names; differing: {missing}")
    if len(old) > MAX_PATCH_TENSORS:
        raise ValueError(f"{len(old)} tensors exceed the limit of {MAX_PATCH_TENSORS}")
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    plans = []
    for name, a in old.items():
        if not isinstance(name, str) or not 0 < len(name.encode()) <= MAX_NAME_BYTES:
            raise ValueError(f"tensor name {name!r} must be a str of 1..{MAX_NAME_BYTES} bytes")
        o, width = bits_view(name, a)
        b = new[name]
        n, _ = bits_view(name, b)
        if a.dtype != b.dtype or o.size != n.size:
            raise ValueError(
                f"tensor {name!r}: old is {a.dtype}[{o.size}], new is {b.dtype}[{n.size}]"
            )
        if o.size > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"tensor {name!r}: {o.size} elements exceed {MAX_TENSOR_ELEMENTS}")
        plans.append(_plan_tensor(name, o, n, width, cctx))

    head = [HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(plans))]
    head += [p.entry.to_bytes() for p in plans]
    bodies = []
    for sid in range(N_STREAMS):
        segs = [p.segments[sid] for p in plans if sid in p.segments]
        raw = np.concatenate(segs) if segs else np.zeros(0, np.uint8)
        body = cctx.compress(raw.data) if raw.size else b""
        method = METHOD_ZSTD if len(body) < raw.size else METHOD_STORED
        if method == METHOD_STORED:
            body = raw.tobytes()
        head.append(STREAM_ENTRY.pack(method, raw.size, len(body)))
        bodies.append(body)
    return b"".join(head + bodies)
