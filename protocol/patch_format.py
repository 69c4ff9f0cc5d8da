"""The wire format of weight patches (:mod:`echo.protocol.patch`): layout, limits, and the parse
of everything in front of the payload.

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
quotient and uniform low bits). Value codings: NEW (the new bits) and DIFF (a sign bit, a "moved
further" bit and the rare larger distances).

:func:`_parse` reads and checks the header, table and stream directory without decompressing
anything; :func:`patch_stats` summarises a patch from them. The encoder
(:mod:`echo.protocol.patch`) and the decoder (:mod:`echo.protocol.patch_apply`) share this
module's underscore names: they are the codec's internals, not an API. Nothing here does I/O.

Errors: :class:`~echo.protocol.errors.DecodeError` on bad input, and nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

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

# gap_q byte meaning "the whole gap is in gap_x".
_ESCAPE = 255
# Elements per step when bit-packing remainders (a multiple of 8 keeps every step byte-aligned).
_PACK_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------- bits


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


# --------------------------------------------------------------------------------------- parse


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
