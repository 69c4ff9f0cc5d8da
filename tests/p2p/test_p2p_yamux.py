"""Reading a yamux connection never waits for its writer (echo.p2p.yamux).

A writer stuck on the connection's write lock is what a full send buffer on a shaped uplink
looks like. Stock py-libp2p yamux then stops reading: the connection's reader waits to answer a
ping, and ``stream.read`` waits to send its window update.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.stream_muxer.yamux.yamux import FLAG_SYN, TYPE_PING, YAMUX_HEADER_FORMAT

from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcError
from echo.p2p.yamux import NonBlockingReaderYamux

PROTO = TProtocol("/echo/test/sink/1")
DEADLINE_S = 30.0


@asynccontextmanager
async def _stream_to(sink) -> AsyncIterator[tuple[EchoHost, EchoHost, INetStream]]:
    """Two hosts, ``a`` serving PROTO with ``sink``, and a stream from ``b`` to it."""
    async with (
        open_host(Identity.generate(), pubsub=False) as a,
        open_host(Identity.generate(), pubsub=False) as b,
    ):
        a.libp2p.set_stream_handler(PROTO, sink)
        await b.connect(a.listen_multiaddrs[0])
        yield a, b, await b.libp2p.new_stream(a.peer_id, [PROTO])


def _run(body) -> None:
    async def main() -> None:
        with trio.fail_after(DEADLINE_S):
            await body()

    trio.run(main)


def test_reads_and_pongs_do_not_wait_for_a_stuck_writer() -> None:
    opened: list[object] = []
    got: list[bytes] = []
    arrived = trio.Event()

    async def sink(stream) -> None:
        opened.append(stream)
        while data := await stream.read(1024):
            got.append(data)
            arrived.set()

    async def body() -> None:
        nonlocal arrived
        async with _stream_to(sink) as (a, b, stream):
            await stream.write(b"first")
            await arrived.wait()
            a_conn, b_conn = opened[0].muxed_conn, stream.muxed_conn
            assert isinstance(a_conn, NonBlockingReaderYamux)

            release = trio.Event()
            held = trio.Event()

            async def stuck_writer() -> None:
                async with a_conn._write_lock:  # a data writer waiting on a full socket
                    held.set()
                    await release.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stuck_writer)
                await held.wait()
                # b pings a (a's reader must answer), then sends more data on the stream
                # (a's stream.read sends a window update for it).
                b_conn._ping_event = trio.Event()
                await b_conn._write_frame(
                    struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0, 7777)
                )
                arrived = trio.Event()
                await stream.write(b"second")
                with trio.fail_after(5):  # stock yamux: stuck behind the writer
                    await arrived.wait()
                assert got == [b"first", b"second"]
                assert not b_conn._ping_event.is_set()  # the pong waits for the writer ...
                release.set()
                with trio.fail_after(5):
                    await b_conn._ping_event.wait()  # ... and goes out once it is free
            await stream.close()

    _run(body)


def test_queued_control_frames_ride_in_the_next_data_write() -> None:
    """A stream's SYN or ACK queued before its first data goes out in the same secured write
    (one Noise message, one send), control frames first."""
    opened: list[object] = []

    async def sink(stream) -> None:
        opened.append(stream)
        while await stream.read(1024):
            pass

    async def body() -> None:
        async with _stream_to(sink) as (_a, _b, stream):
            await stream.write(b"warm")
            conn = stream.muxed_conn
            assert isinstance(conn, NonBlockingReaderYamux)
            writes: list[bytes] = []
            real_write = conn.secured_conn.write

            async def recording_write(data: bytes) -> None:
                writes.append(data)
                await real_write(data)

            conn.secured_conn.write = recording_write  # type: ignore[method-assign]
            ping = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0, 7)
            async with conn._write_lock:  # hold the control writer off while we queue
                conn._control.append(ping)
            await stream.write(b"payload")
            assert len(writes) == 1, writes
            assert writes[0].startswith(ping) and writes[0].endswith(b"payload")
            assert not conn._control

    _run(body)


def test_a_held_peer_is_left_unread_until_its_hold_ends_and_others_are_served() -> None:
    """The coordinator's hold on peers in backoff: the held peer's request is not even seen
    (no stream, nothing refused) while its backoff runs; it is served once it ends, and
    another peer is served meanwhile. Without the hold, the same request is reset at once
    after its negotiation (what a stranger retrying as fast as it is refused costs)."""
    served: list[tuple[str, float]] = []

    async def echo(peer, req: bytes) -> bytes:
        served.append((str(peer), trio.current_time()))
        return req

    async def body() -> None:
        async with (
            open_host(Identity.generate(), pubsub=False) as server,
            open_host(Identity.generate(), pubsub=False) as held,
            open_host(Identity.generate(), pubsub=False) as other,
        ):
            server.set_handler(str(PROTO), echo, max_request=64, max_response=64)
            for h in (held, other):
                await h.connect(server.listen_multiaddrs[0])
            server.gate.backoff_base_s = 1.5
            server.gate.punish(str(held.peer_id))

            async def ask(h: EchoHost, data: bytes, timeout: float) -> bytes:
                return await h.request(
                    server.peer_id, str(PROTO), data, timeout=timeout, max_response=64
                )

            with pytest.raises(RpcError):  # not held yet: reset after its negotiation
                await ask(held, b"x", 5)
            assert server.gate.refused == {str(PROTO): 1} and not served

            server.gate.punish(str(held.peer_id))  # a second strike: 3 s
            ends = trio.current_time() + server.gate.backoff_left(str(held.peer_id))
            server.hold_reads(lambda peer: server.gate.backoff_left(str(peer)))
            async with trio.open_nursery() as nursery:

                async def ask_held() -> None:
                    assert await ask(held, b"h", 10) == b"h"

                nursery.start_soon(ask_held)
                await trio.sleep(0.5)
                assert await ask(other, b"o", 5) == b"o"
            assert [p for p, _ in served] == [str(other.peer_id), str(held.peer_id)]
            assert served[1][1] >= ends - 0.05
            assert server.gate.refused == {str(PROTO): 1}  # the held request was never refused
            muxed = server.libp2p.get_network().connections[held.peer_id][0].muxed_conn
            assert muxed.held_s >= 1.0

    _run(body)
