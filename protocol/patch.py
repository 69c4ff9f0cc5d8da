"""Lossless sparse weight patches: the bits that changed between two policy versions.

A patch turns version v into v+1 exactly. Per tensor it holds *which* positions' stored bits
changed and *what* they changed to; applying it reproduces the new bits bit for bit. There are no
float deltas: the optional difference coding (``DIFF``) is a modular integer difference of the
stored bit patterns, which is exact and cannot drift.

The codec works on 1-D unsigned bit views (``uint16`` for bf16/fp16, ``uint32`` for fp32; the
signed ``int16``/``int32`` views that ``torch.Tensor.view`` produces are accepted too), so it needs
no torch.

Wire format, version 1 (all integers little-endian)::

    header   magic b"ECHP" | u16 format version | u16 flags (0) | u32 tensor count
    table    per tensor: u16 name length | UTF-8 name | u8 width (2 or 4 bytes per element)
             | u8 position coding | u8 value coding | u8 parameter | u64 elements | u64 changed
    streams  per stream (10, in the order below): u8 method (0 stored, 1 zstd) | u64 raw length
             | u64 stored length
    payload  the stored bytes of each stream, in order, and nothing after them

Each stream concatenates one kind of data over all tensors (in table order), so zstd sees
homogeneous bytes and tiny tensors cost no frame overhead:

    bitmap   BITMAP tensors: the change mask, 1 bit per element, LSB first, padded to a byte
    gap_q    GAPS tensors: per change ``min(s >> L, 255)`` where ``s`` is the number of unchanged
             elements skipped before it and ``L`` the tensor's parameter
    gap_r    GAPS tensors: the low ``L`` bits of every ``s``, bit-packed, padded per tensor
    gap_x    GAPS tensors: ``s`` as u64 for every change whose ``gap_q`` byte is 255 (escape)
    sign     DIFF tensors: 1 bit per change, set when the new bits are below the old ones
    big      DIFF tensors: 1 bit per change, set when the bits moved by more than 1
    plane0-3 byte k of each value: the new bits of every change (NEW), or ``|new - old| - 2``
             of every ``big`` change (DIFF; differences are taken modulo 2**bits as signed
             integers); 16-bit tensors use planes 0-1, 32-bit tensors planes 0-3

Position codings: NONE (nothing changed), ALL (every element changed: values only), BITMAP
(dense changes) and GAPS (sparse changes: a Rice-like split of the gaps into a byte-sized
quotient, which zstd entropy-codes well, and uniform low bits, which are stored packed). Value
codings: NEW (the new bits) and DIFF (RL steps move most changed bf16 values by one unit in the
last place, so a sign bit, a "moved further" bit and the rare larger distances cost about 2 bits
per change, against about 11 for the new bits). The encoder picks per tensor from cheap entropy
estimates and, for bitmap against gaps, a small trial compression.

Decoding checks every count against limits and against the caller's base state before it
allocates, decompresses each stream to an exactly predicted size, and raises
:class:`~echo.protocol.errors.DecodeError` (a :class:`~echo.protocol.errors.ProtocolError`)
and nothing else on bad input.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from echo.protocol.errors import DecodeError

MAGIC = b"ECHP"
# Bump when the layout changes; decoders reject versions they do not know.
FORMAT_VERSION = 1

# A model has at most a few thousand tensors; 65536 bounds the table parse long before memory.
MAX_PATCH_TENSORS = 1 << 16
# Parameter names are short dotted paths; 1 KiB is far above any real one.
MAX_NAME_BYTES = 1024
# 2**36 elements (128 GiB of bf16) is larger than any single tensor of a real model and keeps
# every position, gap and running sum far from int64 overflow.
MAX_TENSOR_ELEMENTS = 1 << 36
# Legitimate streams add up to at most the output they rebuild plus about 3 bits per element
# (bitmap, sign and big flags when nearly everything changed); twice the output is a loose, safe
# cap on all of them together, and it stops forged gap parameters from inflating gap_r.
_MAX_RAW_PER_OUTPUT = 2

_WIDTHS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # element width in bytes -> unsigned dtype
_ACCEPTED = {np.dtype(t): w for t, w in (("u2", 2), ("i2", 2), ("u4", 4), ("i4", 4))}

POS_NONE, POS_ALL, POS_BITMAP, POS_GAPS = 0, 1, 2, 3
VAL_NEW, VAL_DIFF = 0, 1
_POS_NAMES = {POS_NONE: "none", POS_ALL: "all", POS_BITMAP: "bitmap", POS_GAPS: "gaps"}
_VAL_NAMES = {VAL_NEW: "new", VAL_DIFF: "diff"}

_S_BITMAP, _S_GAP_Q, _S_GAP_R, _S_GAP_X, _S_SIGN, _S_BIG, _S_PLANE0 = range(7)
_STREAM_NAMES = ("bitmap", "gap_q", "gap_r", "gap_x", "sign", "big", "plane0", "plane1", "plane2")
_STREAM_NAMES += ("plane3",)
_N_STREAMS = len(_STREAM_NAMES)
_STORED, _ZSTD = 0, 1

_HEADER = struct.Struct("<4sHHI")
_TENSOR = struct.Struct("<BBBBQQ")
_STREAM = struct.Struct("<BQQ")
_U16 = struct.Struct("<H")

# Set bits per byte value (np.bitwise_count needs numpy 2; we support 1.26).
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)
# gap_q byte meaning "the whole gap is in gap_x".
_ESCAPE = 255
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
# Elements per step when bit-packing remainders (a multiple of 8 keeps every step byte-aligned).
_PACK_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------- helpers


def _bits_view(name: str, a: np.ndarray) -> tuple[np.ndarray, int]:
    """Return ``a`` viewed as little-endian unsigned bits and its width in bytes.

    :raises ValueError: if ``a`` is not a 1-D numpy array of uint16/int16/uint32/int32.
    """
    if not isinstance(a, np.ndarray):
        raise ValueError(f"tensor {name!r}: expected a numpy array, got {type(a).__name__}")
    if a.ndim != 1:
        raise ValueError(f"tensor {name!r}: expected a 1-D bit view, got shape {a.shape}")
    width = _ACCEPTED.get(a.dtype)  # a byte-swapped dtype compares unequal and is refused
    if width is None:
        raise ValueError(
            f"tensor {name!r}: dtype {a.dtype} is not a little-endian uint16/int16/uint32/int32 "
            "bit view"
        )
    return a.view(_WIDTHS[width]), width


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


def _pack_low_bits(s: np.ndarray, nbits: int) -> np.ndarray:
    """Pack the low ``nbits`` bits of each uint64 in ``s``, LSB first, into bytes."""
    if nbits == 0 or s.size == 0:
        return np.zeros(0, np.uint8)
    nbytes = (nbits + 7) // 8
    out = []
    for i in range(0, s.size, _PACK_CHUNK):
        b = s[i : i + _PACK_CHUNK].view(np.uint8).reshape(-1, 8)[:, :nbytes]
        bits = np.unpackbits(b, axis=1, bitorder="little")[:, :nbits]
        out.append(np.packbits(bits.ravel(), bitorder="little"))
    return np.concatenate(out)


def _unpack_low_bits(buf: np.ndarray, count: int, nbits: int) -> np.ndarray:
    """Inverse of :func:`_pack_low_bits`: ``count`` values of ``nbits`` bits as uint64.

    The caller guarantees ``len(buf) == ceil(count * nbits / 8)``; padding bits are checked.

    :raises DecodeError: if the padding bits of the last byte are not zero.
    """
    if nbits == 0:
        return np.zeros(count, np.uint64)
    _check_bit_padding(buf, count * nbits, "packed gap remainders")
    out = np.zeros((count, 8), np.uint8)
    step = _PACK_CHUNK
    for i in range(0, count, step):
        k = min(step, count - i)
        chunk = buf[i * nbits // 8 : (i * nbits + k * nbits + 7) // 8]
        bits = np.unpackbits(chunk, count=k * nbits, bitorder="little").reshape(k, nbits)
        packed = np.packbits(bits, axis=1, bitorder="little")
        out[i : i + k, : packed.shape[1]] = packed
    return out.view("<u8").ravel()


def _check_bit_padding(buf: np.ndarray, nbits: int, what: str) -> None:
    """Raise DecodeError if the bits after the first ``nbits`` of ``buf`` are not zero."""
    if nbits % 8 and int(buf[-1]) >> (nbits % 8):
        raise DecodeError(f"patch: non-zero padding bits after {what}")


# --------------------------------------------------------------------------------------- encoder


@dataclass
class _Planned:
    """One tensor's table entry and its segments of each stream."""

    name: bytes
    width: int
    pos: int
    val: int
    param: int
    numel: int
    changed: int
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
    esc = q >= _ESCAPE
    return np.where(esc, _ESCAPE, q).astype(np.uint8), esc


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
        return VAL_NEW, {_S_PLANE0 + k: p for k, p in enumerate(_planes(nv))}
    neg, big, rest = _split_diff(ov, nv)
    segs = {_S_PLANE0 + k: p for k, p in enumerate(_planes(rest))}
    segs[_S_SIGN] = np.packbits(neg, bitorder="little")
    segs[_S_BIG] = np.packbits(big, bitorder="little")
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
    plan = _Planned(name.encode(), width, POS_NONE, VAL_NEW, 0, numel, m)
    if m == 0:
        return plan
    if m == numel:
        plan.pos = POS_ALL
        plan.val, plan.segments = _plan_values(o, n)
        return plan
    shift, s = _plan_gaps(pos, numel)
    bitmap = None
    if m >= numel * _BITMAP_MIN_DENSITY and _bitmap_wins(pos, numel, s, shift, cctx):
        mask = np.zeros(numel, bool)
        mask[pos] = True
        bitmap = np.packbits(mask, bitorder="little")
    if bitmap is not None:
        plan.pos = POS_BITMAP
        plan.segments[_S_BITMAP] = bitmap
    else:
        plan.pos, plan.param = POS_GAPS, shift
        q, esc = _gap_split(s, shift)
        plan.segments[_S_GAP_Q] = q
        plan.segments[_S_GAP_R] = _pack_low_bits(s, shift)
        if esc.any():
            plan.segments[_S_GAP_X] = s[esc].astype("<u8").view(np.uint8)
    plan.val, segs = _plan_values(o[pos], n[pos])
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
        o, width = _bits_view(name, a)
        b = new[name]
        n, _ = _bits_view(name, b)
        if a.dtype != b.dtype or o.size != n.size:
            raise ValueError(
                f"tensor {name!r}: old is {a.dtype}[{o.size}], new is {b.dtype}[{n.size}]"
            )
        if o.size > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"tensor {name!r}: {o.size} elements exceed {MAX_TENSOR_ELEMENTS}")
        plans.append(_plan_tensor(name, o, n, width, cctx))

    head = [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(plans))]
    for p in plans:
        head.append(_U16.pack(len(p.name)) + p.name)
        head.append(_TENSOR.pack(p.width, p.pos, p.val, p.param, p.numel, p.changed))
    bodies = []
    for sid in range(_N_STREAMS):
        segs = [p.segments[sid] for p in plans if sid in p.segments]
        raw = np.concatenate(segs) if segs else np.zeros(0, np.uint8)
        body = cctx.compress(raw.data) if raw.size else b""
        method = _ZSTD if len(body) < raw.size else _STORED
        if method == _STORED:
            body = raw.tobytes()
        head.append(_STREAM.pack(method, raw.size, len(body)))
        bodies.append(body)
    return b"".join(head + bodies)


