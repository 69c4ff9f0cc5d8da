"""Pushing to children: one task per (stripe, child) of a transfer's route.

Every chunk that arrives here (pushed, pulled, or already in the store) is forwarded at once to
this node's children in that chunk's stripe. Each child has its own task with its own cursor
into the arrival order and at most ``push_window_bytes`` unacknowledged (the bounded per-child
queue; within it, about half a second of what the child acknowledges), so a slow child never
holds up its siblings; a child more than ``max_lag_chunks`` acknowledged chunks behind its
fastest sibling is told ``end(lagging)`` and dropped -- its share of the parent's uplink goes to
the others -- and pulls the rest. A parent with nothing new sends keep-alives (``idle``).

Ownership: the :class:`Pusher` owns the streams it opens (half-closed after ``end``, then
closed; reset on error) and the optional upload token bucket (``upload_limit_bps``; pulls this
node serves are not shaped). A failing child never raises into the caller: its push ends, its
state (``Transfer.child_state``) says how, and the child pulls what it misses.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from echo.p2p.host import EchoHost
from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.intake import Intake
from echo.p2p.relay.peers import Peers
from echo.p2p.relay.transfer import Transfer
from echo.p2p.rpc import RpcError, transfer_timeout
from echo.p2p.streams import end_stream, read_frame
from echo.protocol import broadcast as b
from echo.protocol.errors import ProtocolError
from echo.protocol.framing import encode_frame
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger(__name__)

# Per-child push window: the child's acknowledged rate over the last few seconds, times this,
# between two chunks and RelayConfig.push_window_bytes (see _Acks.window).
_WINDOW_S = 0.5
_RATE_SPAN_S = 3.0
_RATE_MIN_SPAN_S = 0.3
# What ends one child's push stream (logged; the child pulls what it misses).
_PUSH_ERRORS = (trio.TooSlowError, RpcError, BaseLibp2pError, OSError, ValueError)
# After "end", how long a parent waits for the child to acknowledge and close its side.
_CLOSE_TIMEOUT_S = 10.0


@dataclass
class _Acks:
    """What a child acknowledged on one push stream (chunks received, in order sent)."""

    count: int = 0
    sent_bytes: list[int] = field(default_factory=lambda: [0])  # cumulative, per chunk sent
    changed: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)  # the child closed its side

    @property
    def sent(self) -> int:
        return len(self.sent_bytes) - 1

    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, bytes acked)

    @property
    def unacked(self) -> int:
        return self.sent_bytes[-1] - self.sent_bytes[self.count]

    def acked(self, count: int) -> None:
        self.count = count
        now = time.monotonic()
        self.history.append((now, self.sent_bytes[count]))
        while len(self.history) > 2 and now - self.history[1][0] > _RATE_SPAN_S:
            self.history.popleft()
        self.changed.set()
        self.changed = trio.Event()

    def window(self, floor: int, ceiling: int) -> int:
        """Bytes that may be unacknowledged: what the child took in the last ``_WINDOW_S``
        (its acknowledged rate), between ``floor`` and ``ceiling``. Everything beyond sits in
        send buffers, where it delays every control frame on the same connection (acks, pull
        requests, stream opens) by as long as it takes to drain."""
        if len(self.history) < 2 or self.history[-1][0] - self.history[0][0] < _RATE_MIN_SPAN_S:
            return floor  # until the child's rate shows: two chunks
        (t0, b0), (t1, b1) = self.history[0], self.history[-1]
        rate = (b1 - b0) / (t1 - t0)
        return int(min(ceiling, max(floor, rate * _WINDOW_S)))


class Pusher:
    """Pushes the transfers of one relay to their children (see the module docstring)."""

    def __init__(self, host: EchoHost, config: RelayConfig, peers: Peers, intake: Intake) -> None:
        self.host = host
        self.config = config
        self.peers = peers
        self.intake = intake
        # Chunk bytes pushed to children over the relay's life (all transfers).
        self.pushed_out_total = 0

    async def push_to(self, t: Transfer, stripe: int, child: b.PeerAddr) -> None:
        """Push every chunk of ``stripe`` to ``child`` as it becomes available here."""
        key = (stripe, child.peer_id)
        t.cursors[key] = 0
        t.child_state[key] = "connecting"
        stream: INetStream | None = None
        ok = False
        cfg = self.config
        try:
            with trio.fail_after(cfg.connect_timeout_s):
                await self.peers.connect(child.peer_id, direct=True)  # never via a relay
                stream = await self.host.libp2p.new_stream(
                    ID.from_base58(child.peer_id), [TProtocol(b.PROTO_PUSH)]
                )
            hello = b.PushHello(
                job_id=t.job_id,
                version=t.version,
                stripe=stripe,
                stripes=t.stripes,
                manifest=t.envelope,
                weights=t.weights,
            )
            await self._write(stream, encode_frame(b.encode(hello), b.MAX_HELLO_BYTES))
            t.child_state[key] = "pushing"
            acks = _Acks()
            error: BaseException | None = None
            reason = "shutdown"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_acks, stream, t, key, acks)
                try:
                    reason = await self._push_stripe(t, stripe, key, stream, acks)
                    end = b.PushHeader(op="end", job_id=t.job_id, version=t.version, reason=reason)
                    await self._write(stream, encode_frame(b.encode(end), b.MAX_HEADER_BYTES))
                    # Half-close and let the child acknowledge what is in flight and close its
                    # side: closing both ways now would make its late acks draw a reset, and a
                    # reset discards what it has not read yet.
                    with trio.move_on_after(_CLOSE_TIMEOUT_S):
                        await stream.close_write()
                        await acks.ended.wait()
                except _PUSH_ERRORS as exc:  # re-raised below, outside the nursery's group
                    error = exc
                finally:
                    nursery.cancel_scope.cancel()
            if error is not None:
                raise error
            t.child_state[key] = reason
            ok = True
            if reason == "lagging":
                log.info(
                    "%s v%d: child %s lags its siblings; it will pull",
                    t.job_id,
                    t.version,
                    child.peer_id[-8:],
                )
        except _PUSH_ERRORS as exc:
            if t.child_state[key] == "pushing" and t.cursors[key] >= t.stripe_size(stripe):
                # Everything arrived; the child, complete, reset the stream before our "end".
                t.child_state[key] = "done"
            else:
                t.child_state[key] = "failed"
                log.info(
                    "%s v%d: pushing stripe %d to %s stopped: %r",
                    t.job_id,
                    t.version,
                    stripe,
                    child.peer_id[-8:],
                    exc,
                )
        finally:
            if stream is not None:
                await end_stream(stream, clean=ok)

    async def _push_stripe(
        self, t: Transfer, stripe: int, key: tuple[int, str], stream: INetStream, acks: _Acks
    ) -> str:
        """The push loop: chunks in arrival order, at most ``push_window_bytes`` unacknowledged.
        Returns the end reason (``done``, ``lagging``, ``shutdown``).

        :raises trio.TooSlowError: the child acknowledged nothing for ``stall_timeout_s``.
        """
        cfg = self.config
        total, pos = t.stripe_size(stripe), 0
        while acks.sent < total:
            changed = t.changed
            while pos < len(t.order):
                i = t.order[pos]
                pos += 1
                if t.stripe_of(i) != stripe:
                    continue
                ref = t.manifest.chunks[i]
                if not await self._window_open(t, stripe, key, acks, ref.size):
                    return "lagging"
                data = self.intake.chunk(ref.sha256)
                if data is None:  # pruned under us: the child pulls it elsewhere
                    return "shutdown"
                hdr = b.PushHeader(op="chunk", job_id=t.job_id, version=t.version, index=i)
                if t.stats.first_push_at is None:
                    t.stats.first_push_at = time.monotonic()
                # Counted as sent before the write returns: the child may acknowledge it first.
                acks.sent_bytes.append(acks.sent_bytes[-1] + len(data))
                await self._write(
                    stream,
                    encode_frame(b.encode(hdr), b.MAX_HEADER_BYTES)
                    + encode_frame(data, MAX_CHUNK_BYTES),
                )
                t.stats.pushed_out_bytes += len(data)
                self.pushed_out_total += len(data)
                if acks.sent < total and self._lagging(t, stripe, key):
                    return "lagging"
            if acks.sent >= total:
                break
            with trio.move_on_after(cfg.idle_interval_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                hdr = b.PushHeader(op="idle", job_id=t.job_id, version=t.version)
                await self._write(stream, encode_frame(b.encode(hdr), b.MAX_HEADER_BYTES))
        return "done"

    async def _window_open(
        self, t: Transfer, stripe: int, key: tuple[int, str], acks: _Acks, size: int
    ) -> bool:
        """Wait until ``size`` more bytes fit the child's window; False if it lags meanwhile."""
        cfg = self.config
        last_ack = time.monotonic()
        floor = 2 * max(size, 1)
        while acks.unacked + size > acks.window(floor, cfg.push_window_bytes) and acks.unacked > 0:
            if self._lagging(t, stripe, key):
                return False
            changed, before = acks.changed, acks.count
            with trio.move_on_after(min(1.0, cfg.idle_interval_s)):
                await changed.wait()
            if acks.count > before:
                last_ack = time.monotonic()
            elif time.monotonic() - last_ack > cfg.stall_timeout_s:
                raise trio.TooSlowError
        return True

    @staticmethod
    async def _read_acks(
        stream: INetStream, t: Transfer, key: tuple[int, str], acks: _Acks
    ) -> None:
        """Read the child's acknowledgements until the stream ends (errors end it quietly)."""
        try:
            while True:
                ack = b.decode(b.PushAck, await read_frame(stream, b.MAX_HEADER_BYTES))
                if ack.received > acks.sent:
                    log.info("push ack for %d chunks, only %d sent", ack.received, acks.sent)
                    return
                if ack.received > acks.count:
                    acks.acked(ack.received)
                    t.cursors[key] = ack.received
                    t.stats.last_ack_at = t.acked_at[key] = time.monotonic()
        except (ProtocolError, BaseLibp2pError, OSError):
            return
        except Exception:  # never let the reader take the sender down with it
            log.debug("reading push acks failed", exc_info=True)
            return
        finally:
            acks.ended.set()

    async def _write(self, stream: INetStream, data: bytes) -> None:
        # The host's upload cap (set by Relay.run from upload_limit_bps), shared with the
        # chunks this host serves to pullers.
        limiter = self.host.upload_limiter
        if limiter is not None:
            await limiter.take(len(data))
        with trio.fail_after(transfer_timeout(len(data), self.config.write_base_timeout_s)):
            await stream.write(data)

    def _lagging(self, t: Transfer, stripe: int, key: tuple[int, str]) -> bool:
        lag = self.config.max_lag_chunks
        if lag <= 0:
            return False
        best = max(c for (s, _), c in t.cursors.items() if s == stripe)
        return best - t.cursors[key] > lag
