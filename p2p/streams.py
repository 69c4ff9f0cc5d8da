"""Exact reads and length-prefixed frames over a libp2p stream, closing one quietly, and who is
at its other end.

Owns no stream: callers open the streams they pass in and decide when to close or reset them,
and wrap reads and writes in their own ``trio`` deadlines (nothing here waits without the
caller's timeout around it, except :func:`close_quietly` / :func:`reset_quietly`, which bound
themselves by their ``timeout``, :data:`STREAM_CLOSE_TIMEOUT` unless the caller gives one).

py-libp2p quirks handled here: yamux ``read(n)`` returns *up to* n bytes (partial reads are
normal), and a read at end of stream may either return ``b""`` or raise ``StreamEOF``; both mean
end of stream.

Errors: :class:`~echo.protocol.errors.FrameError` for a frame over its limit (checked before the
body is read) or cut short by end of stream; libp2p's ``StreamReset`` / ``StreamError`` pass
through unchanged (a reset is the peer giving up, not a framing violation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from echo.protocol.errors import FrameError
from echo.protocol.framing import HEADER_LEN, decode_length, encode_frame

# Upper bound on one read() call. yamux hands back whatever its buffer holds anyway; capping the
# request keeps a single call from asking the muxer for an arbitrarily large slice.
_READ_CHUNK = 1 << 20
# Bound on closing / resetting a stream we are done with: a peer that stopped reading must not
# hold the task that drops its stream (shielded from cancellation, so it runs even then).
STREAM_CLOSE_TIMEOUT = 1.0

log = logging.getLogger(__name__)


async def read_exactly(
    stream: INetStream, n: int, on_progress: Callable[[], None] | None = None
) -> bytes:
    """Read exactly ``n`` bytes; ``on_progress`` (if given) is called after every read that
    returned data, so a caller can tell a slow peer from a silent one.

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
        if on_progress is not None:
            on_progress()
    return bytes(buf)


async def read_header(stream: INetStream) -> bytes | None:
    """Read a frame's header; None when the stream ended before its first byte.

    That case is a peer that gave up or refused (it closed or reset the stream without a
    word), which callers count apart from a frame cut short: a client's abandoned request, a
    server's unread refusal.

    :raises FrameError: (code ``frame_truncated``) if the stream ends inside the header.
    """
    try:
        first = await read_exactly(stream, 1)
    except FrameError:
        return None
    return first + await read_exactly(stream, HEADER_LEN - 1)


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


async def reset_quietly(
    stream: INetStream | None, timeout: float = STREAM_CLOSE_TIMEOUT
) -> None:
    """Reset ``stream`` (the peer sees an error; None: nothing to do), within ``timeout``, even
    when cancelled. Never raises: the stream is being dropped anyway."""
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        try:
            await stream.reset()
        except Exception:
            log.debug("stream reset failed", exc_info=True)


async def close_quietly(stream: INetStream, timeout: float = STREAM_CLOSE_TIMEOUT) -> None:
    """Close ``stream`` cleanly, within ``timeout``, even when cancelled. Never raises: the
    stream is being dropped anyway."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        try:
            await stream.close()
        except Exception:
            log.debug("stream close failed", exc_info=True)


async def end_stream(stream: INetStream, *, clean: bool) -> None:
    """Done with ``stream``: close it if the exchange ended ``clean``, else reset it (so the peer
    sees an error); quietly and bounded, as :func:`close_quietly` / :func:`reset_quietly`."""
    if clean:
        await close_quietly(stream)
    else:
        await reset_quietly(stream)


def stream_peer(stream: INetStream) -> ID:
    """The peer at the other end of ``stream`` (as its connection authenticated it)."""
    return stream.muxed_conn.peer_id
