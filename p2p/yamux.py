"""A yamux connection on which reading never waits for writing.

py-libp2p 0.8.1's :class:`~libp2p.stream_muxer.yamux.yamux.Yamux` writes every frame under one
connection lock, held while the socket takes the frame. Two kinds of writes sit on read paths:
the connection's reader task answers pings and acknowledges new streams inline, and
``YamuxStream.read`` sends its window update before it returns the data. Behind a bulk writer
waiting for room on a shaped uplink both wait, for seconds: the reader stops draining the
socket (when both peers push bulk data to each other, both readers stop and the connection
hangs both ways -- the symmetric back-pressure deadlock also reported for rust-yamux), and
every stream reader on the connection stalls with it, including the one that reads a child's
acknowledgements. Seen in ``benchmarks/broadcast.py`` at N=16 (task dumps of the agents):
relays' ``_receive`` and ``_read_acks`` parked on the write lock behind their own pushes until
the stall timers fired.

:class:`NonBlockingReaderYamux` changes one thing: header-only control frames -- window updates
with any flags (SYN, ACK, FIN, RST) and pings -- are queued instead of written inline, and a
separate task of the connection's nursery writes them as soon as the write lock is free, or
sooner, whichever data writer takes the lock next writes them before its own frame, in the same
write. Order holds where it matters: a stream's SYN precedes its first data frame, its FIN
follows its last (the data write returned before ``close`` queued the FIN). Data frames and
GO_AWAY are written as before. Past ``MAX_QUEUED_CONTROL_FRAMES`` a writer waits for the lock
as before (back-pressure, never a dropped frame: a lost window update would stall its stream for
good).

py-libp2p's muxer negotiation builds ``Yamux`` by name, whatever class the host was given for
the yamux protocol, so :func:`install_yamux` points that name at this class;
:func:`echo.p2p.host.open_host` calls it. It changes every yamux connection of the process,
which is the point: any of them can carry bulk data both ways.

**Held reads.** A connection's ``hold_reads`` (set per host by :func:`hold_reads`) says how
long to leave a peer's frames unread: the reader waits it out before its next read, so the
peer's new streams, requests and pings stay in the kernel's buffers and then in the peer's own,
and cost this host nothing, where a stream refused after its multistream negotiation cost a
Noise decryption, two negotiation round trips and a reset each time. The coordinator holds
peers serving a backoff (:mod:`echo.p2p.budget`): a stranger that asks again as soon as it is
refused then waits for its own timeouts instead (issue 26). Frames already read are served;
our writes on the connection go on.

Owns: one control-writer task per connection, in the connection's own nursery (cancelled with
it); a write error ends that task quietly (the reader sees the dead connection and cleans up).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.stream_muxer import muxer_multistream
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE, TYPE_PING, TYPE_WINDOW_UPDATE, Yamux
from multiaddr import Multiaddr

logger = logging.getLogger(__name__)

# A hold: how many more seconds to leave a peer's connections unread (0 or less: read them).
ReadHold = Callable[[ID], float]
# A held reader looks at its hold again at least this often: a hold lifted early, or one that
# grew (the peer punished again meanwhile), is seen within it.
MAX_HOLD_STEP_S = 1.0

# Control frames are 12 bytes; a connection whose socket takes nothing for long enough to queue
# this many (48 KiB) is better slowed down than grown further.
MAX_QUEUED_CONTROL_FRAMES = 4096
_CONTROL_TYPES = (TYPE_WINDOW_UPDATE, TYPE_PING)


def _is_control(frame: bytes) -> bool:
    return len(frame) == HEADER_SIZE and frame[1] in _CONTROL_TYPES


class NonBlockingReaderYamux(Yamux):
    """Yamux whose control frames never wait for the write lock (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._control: deque[bytes] = deque()
        self._control_ready = trio.Event()
        self._control_writer_started = False
        self.hold_reads: ReadHold | None = None
        self.held_s = 0.0  # how long this connection's reader has waited out holds
        self.secured_conn = _HeldReads(self.secured_conn, self)

    async def wait_out_hold(self) -> None:
        """Return once ``hold_reads`` no longer holds our peer, or the connection is closing."""
        hold = self.hold_reads
        if hold is None:
            return
        while not self.event_shutting_down.is_set():
            left = hold(self.peer_id)
            if left <= 0:
                return
            t0 = trio.current_time()
            with trio.move_on_after(min(left, MAX_HOLD_STEP_S)):
                await self.event_shutting_down.wait()
            self.held_s += trio.current_time() - t0

    async def _write_frame(self, data: bytes) -> None:
        if (_is_control(data) and self._nursery is not None
                and len(self._control) < MAX_QUEUED_CONTROL_FRAMES):
            self._control.append(data)
            self._control_ready.set()
            if not self._control_writer_started:
                self._control_writer_started = True
                self._nursery.start_soon(self._control_writer)
            await trio.lowlevel.checkpoint()
            return
        async with self._write_lock:
            # One Noise message and one send for both (a stream's SYN or ACK and its first
            # data, typically): socket sends were 22% of a busy coordinator's wall time.
            frames = self._take_control()
            await self.secured_conn.write(frames + data if frames else data)  # no copy of bulk
        await trio.lowlevel.checkpoint()

    def _take_control(self) -> bytes:
        """The queued control frames, in order, now off the queue (b"" when none)."""
        frames = b"".join(self._control)
        self._control.clear()
        return frames

    async def _flush_control_locked(self) -> None:
        if self._control:
            await self.secured_conn.write(self._take_control())

    async def _control_writer(self) -> None:
        while not self.event_shutting_down.is_set():
            await self._control_ready.wait()
            self._control_ready = trio.Event()
            try:
                async with self._write_lock:
                    await self._flush_control_locked()
            except Exception as exc:  # the connection is gone; its reader reports why
                logger.debug("yamux %s: control writer stops: %r", self.peer_id, exc)
                return


class _HeldReads:
    """The secured connection as the muxer reads it: each read first waits out the muxer's
    hold on its peer; everything else goes straight to the connection."""

    def __init__(self, conn: Any, muxer: NonBlockingReaderYamux) -> None:
        self._conn = conn
        self._muxer = muxer

    async def read(self, n: int | None = None) -> bytes:
        if self._muxer.hold_reads is not None:
            await self._muxer.wait_out_hold()
        return await self._conn.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _HoldNotifee(INotifee):
    """Gives every new connection of a network the host's hold."""

    def __init__(self, hold: ReadHold) -> None:
        self.hold = hold

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        _attach(conn, self.hold)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


def _attach(conn: INetConn, hold: ReadHold) -> None:
    muxed = getattr(conn, "muxed_conn", None)
    if isinstance(muxed, NonBlockingReaderYamux):
        muxed.hold_reads = hold


def hold_reads(network: INetwork, hold: ReadHold) -> None:
    """From now on leave a peer's connections on ``network`` unread for as long as
    ``hold(peer_id)`` says (seconds; it is asked again before each read, so it must be cheap),
    on the connections open now and on every later one. Only yamux connections of this module
    are held (py-libp2p builds every yamux connection with it once :func:`install_yamux` ran).
    """
    network.register_notifee(_HoldNotifee(hold))
    for conns in list(network.connections.values()):
        for conn in conns if isinstance(conns, list) else [conns]:
            _attach(conn, hold)


def install_yamux() -> None:
    """Make py-libp2p build :class:`NonBlockingReaderYamux` for every yamux connection of this
    process (idempotent; raises ``RuntimeError`` if py-libp2p no longer builds yamux by name)."""
    current = getattr(muxer_multistream, "Yamux", None)
    if current is NonBlockingReaderYamux:
        return
    if current is not Yamux:
        raise RuntimeError(
            "libp2p.stream_muxer.muxer_multistream no longer builds Yamux by name; "
            "echo.p2p.yamux needs updating for this py-libp2p version")
    muxer_multistream.Yamux = NonBlockingReaderYamux
