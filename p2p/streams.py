"""Exact reads and length-prefixed frames over a libp2p stream.

Owns no stream: callers open, close and reset the streams they pass in, and wrap calls in their
own ``trio`` deadlines (nothing here waits without the caller's timeout around it).

py-libp2p quirks handled here: yamux ``read(n)`` returns *up to* n bytes (partial reads are
normal), and a read at end of stream may either return ``b""`` or raise ``StreamEOF``; both mean
end of stream.

Errors: :class:`~echo.protocol.errors.FrameError` for a frame over its limit (checked before the
body is read) or cut short by end of stream; libp2p's ``StreamReset`` / ``StreamError`` pass
through unchanged (a reset is the peer giving up, not a framing violation).
"""

from __future__ import annotations

from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF

from echo.protocol.errors import FrameError
from echo.protocol.framing import HEADER_LEN, decode_length, encode_frame

# Upper bound on one read() call. yamux hands back whatever its buffer holds anyway; capping the
# request keeps a single call from asking the muxer for an arbitrarily large slice.
_READ_CHUNK = 1 << 20


async def read_exactly(stream: INetStream, n: int) -> bytes:
    """Read exactly ``n`` bytes.

    Memory grows with the bytes actually received, not with ``n``, so a peer that announces a
    large frame and sends nothing costs nothing.

    :raises FrameError: (code ``frame_truncated``) if the stream ends first.
    """
    if n == 0:
        return b""
    buf = bytearray()
    while len(buf) < n:
        try:
            data = await stream.read(min(n - len(buf), _READ_CHUNK))
        except StreamEOF:
            data = b""
        if not data:
            raise FrameError(f"stream ended after {len(buf)} of {n} bytes", code="frame_truncated")
        buf += data
    return bytes(buf)


async def read_frame(stream: INetStream, max_len: int) -> bytes:
    """Read one frame and return its payload.

    The announced length is checked against ``max_len`` before a single body byte is read.

    :raises FrameError: oversized (code ``frame_too_large``) or truncated (``frame_truncated``).
    """
    header = await read_exactly(stream, HEADER_LEN)
    n = decode_length(header, max_len)
    return await read_exactly(stream, n)


async def write_frame(stream: INetStream, payload: bytes, max_len: int) -> None:
    """Write ``payload`` as one frame.

    :raises FrameError: ``payload`` is longer than ``max_len`` (nothing is written).
    """
    await stream.write(encode_frame(payload, max_len))
