"""Receiving pushes: the relay's handler of ``/echo/push/1.1.0`` streams from its parents.

A parent opens one stream per version and stripe (:mod:`echo.protocol.broadcast`). The
:class:`Receiver` reads the hello (its manifest verified against the job's learner key before the
transfer exists), then chunks: each is checked against the manifest (exact size, then SHA-256)
before it is stored (:class:`~echo.p2p.relay.intake.Intake`), and acknowledged on the same stream
from a task of its own. Keep-alives and every byte read are noted on the stream's
:class:`~echo.p2p.relay.transfer.Feed`, which the watchdog reads.

Ownership: each inbound stream, closed after the parent's ``end``, reset otherwise (bad chunk,
silence, complete, the watchdog cancelling the feed). Nothing raises into the host: a parent
that lies or breaks the protocol is reported and excluded, one that vanishes is reported as
stalled, and a failing store (:class:`~echo.p2p.relay.intake.StoreError`) is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

import trio
from libp2p.abc import INetStream
from libp2p.exceptions import BaseLibp2pError

from echo.p2p.chunkstore import ChunkHashMismatch
from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.intake import Intake, StoreError
from echo.p2p.relay.peers import Peers, peer_str
from echo.p2p.relay.transfer import Feed, Transfer
from echo.p2p.rpc import transfer_timeout
from echo.p2p.streams import end_stream, read_exactly, read_frame
from echo.protocol import broadcast as b
from echo.protocol.errors import FrameError, ProtocolError
from echo.protocol.framing import HEADER_LEN, decode_length, encode_frame

log = logging.getLogger(__name__)

# The final acknowledgement of a push, if the parent does not take it within this, is dropped.
_ACK_TIMEOUT_S = 5.0

OpenTransfer = Callable[[b.PushHello], Awaitable[Transfer]]


class Receiver:
    """Handles push streams for one relay (see the module docstring).

    ``open_transfer`` gives the transfer a hello names, verifying its manifest and starting the
    transfer if it is new; ``running`` says whether the relay still takes pushes.
    """

    def __init__(self, config: RelayConfig, peers: Peers, intake: Intake,
                 open_transfer: OpenTransfer, running: Callable[[], bool]) -> None:
        self.config = config
        self.peers = peers
        self.intake = intake
        self._open_transfer = open_transfer
        self._running = running

    async def on_push(self, stream: INetStream) -> None:
        """Serve one inbound push stream until its ``end`` (or until it fails); never raises."""
        peer = peer_str(stream.muxed_conn.peer_id)
        t: Transfer | None = None
        feed: Feed | None = None
        try:
            if peer in self.peers.excluded or not self._running():
                return
            with trio.fail_after(self.config.hello_timeout_s):
                hello = b.decode(b.PushHello, await read_frame(stream, b.MAX_HELLO_BYTES))
            t = await self._open_transfer(hello)
            if t.complete or t.dropped.is_set():
                return
            now = time.monotonic()
            feed = Feed(peer, hello.stripe, trio.CancelScope(), now, now, now)
            t.feeds.append(feed)
            with feed.scope:
                # Acks go out from their own task: a reader that waits on its own writes could
                # deadlock with a parent doing the same on the same connection.
                error: Exception | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ack_writer, stream, feed)
                    try:
                        await self._receive(stream, t, feed)
                        await self._ack(stream, feed.received)  # the final count
                    except Exception as exc:  # re-raised below, outside the nursery's group
                        error = exc
                    finally:
                        nursery.cancel_scope.cancel()
                if error is not None:
                    raise error
        except trio.TooSlowError:
            if t is None:
                log.info("push from %s: no hello in time", peer[-8:])
            else:
                self._lost(t, feed, peer, "push stream silent")
        except ProtocolError as exc:
            if t is None:
                log.info("push from %s refused: %s", peer[-8:], exc)
            elif isinstance(exc, FrameError) and exc.code == "frame_truncated":
                self._lost(t, feed, peer, "push stream cut")  # gone, not lying
            else:
                if feed is not None:
                    feed.state = "bad"
                self.peers.report(t, peer, "protocol", detail=f"{exc.code}: {exc}")
        except StoreError as exc:
            log.error("%s", exc)
            if feed is not None:
                feed.state = "gone"
        except (BaseLibp2pError, OSError) as exc:
            if t is not None:
                self._lost(t, feed, peer, f"push stream failed: {type(exc).__name__}")
        finally:
            if feed is not None and feed.state == "open":
                feed.state = "gone"
            # The parent said end: a clean close both ways; anything else is reset.
            await end_stream(stream, clean=feed is not None and feed.state in ("ended", "lagging"))

    def _lost(self, t: Transfer, feed: Feed | None, peer: str, detail: str) -> None:
        """A parent's push stream broke (the parent died or gave up): pull around it."""
        if feed is not None and feed.state == "open":
            feed.state = "gone"
        self.peers.unreachable(peer)
        if not t.complete and not t.dropped.is_set():
            self.peers.report(t, peer, "stalled", detail=detail)

    async def _receive(self, stream: INetStream, t: Transfer, feed: Feed) -> None:
        """Read chunks until ``end``; verify, store and forward each one."""
        # Safety net only: the watchdog cancels feed.scope long before this on a silent parent.
        silence = 3 * self.config.stall_timeout_s + self.config.idle_interval_s
        while True:
            with trio.fail_after(silence):
                hdr = b.decode(b.PushHeader, await read_frame(stream, b.MAX_HEADER_BYTES))
            now = time.monotonic()
            if hdr.job_id != t.job_id or hdr.version != t.version:
                raise ProtocolError("push header for another version", code="push_header")
            if hdr.op == "idle":
                feed.last_beat = now
                continue
            feed.last_byte = now
            if hdr.op == "end":
                feed.state = "lagging" if hdr.reason == "lagging" else "ended"
                return
            if hdr.index >= t.n:
                raise ProtocolError(f"chunk index {hdr.index} beyond {t.n}", code="push_header")
            ref = t.manifest.chunks[hdr.index]
            with trio.fail_after(transfer_timeout(ref.size, silence)):
                data = await self._read_body(stream, ref.size, feed)
            try:
                await self.intake.accept(t, hdr.index, data, via="push")
            except ChunkHashMismatch:
                t.stats.bad_chunks += 1
                feed.state = "bad"
                self.peers.report(t, feed.peer, "bad_chunk", hdr.index,
                                  "pushed chunk failed its hash")
                return
            feed.last_chunk = feed.last_byte = time.monotonic()
            feed.received += 1
            feed.ack_changed.set()

    @staticmethod
    async def _read_body(stream: INetStream, size: int, feed: Feed) -> bytes:
        """One frame of exactly ``size`` bytes (checked before reading), noting progress."""
        n = decode_length(await read_exactly(stream, HEADER_LEN), size)
        if n != size:
            raise FrameError(f"chunk frame of {n} bytes, the manifest says {size}",
                             code="push_chunk_size")

        def progress() -> None:
            feed.last_byte = time.monotonic()

        return await read_exactly(stream, n, on_progress=progress)

    async def _ack_writer(self, stream: INetStream, feed: Feed) -> None:
        """Send the latest received count whenever it changes (coalescing: one write may cover
        several chunks).

        A write is never abandoned on a timer: it can wait seconds behind bulk data on the same
        connection (a TCP flow in retransmission backoff), and an ack given up on would stall
        the parent's window for good. The feed's scope bounds it (cancelled when the push ends
        or the watchdog cuts a silent parent); a broken stream ends it."""
        sent = 0
        while True:
            feed.ack_changed = trio.Event()
            if feed.received > sent:
                sent = feed.received
                try:
                    await stream.write(self._ack_frame(sent))
                except (BaseLibp2pError, OSError):
                    return
            else:
                await feed.ack_changed.wait()

    @staticmethod
    def _ack_frame(received: int) -> bytes:
        return encode_frame(b.encode(b.PushAck(received=received)), b.MAX_HEADER_BYTES)

    @classmethod
    async def _ack(cls, stream: INetStream, received: int) -> bool:
        """Tell the parent how many chunks arrived on this stream, once at the end (best effort:
        a parent that is gone or has closed its side just does not hear it)."""
        with trio.move_on_after(_ACK_TIMEOUT_S):
            with suppress(BaseLibp2pError, OSError):
                await stream.write(cls._ack_frame(received))
                return True
        return False