# --------------------------------------------------------------------------------------- decoder


@dataclass
class _Entry:
    name: str
    width: int
    pos: int
    val: int
    param: int
    numel: int
    changed: int


@dataclass
class _Parsed:
    entries: list[_Entry]
    streams: list[tuple[int, int, int]]  # (method, raw length, stored length)
    payload_start: int
    total: int


class _Reader:
    """Bounds-checked cursor over the patch bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.off = 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.buf) - self.off:
            raise DecodeError(
                f"patch truncated: {what} needs {n} bytes at offset {self.off}, "
                f"{len(self.buf) - self.off} left"
            )
        out = self.buf[self.off : self.off + n]
        self.off += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, what))


def _parse(patch: bytes | bytearray | memoryview) -> _Parsed:
    """Parse and validate the header, table and stream directory (no decompression).

    :raises DecodeError: on bad magic, unknown version or flags, truncation, counts over the
        limits, unknown or inconsistent codings, duplicate names, or stream lengths that do not
        match what the table implies.
    """
    if not isinstance(patch, (bytes, bytearray, memoryview)):
        raise DecodeError(f"patch must be bytes, got {type(patch).__name__}")
    r = _Reader(memoryview(patch).cast("B"))
    magic, version, flags, count = r.unpack(_HEADER, "header")
    if magic != MAGIC:
        raise DecodeError(f"not a weight patch: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DecodeError(
            f"unsupported patch format version {version} (this build reads {FORMAT_VERSION})",
            code="patch_version",
        )
    if flags != 0:
        raise DecodeError(f"unknown patch flags 0x{flags:04x}")
    if count > MAX_PATCH_TENSORS:
        raise DecodeError(f"patch declares {count} tensors, over the limit of {MAX_PATCH_TENSORS}")
    entries: list[_Entry] = []
    seen: set[str] = set()
    for i in range(count):
        (name_len,) = r.unpack(_U16, f"tensor {i} name length")
        if not 0 < name_len <= MAX_NAME_BYTES:
            raise DecodeError(f"tensor {i}: name length {name_len} not in 1..{MAX_NAME_BYTES}")
        try:
            name = bytes(r.take(name_len, f"tensor {i} name")).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"tensor {i}: name is not UTF-8") from e
        if name in seen:
            raise DecodeError(f"tensor {name!r} appears twice in the patch")
        seen.add(name)
        width, pos, val, param, numel, changed = r.unpack(_TENSOR, f"tensor {name!r} entry")
        _check_entry(name, width, pos, val, param, numel, changed)
        entries.append(_Entry(name, width, pos, val, param, numel, changed))
    streams = [r.unpack(_STREAM, f"stream {s} entry") for s in _STREAM_NAMES]
    for sname, (method, raw, stored) in zip(_STREAM_NAMES, streams, strict=True):
        if method not in (_STORED, _ZSTD):
            raise DecodeError(f"stream {sname}: unknown method {method}")
        if method == _STORED and stored != raw:
            raise DecodeError(f"stream {sname}: stored length {stored} != raw length {raw}")
    expected = _expected_raw(entries)
    for sid, (sname, (_, raw, _)) in enumerate(zip(_STREAM_NAMES, streams, strict=True)):
        if sid == _S_GAP_X:
            if raw % 8 or raw // 8 > expected[sid]:
                raise DecodeError(f"stream gap_x: {raw} bytes is not 8 x at most {expected[sid]}")
        elif sid >= _S_PLANE0:
            # Exact once the big flags are known (apply_patch); the table gives an upper bound.
            if raw > expected[sid]:
                raise DecodeError(
                    f"stream {sname}: {raw} raw bytes, the table allows {expected[sid]}"
                )
        elif raw != expected[sid]:
            raise DecodeError(f"stream {sname}: {raw} raw bytes, the table implies {expected[sid]}")
    payload = sum(s[2] for s in streams)
    if payload != len(r.buf) - r.off:
        raise DecodeError(
            f"patch has {len(r.buf) - r.off} payload bytes, the stream directory says {payload}"
        )
    return _Parsed(entries, streams, r.off, len(r.buf))


def _check_entry(
    name: str, width: int, pos: int, val: int, param: int, numel: int, changed: int
) -> None:
    """Validate one table entry on its own.

    :raises DecodeError: on an unknown width or coding, counts over the limits, or a count that
        contradicts the position coding.
    """
    if width not in _WIDTHS:
        raise DecodeError(f"tensor {name!r}: element width {width} is not 2 or 4 bytes")
    if numel > MAX_TENSOR_ELEMENTS:
        raise DecodeError(f"tensor {name!r}: {numel} elements exceed {MAX_TENSOR_ELEMENTS}")
    if changed > numel:
        raise DecodeError(f"tensor {name!r}: {changed} changes in {numel} elements")
    if val not in _VAL_NAMES:
        raise DecodeError(f"tensor {name!r}: unknown value coding {val}")
    if pos == POS_NONE:
        ok = changed == 0 and val == VAL_NEW
    elif pos == POS_ALL:
        ok = changed == numel > 0
    elif pos == POS_BITMAP:
        ok = 0 < changed < numel
    elif pos == POS_GAPS:
        ok = 0 < changed < numel and param <= numel.bit_length()
    else:
        raise DecodeError(f"tensor {name!r}: unknown position coding {pos}")
    if not ok or (pos != POS_GAPS and param != 0):
        raise DecodeError(
            f"tensor {name!r}: {_POS_NAMES[pos]} coding with {changed} of {numel} changed, "
            f"value coding {val}, parameter {param} is inconsistent"
        )


def _expected_raw(entries: list[_Entry]) -> list[int]:
    """Raw byte length of each stream implied by the table.

    For gap_x (one u64 per escape) and the planes (DIFF values only for big changes) this is an
    upper bound; the exact length follows from gap_q and big.
    """
    out = [0] * _N_STREAMS
    for e in entries:
        m = e.changed
        if e.pos == POS_BITMAP:
            out[_S_BITMAP] += (e.numel + 7) // 8
        elif e.pos == POS_GAPS:
            out[_S_GAP_Q] += m
            out[_S_GAP_R] += (m * e.param + 7) // 8
            out[_S_GAP_X] += m
        if e.val == VAL_DIFF:
            out[_S_SIGN] += (m + 7) // 8
            out[_S_BIG] += (m + 7) // 8
        for k in range(e.width):
            out[_S_PLANE0 + k] += m
    return out


def _decompress(data: memoryview, raw_len: int, method: int, sname: str) -> np.ndarray:
    """Return stream bytes, decompressed to exactly ``raw_len`` bytes.

    The zstd frame must declare ``raw_len`` as its content size (checked before anything is
    allocated; libzstd then refuses to write past it) and must be the only thing in ``data``.

    :raises DecodeError: on a malformed frame, a size mismatch, or trailing data.
    """
    if method == _STORED:
        return np.frombuffer(data, np.uint8)
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise DecodeError(f"stream {sname}: bad zstd frame header: {e}") from e
    if declared != raw_len:
        raise DecodeError(f"stream {sname}: zstd frame declares {declared} bytes, need {raw_len}")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = dobj.decompress(data)
    except zstandard.ZstdError as e:
        raise DecodeError(f"stream {sname}: corrupt zstd data: {e}") from e
    if not dobj.eof or dobj.unused_data or len(out) != raw_len:
        raise DecodeError(
            f"stream {sname}: zstd frame gave {len(out)} of {raw_len} bytes "
            f"(complete: {dobj.eof}, {len(dobj.unused_data)} trailing bytes)"
        )
    return np.frombuffer(out, np.uint8)


def _validate_against(
    parsed: _Parsed, old: Mapping[str, np.ndarray], max_output_bytes: int
) -> dict[str, np.ndarray]:
    """Match the table to the caller's base state and the output cap.

    :raises DecodeError: if names, widths or sizes differ from ``old`` or the output or stream
        sizes exceed what ``max_output_bytes`` allows.
    :raises ValueError: if ``old`` itself holds an unsupported array (a caller error).
    """
    names = [e.name for e in parsed.entries]
    if set(names) != set(old):
        extra = sorted(set(names) - set(old))[:3]
        missing = sorted(set(old) - set(names))[:3]
        raise DecodeError(
            f"patch tensors do not match the base state: unknown {extra}, missing {missing}"
        )
    out_bytes = 0
    views = {}
    for e in parsed.entries:
        o, width = _bits_view(e.name, old[e.name])
        if width != e.width or o.size != e.numel:
            raise DecodeError(
                f"tensor {e.name!r}: patch has {e.numel} x {e.width}-byte elements, "
                f"base has {o.size} x {width}"
            )
        views[e.name] = o
        out_bytes += e.numel * e.width
    if out_bytes > max_output_bytes:
        raise DecodeError(f"patch output of {out_bytes} bytes exceeds {max_output_bytes}")
    raw_total = sum(s[1] for s in parsed.streams)
    if raw_total > _MAX_RAW_PER_OUTPUT * out_bytes + 8 * _N_STREAMS:
        raise DecodeError(f"patch streams of {raw_total} bytes are too large for its output")
    return views


def _plane_lengths(entries: list[_Entry], big: np.ndarray) -> list[int]:
    """Exact raw length of each value plane, given the decoded big-flag stream.

    :raises DecodeError: if a tensor's big flags have non-zero padding bits.
    """
    out = [0] * 4
    off = 0
    for e in entries:
        count = e.changed
        if e.val == VAL_DIFF:
            flags = big[off : off + (e.changed + 7) // 8]
            off += flags.size
            _check_bit_padding(flags, e.changed, f"tensor {e.name!r} big flags")
            count = int(_POPCOUNT[flags].sum(dtype=np.int64))
        for k in range(e.width):
            out[k] += count
    return out


class _Cursor:
    """Consumes one decompressed stream tensor by tensor."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.off = 0

    def take(self, n: int) -> np.ndarray:
        # Lengths were checked against the table, so this never runs past the end.
        out = self.data[self.off : self.off + n]
        self.off += n
        return out


