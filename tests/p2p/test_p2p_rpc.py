"""Stream RPC between two real hosts on loopback: round trips, errors, limits, violations."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from echo.p2p import rpc
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError, RpcConnectionError, RpcTimeout
from echo.protocol.errors import FrameError, ProtocolError, SchemaError

PROTO = "/echo/test/rpc/1"
MAX_REQ = 4 * 1024 * 1024
# Every test runs under this many seconds of wall time, whatever goes wrong.
TEST_DEADLINE = 30.0


def run_pair(
    body: Callable[[EchoHost, EchoHost, ID], Awaitable[None]],
    *,
    on_violation: Callable[[ID, ProtocolError], None] | None = None,
) -> None:
    """Start client ``a`` and server ``b`` (serving PROTO), connect a -> b, run ``body``."""

    async def handler(peer: ID, request: bytes) -> bytes:
        if request == b"schema":
            raise SchemaError("field x is missing")
        if request == b"crash":
            raise RuntimeError("secret internal detail")
        if request == b"hang":
            await trio.sleep_forever()
        if request == b"huge":
            return bytes(2 * 1024 * 1024)
        return request[::-1]

    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with (
                open_host(Identity.generate(), pubsub=False) as a,
                open_host(Identity.generate(), pubsub=False, on_violation=on_violation) as b,
            ):
                b.set_handler(PROTO, handler, max_request=MAX_REQ)
                peer = await a.connect(b.listen_multiaddrs[0], timeout=5)
                assert peer == b.peer_id
                await body(a, b, peer)

    trio.run(main)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def test_round_trips_small_and_large() -> None:
    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        small = os.urandom(1024)
        assert await a.request(peer, PROTO, small, timeout=5, max_response=2048) == small[::-1]
        big = os.urandom(3 * 1024 * 1024)
        got = await a.request(peer, PROTO, big, timeout=20, max_response=MAX_REQ)
        assert got == big[::-1]
        assert await a.request(str(peer), PROTO, b"", timeout=5, max_response=10) == b""
        assert not a.violations and not b.violations

    run_pair(body)


def test_remote_errors() -> None:
    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        with pytest.raises(RemoteError) as info:
            await a.request(peer, PROTO, b"schema", timeout=5, max_response=100)
        assert info.value.message == "schema: field x is missing"
        with pytest.raises(RemoteError) as info:
            await a.request(peer, PROTO, b"crash", timeout=5, max_response=100)
        assert "secret" not in info.value.message
        # The server keeps serving.
        assert await a.request(peer, PROTO, b"ok", timeout=5, max_response=100) == b"ko"

    run_pair(body)


def test_timeout_then_next_request_works() -> None:
    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        with trio.fail_after(3):
            with pytest.raises(RpcTimeout):
                await a.request(peer, PROTO, b"hang", timeout=0.3, max_response=100)
        assert await a.request(peer, PROTO, b"ab", timeout=5, max_response=100) == b"ba"

    run_pair(body)


def test_client_side_limits() -> None:
    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        # A response over max_response is a framing error by the server.
        with pytest.raises(FrameError):
            await a.request(peer, PROTO, b"huge", timeout=5, max_response=1024)
        assert a.violations[peer] == 1
        # Unknown protocol: negotiation fails.
        with pytest.raises(RpcConnectionError):
            await a.request(peer, "/echo/none/1", b"x", timeout=5, max_response=10)
        assert await a.request(peer, PROTO, b"xy", timeout=5, max_response=10) == b"yx"

    run_pair(body)


def test_a_request_refused_unread_is_a_failed_call_not_a_violation() -> None:
    """A server that ends the stream without a response (as ``serve_stream`` does to a peer over
    its request budget) makes the call fail with RpcConnectionError, which every caller retries:
    it was a FrameError, which no node loop caught, and a fast node exited on it."""

    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        silent = "/echo/test/silent/1"

        async def refuse(stream) -> None:
            await stream.close()

        b.libp2p.set_stream_handler(TProtocol(silent), refuse)
        for _ in range(2):
            with pytest.raises(RpcConnectionError, match="ended before a response"):
                await a.request(peer, silent, b"x", timeout=5, max_response=10)
        assert not a.violations  # nothing malformed was received
        assert await a.request(peer, PROTO, b"ok", timeout=5, max_response=10) == b"ko"

    run_pair(body)


async def _raw_stream_exchange(a: EchoHost, peer: ID, data: bytes, close: bool) -> bytes:
    """Write raw bytes on a fresh PROTO stream; return what the server sends before it ends."""
    stream = await a.libp2p.new_stream(peer, [TProtocol(PROTO)])
    await stream.write(data)
    if close:
        await stream.close()
    received = b""
    with trio.fail_after(5):
        try:
            while chunk := await stream.read(1024):
                received += chunk
        except StreamError:  # StreamEOF or StreamReset: the server ended the stream
            pass
    await stream.reset()
    return received


def test_oversized_length_prefix_is_a_violation() -> None:
    seen: list[tuple[ID, ProtocolError]] = []

    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        header = (MAX_REQ + 1).to_bytes(4, "big")
        received = await _raw_stream_exchange(a, peer, header + bytes(1000), close=False)
        assert received == b""  # no response, the stream was reset
        await wait_for(lambda: b.violations.get(a.peer_id) == 1)
        assert seen and seen[0][0] == a.peer_id and seen[0][1].code == "frame_too_large"
        assert await a.request(peer, PROTO, b"still", timeout=5, max_response=10) == b"llits"

    run_pair(body, on_violation=lambda p, e: seen.append((p, e)))


def test_truncated_frame_is_a_violation() -> None:
    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        received = await _raw_stream_exchange(
            a, peer, (100).to_bytes(4, "big") + bytes(10), close=True
        )
        assert received == b""
        await wait_for(lambda: b.violations.get(a.peer_id) == 1)
        assert await a.request(peer, PROTO, b"alive", timeout=5, max_response=10) == b"evila"

    run_pair(body)


def test_a_stream_abandoned_before_its_request_is_not_a_violation() -> None:
    """A client that gives up before sending a byte (its timeout while an overloaded server
    negotiated) is not booked: five such streams excluded an honest node in the soak. One
    byte, then nothing, still is a truncated frame."""

    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        for _ in range(3):
            assert await _raw_stream_exchange(a, peer, b"", close=True) == b""
        assert await a.request(peer, PROTO, b"alive", timeout=5, max_response=10) == b"evila"
        assert not b.violations
        await _raw_stream_exchange(a, peer, b"\x00", close=True)
        await wait_for(lambda: b.violations.get(a.peer_id) == 1)

    run_pair(body)


def test_slow_loris_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc, "REQUEST_HEADER_TIMEOUT", 0.3)

    async def body(a: EchoHost, b: EchoHost, peer: ID) -> None:
        start = trio.current_time()
        received = await _raw_stream_exchange(a, peer, b"\x00\x00", close=False)
        assert received == b"" and trio.current_time() - start < 3
        await wait_for(lambda: b.violations.get(a.peer_id) == 1)
        assert await a.request(peer, PROTO, b"ok", timeout=5, max_response=10) == b"ko"

    run_pair(body)
