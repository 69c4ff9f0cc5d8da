"""Decoding a weight patch's payload against the base state it applies to.

This module owns turning the payload into changes: it matches the table to the caller's base
state and output cap before anything is allocated, decompresses each stream to exactly the size
the table (and, for the value planes, the decoded big flags) predicts, and rebuilds each tensor's
changed positions and new bits, checking every one (positions in range, padding bits zero, every
listed change a real change). It writes nothing: :mod:`echo.protocol.patch.apply` does.

Errors: :class:`~echo.protocol.errors.DecodeError` (a
:class:`~echo.protocol.errors.ProtocolError`) on bad input and nothing else; ``ValueError`` only
for a base state that is not a supported bit view (a caller error).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import zstandard

from echo.protocol.errors import DecodeError
from echo.protocol.patch.format import (
    ESCAPE,
    METHOD_STORED,
    N_PLANES,
    N_STREAMS,
    POS_ALL,
    POS_BITMAP,
    POS_NONE,
    STREAM_NAMES,
    VAL_DIFF,
    WIDTHS,
    Stream,
    TensorEntry,
    bits_view,
    check_bit_padding,
    unpack_low_bits,
)
from echo.protocol.patch.parse import PatchLayout, read_layout

# Legitimate streams add up to at most the output they rebuild plus about 3 bits per element
# (bitmap, sign and big flags when nearly everything changed); twice the output is a loose, safe
# cap on all of them together, and it stops forged gap parameters from inflating gap_r.
_MAX_RAW_PER_OUTPUT = 2
# Set bits per byte value (np.bitwise_count needs numpy 2; we support 1.26).
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _decompress(data: memoryview, raw_len: int, method: int, sname: str) -> np.ndarray:
    """Return stream bytes, decompressed to exactly ``raw_len`` bytes.

    The zstd frame must declare ``raw_len`` as its content size (checked before anything is
    allocated; libzstd then refuses to write past it) and must be the only thing in ``data``.

    :raises DecodeError: on a malformed frame, a size mismatch, or trailing data.
    """
    if method == METHOD_STORED:
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
    layout: PatchLayout, old: Mapping[str, np.ndarray], max_output_bytes: int
) -> dict[str, np.ndarray]:
    """Match the table to the caller's base state and the output cap.

    :raises DecodeError: if names, widths or sizes differ from ``old`` or the output or stream
        sizes exceed what ``max_output_bytes`` allows.
    :raises ValueError: if ``old`` itself holds an unsupported array (a caller error).
    """
    names = [e.name for e in layout.entries]
    if set(names) != set(old):
        extra = sorted(set(names) - set(old))[:3]
        missing = sorted(set(old) - set(names))[:3]
        raise DecodeError(
            f"patch tensors do not match the base state: unknown {extra}, missing {missing}"
        )
    out_bytes = 0
    views = {}
    for e in layout.entries:
        o, width = bits_view(e.name, old[e.name])
        if width != e.width or o.size != e.numel:
            raise DecodeError(
                f"tensor {e.name!r}: patch has {e.numel} x {e.width}-byte elements, "
                f"base has {o.size} x {width}"
            )
        views[e.name] = o
        out_bytes += e.numel * e.width
    if out_bytes > max_output_bytes:
        raise DecodeError(f"patch output of {out_bytes} bytes exceeds {max_output_bytes}")
    raw_total = sum(s.raw for s in layout.streams)
    if raw_total > _MAX_RAW_PER_OUTPUT * out_bytes + 8 * N_STREAMS:
        raise DecodeError(f"patch streams of {raw_total} bytes are too large for its output")
    return views


def _plane_lengths(entries: list[TensorEntry], big: np.ndarray) -> list[int]:
    """Exact raw length of each value plane, given the decoded big-flag stream.

    :raises DecodeError: if a tensor's big flags have non-zero padding bits.
    """
    out = [0] * N_PLANES
    off = 0
    for e in entries:
        count = e.changed
        if e.val == VAL_DIFF:
            flags = big[off : off + (e.changed + 7) // 8]
            off += flags.size
            check_bit_padding(flags, e.changed, f"tensor {e.name!r} big flags")
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


def _decode_positions(e: TensorEntry, cur: list[_Cursor]) -> np.ndarray | None:
    """Positions of ``e``'s changes (None for ALL).

    :raises DecodeError: if they are out of range, their count is wrong, or padding is not zero.
    """
    m = e.changed
    if e.pos == POS_ALL:
        return None
    if e.pos == POS_BITMAP:
        buf = cur[Stream.BITMAP].take((e.numel + 7) // 8)
        check_bit_padding(buf, e.numel, f"tensor {e.name!r} bitmap")
        pos = np.flatnonzero(np.unpackbits(buf, count=e.numel, bitorder="little"))
        if pos.size != m:
            raise DecodeError(f"tensor {e.name!r}: bitmap has {pos.size} changes, table {m}")
        return pos
    q = cur[Stream.GAP_Q].take(m)
    r = unpack_low_bits(cur[Stream.GAP_R].take((m * e.param + 7) // 8), m, e.param)
    s = (q.astype(np.uint64) << np.uint64(e.param)) | r
    esc = np.flatnonzero(q == ESCAPE)
    if esc.size:
        x = cur[Stream.GAP_X].take(8 * esc.size)
        if x.size != 8 * esc.size:
            raise DecodeError(f"tensor {e.name!r}: stream gap_x ends early")
        xs = x.view("<u8")
        if int(xs.min()) < ESCAPE << e.param or int(xs.max()) >= e.numel:
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


def _decode_values(e: TensorEntry, cur: list[_Cursor], ov: np.ndarray) -> np.ndarray:
    """New bits of ``e``'s changed elements, given their old bits ``ov``.

    :raises DecodeError: if a decoded value equals its old value (not a change).
    """
    m = e.changed
    dt = WIDTHS[e.width]
    big = None
    count = m
    if e.val == VAL_DIFF:
        sbuf = cur[Stream.SIGN].take((m + 7) // 8)
        check_bit_padding(sbuf, m, f"tensor {e.name!r} signs")
        neg = np.unpackbits(sbuf, count=m, bitorder="little").view(bool)
        bbuf = cur[Stream.BIG].take((m + 7) // 8)
        big = np.unpackbits(bbuf, count=m, bitorder="little").view(bool)
        count = int(np.count_nonzero(big))
    planes = np.empty((count, e.width), np.uint8)
    for k in range(e.width):
        planes[:, k] = cur[Stream.PLANE0 + k].take(count)
    v = planes.view(dt).ravel()
    if big is not None:
        delta = np.ones(m, dt)
        delta[big] = v + dt.type(2)
        v = np.where(neg, ov - delta, ov + delta).astype(dt, copy=False)
    if np.any(v == ov):
        raise DecodeError(f"tensor {e.name!r}: a listed change leaves the bits unchanged")
    return v


# One tensor's decoded change, in patch order: (name, the caller's array viewed as unsigned bits
# (sharing its memory), the sorted changed positions or None when every element changed, the new
# bits at those positions or None when nothing changed). A plain tuple: a model can have
# thousands of tiny tensors, and a NamedTuple costs a microsecond more for each.
Change = tuple[str, np.ndarray, np.ndarray | None, np.ndarray | None]


def decode_changes(
    old: Mapping[str, np.ndarray], patch: bytes, max_output_bytes: int
) -> list[Change]:
    """Decode and validate every change in ``patch`` against ``old`` without writing anything.

    Returns one :data:`Change` per tensor, in patch order.

    Every limit (tensor count, element counts, output bytes <= ``max_output_bytes``, each
    stream's decompressed size) is checked before the memory it governs is allocated.

    :raises DecodeError: if the patch is malformed, exceeds a limit, or does not match ``old``
        (names, element widths, sizes).
    :raises ValueError: if ``old`` holds something that is not a supported 1-D bit view.
    """
    layout = read_layout(patch)
    views = _validate_against(layout, old, max_output_bytes)
    buf = memoryview(patch).cast("B")
    off = layout.payload_start
    cursors: list[_Cursor] = []
    plane_len: list[int] = []
    for sid, (sname, (method, raw, stored)) in enumerate(
        zip(STREAM_NAMES, layout.streams, strict=True)
    ):
        if sid == Stream.GAP_X:
            # Its exact length depends on gap_q (decoded just before): one u64 per escape byte.
            escapes = int(np.count_nonzero(cursors[Stream.GAP_Q].data == ESCAPE))
            if raw != 8 * escapes:
                raise DecodeError(f"stream gap_x: {raw} bytes for {escapes} escaped gaps")
        elif sid == Stream.PLANE0:
            plane_len = _plane_lengths(layout.entries, cursors[Stream.BIG].data)
        if sid >= Stream.PLANE0 and raw != plane_len[sid - Stream.PLANE0]:
            raise DecodeError(
                f"stream {sname}: {raw} raw bytes, table and big flags imply "
                f"{plane_len[sid - Stream.PLANE0]}"
            )
        cursors.append(_Cursor(_decompress(buf[off : off + stored], raw, method, sname)))
        off += stored
    changes: list[Change] = []
    for e in layout.entries:
        o = views[e.name]
        if e.pos == POS_NONE:
            changes.append((e.name, o, None, None))
            continue
        pos = _decode_positions(e, cursors)
        values = _decode_values(e, cursors, o if pos is None else o[pos])
        changes.append((e.name, o, pos, values))
    return changes
