"""The dashboard's live feed: one snapshot built per tick, sent to every viewer as an SSE event.

:class:`LiveFeed` owns the viewers: at most :attr:`LiveFeed.max_operator` operators and
:attr:`LiveFeed.max_public` public viewers at once, counted apart so that strangers holding
every public slot never lock the operator out (a viewer over its cap is refused), each with a
queue of :data:`QUEUE` events. The feed builds a snapshot only
while someone watches, once per tick whatever the number of viewers, so a closed dashboard costs
the coordinator nothing and an open one the same for one viewer or thirty. A viewer whose queue
is full misses that tick (each event is a whole snapshot: the next one replaces it), and one
that missed :data:`MAX_MISSED` ticks in a row is cut off (its channel closes; a browser's
EventSource-style reader reconnects). :func:`sse_stream` turns a subscription into the bytes of
a ``text/event-stream`` response, with a comment line every :data:`HEARTBEAT_S` so proxies keep
the connection open.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger("echo.coordinator.dashboard.live")

TICK_S = 2.0
QUEUE = 4
MAX_MISSED = 15
HEARTBEAT_S = 15.0
MAX_PUBLIC = 32
MAX_OPERATOR = 8


@dataclass
class _Viewer:
    send: trio.MemorySendChannel[bytes]
    public: bool
    missed: int = 0


@dataclass
class _Latest:
    full: bytes = b""
    public: bytes = b""
    at: float = field(default=-1e18)


class LiveFeed:
    """Viewers and the snapshots sent to them; see the module docstring.

    ``build_full`` and ``build_public`` return JSON-ready snapshots (the operator's and the
    public one); they run on the trio thread, as every store read does.
    """

    def __init__(
        self,
        build_full: Callable[[], dict[str, Any]],
        build_public: Callable[[], dict[str, Any]],
        *,
        tick_s: float = TICK_S,
        max_public: int = MAX_PUBLIC,
        max_operator: int = MAX_OPERATOR,
    ) -> None:
        self.build_full = build_full
        self.build_public = build_public
        self.tick_s = tick_s
        self.max_public = max_public
        self.max_operator = max_operator
        self.viewers: list[_Viewer] = []
        self.latest = _Latest()
        self.builds = 0  # snapshots built, and the CPU they took (benchmarks/dashboard.py)
        self.build_cpu_s = 0.0
        self.refused = 0

    def subscribe(self, public: bool) -> trio.MemoryReceiveChannel[bytes] | None:
        """A new viewer's channel, primed with the latest snapshot; None when the feed has as
        many viewers of that kind as its cap (:attr:`max_public`, :attr:`max_operator`)."""
        cap = self.max_public if public else self.max_operator
        if sum(1 for v in self.viewers if v.public == public) >= cap:
            self.refused += 1
            return None
        send, recv = trio.open_memory_channel[bytes](QUEUE)
        if time.monotonic() - self.latest.at > self.tick_s:
            self._build()
        send.send_nowait(self.latest.public if public else self.latest.full)
        self.viewers.append(_Viewer(send, public))
        return recv

    def _build(self) -> None:
        cpu = time.thread_time()
        full = self.build_full()
        public = self.build_public()
        self.latest = _Latest(
            json.dumps(full, separators=(",", ":")).encode(),
            json.dumps(public, separators=(",", ":")).encode(),
            time.monotonic(),
        )
        self.builds += 1
        self.build_cpu_s += time.thread_time() - cpu

    def publish(self) -> None:
        """Build one snapshot and queue it for every viewer (nothing while nobody watches)."""
        self.viewers = [v for v in self.viewers if not _closed(v.send)]
        if not self.viewers:
            return
        self._build()
        for v in list(self.viewers):
            try:
                v.send.send_nowait(self.latest.public if v.public else self.latest.full)
                v.missed = 0
            except trio.WouldBlock:
                v.missed += 1
                if v.missed >= MAX_MISSED:
                    log.info("dashboard viewer cut off: %d ticks unread", v.missed)
                    v.send.close()
                    self.viewers.remove(v)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.viewers.remove(v)

    async def run_forever(self) -> None:
        """Publish every :attr:`tick_s` until cancelled; a failing build is logged, not fatal."""
        while True:
            await trio.sleep(self.tick_s)
            try:
                self.publish()
            except Exception:  # one bad snapshot must not stop the feed (or the coordinator)
                log.exception("dashboard snapshot failed")


def _closed(send: trio.MemorySendChannel[bytes]) -> bool:
    # A viewer that went away closed its receiving end: its stats show no receivers left.
    return send.statistics().open_receive_channels == 0


async def sse_stream(recv: trio.MemoryReceiveChannel[bytes]) -> AsyncIterator[bytes]:
    """The ``text/event-stream`` body for one viewer: each snapshot as a ``snapshot`` event,
    a comment every :data:`HEARTBEAT_S` in between; ends when the feed cuts the viewer off.
    The receiving channel is closed when the stream ends (the client left, or was cut off)."""
    with recv:
        yield b"retry: 3000\n\n"
        while True:
            data = None
            # Only the receive is under the timeout: a yield inside a cancel scope would put
            # the consumer's own send under it too.
            with trio.move_on_after(HEARTBEAT_S):
                try:
                    data = await recv.receive()
                except trio.EndOfChannel:
                    return
            if data is None:
                yield b": keep-alive\n\n"
            else:
                yield b"event: snapshot\ndata: " + data + b"\n\n"
