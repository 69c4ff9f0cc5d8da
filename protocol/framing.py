"""Length-prefixed frames: a 4-byte big-endian unsigned length, then that many payload bytes.

Pure functions, no I/O: the stream code in ``echo.p2p`` reads ``HEADER_LEN`` bytes, calls
:func:`decode_length` (which checks the limit *before* anything is allocated or read), then reads
exactly that many bytes. Both functions raise :class:`~echo.protocol.errors.FrameError` and nothing
else on bad input.
"""

from __future__ import annotations

import struct

from echo.protocol.errors import FrameError

# 4 bytes cover every limit we use (MAX_FRAME_BYTES is ~4 MiB) and match common
# length-prefixed protocols; a fixed width lets a reader check the limit after one short read.
HEADER_LEN = 4

# Largest length a 4-byte unsigned header can express.
_MAX_ENCODABLE = (1 << (8 * HEADER_LEN)) - 1

_HEADER = struct.Struct(">I")


def encode_frame(payload: bytes, max_len: int) -> bytes:
    """Return ``header + payload``.

    :raises FrameError: if ``len(payload)`` exceeds ``max_len`` (or what 4 bytes can express).
    """
    n = len(payload)
    if n > max_len or n > _MAX_ENCODABLE:
        raise FrameError(f"frame of {n} bytes exceeds the limit of {max_len} bytes")
    return _HEADER.pack(n) + bytes(payload)


def encode_header(length: int, max_len: int) -> bytes:
    """Return only the 4-byte header for a payload of ``length`` bytes (for streaming writers).

    :raises FrameError: if ``length`` is negative or exceeds ``max_len``.
    """
    if length < 0 or length > max_len or length > _MAX_ENCODABLE:
        raise FrameError(f"frame of {length} bytes exceeds the limit of {max_len} bytes")
    return _HEADER.pack(length)


def decode_length(header: bytes, max_len: int) -> int:
    """Return the payload length announced by ``header``.

    :raises FrameError: if ``header`` is not exactly ``HEADER_LEN`` bytes or announces more
        than ``max_len`` bytes.
    """
    if len(header) != HEADER_LEN:
        raise FrameError(f"frame header must be {HEADER_LEN} bytes, got {len(header)}")
    (n,) = _HEADER.unpack(header)
    if n > max_len:
        raise FrameError(
            f"frame announces {n} bytes, over the limit of {max_len} bytes", code="frame_too_large"
        )
    return n
