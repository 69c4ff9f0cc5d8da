"""Reading a weight patch's front matter: header, tensor table and stream directory.

This module owns the checks a patch must pass before any of its payload is touched: magic,
version, flags, every count against the limits of :mod:`echo.protocol.patch.format`, the
consistency of each table entry with its codings, and every stream length against what the table
implies. :func:`read_layout` returns the checked :class:`PatchLayout`; it decompresses nothing
and allocates nothing in proportion to what the patch claims. :func:`patch_stats` summarises a
patch from its layout alone.

Errors: :class:`~echo.protocol.errors.DecodeError` on bad input, and nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from echo.protocol.errors import DecodeError
from echo.protocol.patch.format import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    MAX_NAME_BYTES,
    MAX_PATCH_TENSORS,
    MAX_TENSOR_ELEMENTS,
    METHOD_NAMES,
    METHOD_STORED,
    N_STREAMS,
    NAME_LENGTH,
    POS_ALL,
    POS_BITMAP,
    POS_GAPS,
    POS_NAMES,
    POS_NONE,
    STREAM_ENTRY,
    STREAM_NAMES,
    TENSOR_FIELDS,
    VAL_DIFF,
    VAL_NAMES,
    VAL_NEW,
    WIDTHS,
    Stream,
    StreamEntry,
    TensorEntry,
)


@dataclass
class PatchLayout:
    """A patch's checked front matter: its table, its directory and where the payload starts."""

    entries: list[TensorEntry]
    streams: list[StreamEntry]
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


def read_layout(patch: bytes | bytearray | memoryview) -> PatchLayout:
    """Parse and validate the header, table and stream directory (no decompression).

    :raises DecodeError: on bad magic, unknown version or flags, truncation, counts over the
        limits, unknown or inconsistent codings, duplicate names, or stream lengths that do not
        match what the table implies.
    """
    if not isinstance(patch, (bytes, bytearray, memoryview)):
        raise DecodeError(f"patch must be bytes, got {type(patch).__name__}")
    r = _Reader(memoryview(patch).cast("B"))
    magic, version, flags, count = r.unpack(HEADER, "header")
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
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    for i in range(count):
        (name_len,) = r.unpack(NAME_LENGTH, f"tensor {i} name length")
        if not 0 < name_len <= MAX_NAME_BYTES:
            raise DecodeError(f"tensor {i}: name length {name_len} not in 1..{MAX_NAME_BYTES}")
        try:
            name = bytes(r.take(name_len, f"tensor {i} name")).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"tensor {i}: name is not UTF-8") from e
        if name in seen:
            raise DecodeError(f"tensor {name!r} appears twice in the patch")
        seen.add(name)
        entry = TensorEntry(name, *r.unpack(TENSOR_FIELDS, f"tensor {name!r} entry"))
        check_entry(entry)
        entries.append(entry)
    streams = [StreamEntry(*r.unpack(STREAM_ENTRY, f"stream {s} entry")) for s in STREAM_NAMES]
    for sname, s in zip(STREAM_NAMES, streams, strict=True):
        if s.method not in METHOD_NAMES:
            raise DecodeError(f"stream {sname}: unknown method {s.method}")
        if s.method == METHOD_STORED and s.stored != s.raw:
            raise DecodeError(f"stream {sname}: stored length {s.stored} != raw length {s.raw}")
    expected = expected_raw_lengths(entries)
    for sid, (sname, s) in enumerate(zip(STREAM_NAMES, streams, strict=True)):
        if sid == Stream.GAP_X:
            if s.raw % 8 or s.raw // 8 > expected[sid]:
                raise DecodeError(f"stream gap_x: {s.raw} bytes is not 8 x at most {expected[sid]}")
        elif sid >= Stream.PLANE0:
            # Exact once the big flags are known (decode); the table gives an upper bound.
            if s.raw > expected[sid]:
                raise DecodeError(
                    f"stream {sname}: {s.raw} raw bytes, the table allows {expected[sid]}"
                )
        elif s.raw != expected[sid]:
            raise DecodeError(
                f"stream {sname}: {s.raw} raw bytes, the table implies {expected[sid]}"
            )
    payload = sum(s.stored for s in streams)
    if payload != len(r.buf) - r.off:
        raise DecodeError(
            f"patch has {len(r.buf) - r.off} payload bytes, the stream directory says {payload}"
        )
    return PatchLayout(entries, streams, r.off, len(r.buf))