def _decode_positions(e: _Entry, cur: list[_Cursor]) -> np.ndarray | None:
    """Positions of ``e``'s changes (None for ALL).

    :raises DecodeError: if they are out of range, their count is wrong, or padding is not zero.
    """
    m = e.changed
    if e.pos == POS_ALL:
        return None
    if e.pos == POS_BITMAP:
        buf = cur[_S_BITMAP].take((e.numel + 7) // 8)
        _check_bit_padding(buf, e.numel, f"tensor {e.name!r} bitmap")
        pos = np.flatnonzero(np.unpackbits(buf, count=e.numel, bitorder="little"))
        if pos.size != m:
            raise DecodeError(f"tensor {e.name!r}: bitmap has {pos.size} changes, table {m}")
        return pos
    q = cur[_S_GAP_Q].take(m)
    r = _unpack_low_bits(cur[_S_GAP_R].take((m * e.param + 7) // 8), m, e.param)
    s = (q.astype(np.uint64) << np.uint64(e.param)) | r
    esc = np.flatnonzero(q == _ESCAPE)
    if esc.size:
        x = cur[_S_GAP_X].take(8 * esc.size)
        if x.size != 8 * esc.size:
            raise DecodeError(f"tensor {e.name!r}: stream gap_x ends early")
        xs = x.view("<u8")
        if int(xs.min()) < _ESCAPE << e.param or int(xs.max()) >= e.numel:
            raise DecodeError(f"tensor {e.name!r}: escaped gap out of range")
        s[esc] = xs
    # Each gap is < 2**(param+8) <= 2**45 and there are at most 2**36: a float64 sum bounds the
    # exact total without int64 overflow before we take the exact cumulative sum.
    if float(np.sum(s, dtype=np.float64)) + m > e.numel * (1 + 1e-9) + 1:
        raise DecodeError(f"tensor {e.name!r}: gaps run past the end of the tensor")
    pos = np.cumsum(s.view(np.int64) + 1) - 1
    if int(pos[-1]) >= e.numel:
        raise DecodeError(f"tensor {e.name!r}: change position {int(pos[-1])} >= {e.numel}")
    return pos


def _decode_values(e: _Entry, cur: list[_Cursor], ov: np.ndarray) -> np.ndarray:
    """New bits of ``e``'s changed elements, given their old bits ``ov``.

    :raises DecodeError: if a decoded value equals its old value (not a change).
    """
    m = e.changed
    dt = _WIDTHS[e.width]
    big = None
    count = m
    if e.val == VAL_DIFF:
        sbuf = cur[_S_SIGN].take((m + 7) // 8)
        _check_bit_padding(sbuf, m, f"tensor {e.name!r} signs")
        neg = np.unpackbits(sbuf, count=m, bitorder="little").view(bool)
        big = np.unpackbits(cur[_S_BIG].take((m + 7) // 8), count=m, bitorder="little").view(bool)
        count = int(np.count_nonzero(big))
    planes = np.empty((count, e.width), np.uint8)
    for k in range(e.width):
        planes[:, k] = cur[_S_PLANE0 + k].take(count)
    v = planes.view(dt).ravel()
    if big is not None:
        delta = np.ones(m, dt)
        delta[big] = v + dt.type(2)
        v = np.where(neg, ov - delta, ov + delta).astype(dt, copy=False)
    if np.any(v == ov):
        raise DecodeError(f"tensor {e.name!r}: a listed change leaves the bits unchanged")
    return v


def _decode_all(
    old: Mapping[str, np.ndarray], patch: bytes, max_output_bytes: int
) -> list[tuple[str, np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """Decode and validate every change in ``patch`` against ``old`` without writing anything.

    Returns, per tensor in patch order, (name, unsigned view of the base, positions or None for
    ALL, new values or None for NONE).

    :raises DecodeError: as :func:`apply_patch`.
    :raises ValueError: if ``old`` holds something that is not a supported 1-D bit view.
    """
    parsed = _parse(patch)
    views = _validate_against(parsed, old, max_output_bytes)
    buf = memoryview(patch).cast("B")
    off = parsed.payload_start
    cursors = []
    for sid, (sname, (method, raw, stored)) in enumerate(
        zip(_STREAM_NAMES, parsed.streams, strict=True)
    ):
        if sid == _S_GAP_X:
            # Its exact length depends on gap_q (decoded just before): one u64 per escape byte.
            escapes = int(np.count_nonzero(cursors[_S_GAP_Q].data == _ESCAPE))
            if raw != 8 * escapes:
                raise DecodeError(f"stream gap_x: {raw} bytes for {escapes} escaped gaps")
        elif sid == _S_PLANE0:
            plane_len = _plane_lengths(parsed.entries, cursors[_S_BIG].data)
        if sid >= _S_PLANE0 and raw != plane_len[sid - _S_PLANE0]:
            raise DecodeError(
                f"stream {sname}: {raw} raw bytes, table and big flags imply "
                f"{plane_len[sid - _S_PLANE0]}"
            )
        cursors.append(_Cursor(_decompress(buf[off : off + stored], raw, method, sname)))
        off += stored
    changes = []
    for e in parsed.entries:
        o = views[e.name]
        if e.pos == POS_NONE:
            changes.append((e.name, o, None, None))
            continue
        pos = _decode_positions(e, cursors)
        values = _decode_values(e, cursors, o if pos is None else o[pos])
        changes.append((e.name, o, pos, values))
    return changes


def apply_patch(
    old: Mapping[str, np.ndarray], patch: bytes, *, max_output_bytes: int
) -> dict[str, np.ndarray]:
    """Apply ``patch`` to ``old`` and return the new state as fresh arrays (``old`` is untouched).

    Output arrays keep ``old``'s dtypes and are returned in the patch's tensor order. Every
    limit (tensor count, element counts, output bytes <= ``max_output_bytes``, each stream's
    decompressed size) is checked before the memory it governs is allocated.

    A patch does not name its base version: applied to a different base of the same shapes it
    yields a wrong state (or a DecodeError). Callers check the result against the tensor hashes
    of the signed manifest.

    :raises DecodeError: if the patch is malformed, exceeds a limit, or does not match ``old``
        (names, element widths, sizes).
    :raises ValueError: if ``old`` holds something that is not a supported 1-D bit view.
    """
    out: dict[str, np.ndarray] = {}
    for name, o, pos, values in _decode_all(old, patch, max_output_bytes):
        if values is None:
            res = o.copy()
        elif pos is None:
            res = values  # freshly decoded, shares nothing with old
        else:
            res = o.copy()
            res[pos] = values
        out[name] = res.view(old[name].dtype)
    return out


def apply_patch_inplace(
    state: Mapping[str, np.ndarray], patch: bytes, *, max_output_bytes: int
) -> None:
    """Apply ``patch`` by writing the changed elements into ``state``'s own arrays.

    For nodes holding large models: no second copy of the state. All or nothing: the whole patch
    is decoded and validated (as in :func:`apply_patch`) before the first element is written, so
    on any error ``state`` is unchanged.

    :raises DecodeError: as :func:`apply_patch`.
    :raises ValueError: if an array of ``state`` is not a writeable, supported 1-D bit view.
    """
    for name, a in state.items():
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"tensor {name!r}: array is read-only")
    for _, o, pos, values in _decode_all(state, patch, max_output_bytes):
        if values is None:
            continue
        if pos is None:
            o[...] = values
        else:
            o[pos] = values


def patch_stats(patch: bytes) -> dict[str, Any]:
    """Summarise a patch from its header alone (nothing is decompressed).

    Returns ``bytes``, ``tensors``, ``elements``, ``changed``, ``changed_fraction``,
    ``output_bytes``, counts per position and value coding, and raw/stored bytes per stream.

    :raises DecodeError: if the header, table or stream directory is malformed.
    """
    parsed = _parse(patch)
    elements = sum(e.numel for e in parsed.entries)
    changed = sum(e.changed for e in parsed.entries)
    return {
        "format_version": FORMAT_VERSION,
        "bytes": parsed.total,
        "tensors": len(parsed.entries),
        "elements": elements,
        "changed": changed,
        "changed_fraction": changed / elements if elements else 0.0,
        "output_bytes": sum(e.numel * e.width for e in parsed.entries),
        "positions": {v: sum(e.pos == k for e in parsed.entries) for k, v in _POS_NAMES.items()},
        "values": {
            v: sum(e.val == k and e.changed > 0 for e in parsed.entries)
            for k, v in _VAL_NAMES.items()
        },
        "streams": {
            name: {"method": "zstd" if s[0] == _ZSTD else "stored", "raw": s[1], "stored": s[2]}
            for name, s in zip(_STREAM_NAMES, parsed.streams, strict=True)
        },
    }
