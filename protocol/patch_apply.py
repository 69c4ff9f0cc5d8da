"""Applying a weight patch (:mod:`echo.protocol.patch`) to a base state, bit for bit.

:func:`apply_patch` returns the new state as fresh arrays; :func:`apply_patch_inplace` writes the
changed elements into the caller's arrays, all or nothing. Both decode and validate the whole
patch first (layout: :mod:`echo.protocol.patch_format`).

Decoding checks every count against limits and against the caller's base state before it
allocates, decompresses each stream to an exactly predicted size, and raises
:class:`~echo.protocol.errors.DecodeError` (a :class:`~echo.protocol.errors.ProtocolError`)
and nothing else on bad input.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import zstandard

from echo.protocol.errors import DecodeError
from echo.protocol.patch_format import (
    _ESCAPE,
    _N_STREAMS,
    _S_BIG,
    _S_BITMAP,
    _S_GAP_Q,
    _S_GAP_R,
    _S_GAP_X,
    _S_PLANE0,
    _S_SIGN,
    _STORED,
    _STREAM_NAMES,
    _WIDTHS,
    POS_ALL,
    POS_BITMAP,
    POS_NONE,
    VAL_DIFF,
    _bits_view,
    _check_bit_padding,
    _Entry,
    _parse,
    _Parsed,
    _unpack_low_bits,
)

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