def check_entry(e: TensorEntry) -> None:
    """Validate one table entry on its own.

    :raises DecodeError: on an unknown width or coding, counts over the limits, or a count that
        contradicts the position coding.
    """
    name, numel, changed = e.name, e.numel, e.changed
    if e.width not in WIDTHS:
        raise DecodeError(f"tensor {name!r}: element width {e.width} is not 2 or 4 bytes")
    if numel > MAX_TENSOR_ELEMENTS:
        raise DecodeError(f"tensor {name!r}: {numel} elements exceed {MAX_TENSOR_ELEMENTS}")
    if changed > numel:
        raise DecodeError(f"tensor {name!r}: {changed} changes in {numel} elements")
    if e.val not in VAL_NAMES:
        raise DecodeError(f"tensor {name!r}: unknown value coding {e.val}")
    if e.pos == POS_NONE:
        ok = changed == 0 and e.val == VAL_NEW
    elif e.pos == POS_ALL:
        ok = changed == numel > 0
    elif e.pos == POS_BITMAP:
        ok = 0 < changed < numel
    elif e.pos == POS_GAPS:
        ok = 0 < changed < numel and e.param <= numel.bit_length()
    else:
        raise DecodeError(f"tensor {name!r}: unknown position coding {e.pos}")
    if not ok or (e.pos != POS_GAPS and e.param != 0):
        raise DecodeError(
            f"tensor {name!r}: {POS_NAMES[e.pos]} coding with {changed} of {numel} changed, "
            f"value coding {e.val}, parameter {e.param} is inconsistent"
        )


def expected_raw_lengths(entries: list[TensorEntry]) -> list[int]:
    """Raw byte length of each stream implied by the table, indexed by :class:`Stream`.

    For gap_x (one u64 per escape) and the planes (DIFF values only for big changes) this is an
    upper bound; the exact length follows from gap_q and big.
    """
    out = [0] * N_STREAMS
    for e in entries:
        m = e.changed
        if e.pos == POS_BITMAP:
            out[Stream.BITMAP] += (e.numel + 7) // 8
        elif e.pos == POS_GAPS:
            out[Stream.GAP_Q] += m
            out[Stream.GAP_R] += (m * e.param + 7) // 8
            out[Stream.GAP_X] += m
        if e.val == VAL_DIFF:
            out[Stream.SIGN] += (m + 7) // 8
            out[Stream.BIG] += (m + 7) // 8
        for k in range(e.width):
            out[Stream.PLANE0 + k] += m
    return out


def patch_stats(patch: bytes) -> dict[str, Any]:
    """Summarise a patch from its header alone (nothing is decompressed).

    Returns ``bytes``, ``tensors``, ``elements``, ``changed``, ``changed_fraction``,
    ``output_bytes``, counts per position and value coding, and raw/stored bytes per stream.

    :raises DecodeError: if the header, table or stream directory is malformed.
    """
    layout = read_layout(patch)
    entries = layout.entries
    elements = sum(e.numel for e in entries)
    changed = sum(e.changed for e in entries)
    return {
        "format_version": FORMAT_VERSION,
        "bytes": layout.total,
        "tensors": len(entries),
        "elements": elements,
        "changed": changed,
        "changed_fraction": changed / elements if elements else 0.0,
        "output_bytes": sum(e.numel * e.width for e in entries),
        "positions": {v: sum(e.pos == k for e in entries) for k, v in POS_NAMES.items()},
        "values": {
            v: sum(e.val == k and e.changed > 0 for e in entries) for k, v in VAL_NAMES.items()
        },
        "streams": {
            name: {"method": METHOD_NAMES[s.method], "raw": s.raw, "stored": s.stored}
            for name, s in zip(STREAM_NAMES, layout.streams, strict=True)
        },
    }
