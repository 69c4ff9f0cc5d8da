"""One-shot request/response over a libp2p stream: one request frame, one response frame.

Wire format (all frames per :mod:`echo.protocol.framing`):

- client -> server: one frame holding the request payload;
- server -> client: one frame whose first byte is a status, ``0`` = ok (the rest is the response
  payload) or ``1`` = error (the rest is a UTF-8 message). Then the server closes the stream.

A handler may be *direct only* (:attr:`HandlerSpec.direct_only`; ``EchoHost.set_handler``'s flag):
bulk data (chunks) never crosses a circuit relay (:mod:`echo.p2p.nat.circuit`), so a request that
arrived over a relayed connection (:func:`is_relayed`) is answered with a ``relayed`` error
instead of running the handler.

Server side (:func:`serve_stream`) owns the inbound stream it is given and always closes or
resets it; it never raises (errors are logged, framing violations are recorded in a
:class:`ViolationLog`). With a :class:`~echo.p2p.budget.Gate`, a stream is admitted against the
peer's budget before its header is read, and the announced body against its byte budget before
the body is read; a refusal resets the stream and puts the peer in backoff. The response is
charged by its size too (:meth:`~echo.p2p.budget.Gate.admit_response`); over budget, the peer
gets a ``rate_limited`` error and a backoff instead of the reply.
Client side (:func:`call`) owns the stream it opens and raises
:class:`RemoteError`, :class:`RpcTimeout`, :class:`RpcConnectionError` or
:class:`~echo.protocol.errors.FrameError`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from echo.p2p.budget import Gate
from echo.p2p.streams import end_stream, read_exactly, read_header, write_frame
from echo.protocol.errors import FrameError, ProtocolError
from echo.protocol.framing import decode_length
from echo.protocol.limits import MAX_FRAME_BYTES

logger = logging.getLogger(__name__)

STATUS_OK = 0
STATUS_ERROR = 1

# Error messages travel back to a possibly hostile client and into its logs: keep them short.
MAX_ERROR_MESSAGE_BYTES = 1024

# Server-side deadlines against slow-loris peers. The request header must arrive within
# REQUEST_HEADER_TIMEOUT of the stream being accepted; the body then gets REQUEST_BODY_BASE_TIMEOUT
# plus its size at MIN_TRANSFER_RATE (64 KiB/s: a 4 MiB request gets ~74 s, far beyond any
# honest volunteer uplink, while one peer cannot pin a handler indefinitely).
REQUEST_HEADER_TIMEOUT = 10.0
REQUEST_BODY_BASE_TIMEOUT = 10.0
MIN_TRANSFER_RATE = 64 * 1024
# How long a handler may run before the server answers "timed out" (the client usually gives up
# earlier with its own timeout). Generous: handlers may do real work (verification, disk).
DEFAULT_HANDLER_TIMEOUT = 120.0
# Generic text for handler crashes: internal details stay in our logs, not on the wire.
INTERNAL_ERROR_MESSAGE = "internal: the handler failed"

# The error code a direct-only handler answers a relayed request with.
RELAYED_CODE = "relayed"
# The error code of a reply refused over the peer's byte budget (the client backs off).
RATE_LIMITED_CODE = "rate_limited"

Handler = Callable[[ID, bytes], Awaitable[bytes]]
ViolationCallback = Callable[[ID, ProtocolError], None]


class RpcError(Exception):
    """Base of everything :func:`call` raises apart from ``FrameError``."""


class RemoteError(RpcError):
    """The server answered with status 1; ``message`` is its (untrusted) text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RpcTimeout(RpcError, TimeoutError):
    """The exchange did not complete within the caller's timeout."""


class RpcConnectionError(RpcError):
    """No stream could be opened / negotiated, or it was reset or closed mid-exchange."""


def transfer_timeout(n_bytes: int, base: float) -> float:
    """``base`` seconds plus ``n_bytes`` at :data:`MIN_TRANSFER_RATE`."""
    return base + n_bytes / MIN_TRANSFER_RATE


class ViolationLog:
    """Per-peer counts of framing violations, plus listeners told of each one.

    Listeners are plain callables ``(peer_id, error)``; one that raises is logged and skipped.
    """

    def __init__(self) -> None:
        self.counts: Counter[ID] = Counter()
        self._listeners: list[ViolationCallback] = []

    def add_listener(self, callback: ViolationCallback) -> None:
        self._listeners.append(callback)

    def record(self, peer_id: ID, error: ProtocolError) -> None:
        self.counts[peer_id] += 1
        logger.info("protocol violation by %s: %s (%s)", peer_id, error, error.code)
        for callback in list(self._listeners):
            try:
                callback(peer_id, error)
            except Exception:
                logger.exception("violation listener %r failed", callback)


@dataclass(frozen=True)
class HandlerSpec:
    """A registered request handler and its limits."""

    handler: Handler
    max_request: int
    max_response: int = MAX_FRAME_BYTES - 1
    handler_timeout: float = DEFAULT_HANDLER_TIMEOUT
    # Refuse requests that arrive over a relayed connection (bulk data: direct connections only).
    direct_only: bool = False
    # Charge the response to the peer's byte budget (Gate.admit_response) before sending it;
    # off for a handler that charges its own bytes (chunks: before it waits on the upload cap).
    charge_response: bool = True


def is_relayed(conn_or_stream: object) -> bool:
    """Whether a stream or connection (swarm connection, muxed connection) runs through a
    circuit relay (:mod:`echo.p2p.nat.circuit`).

    Looks at the connection type py-libp2p records on the raw connection under Noise and yamux
    (both ends mark a circuit RELAYED), not at peerstore addresses."""
    candidates = [conn_or_stream, getattr(conn_or_stream, "muxed_conn", None)]
    for c in candidates:
        get_type = getattr(c, "get_connection_type", None)
        if not callable(get_type):
            continue
        try:
            if get_type() == ConnectionType.RELAYED:
                return True
        except Exception:  # noqa: BLE001 (a half-closed connection: say what we know)
            continue
    return False


def _error_payload(message: str) -> bytes:
    data = message.encode("utf-8", errors="replace")[:MAX_ERROR_MESSAGE_BYTES]
    return bytes([STATUS_ERROR]) + data


def _charged(gate: Gate, peer: str, address: str | None, protocol: str, payload: bytes) -> bytes:
    """``payload`` once its size is charged to the peer's budget for ``protocol``; over budget,
    a ``rate_limited`` error (and a backoff) instead: a small request must not buy a large
    reply for free (a 4 MiB manifest; issue 26, finding 7)."""
    if gate.admit_response(peer, address, protocol, len(payload)):
        return payload
    gate.punish(peer)
    logger.info("%s reply to %s refused: over its byte budget", protocol, peer)
    return _error_payload(f"{RATE_LIMITED_CODE}: over this peer's byte budget for {protocol}")


class OverBudget(Exception):
    """The peer's budget refused the request (see :class:`~echo.p2p.budget.Gate`)."""


def remote_ip(stream: INetStream) -> str | None:
    """The remote IP address of ``stream``'s connection, or None when the transport has none."""
    try:
        addr = stream.get_remote_address()
    except Exception:
        return None
    return str(addr[0]) if addr else None


class Abandoned(Exception):
    """A request stream that ended before its first byte: a client that gave up (its own
    timeout while we were slow to negotiate, a process that stopped), not a malformed frame.
    It has already cost the peer its request budget; it is not booked as a violation (the
    soak at 5 churned identities a second on 2 cores excluded an honest node after five such
    streams: its submissions timed out in protocol negotiation)."""


async def _read_request(
    stream: INetStream, max_request: int, admit_body: Callable[[int], bool] | None = None
) -> bytes:
    """Read the request frame under the slow-loris deadlines; FrameError on any failure,
    OverBudget when ``admit_body(n)`` refuses the announced length (before the body is read)."""
    with trio.move_on_after(REQUEST_HEADER_TIMEOUT) as scope:
        header = await read_header(stream)
        if header is None:
            raise Abandoned("the stream ended before a request began")
    if scope.cancelled_caught:
        raise FrameError("no request header in time", code="frame_timeout")
    n = decode_length(header, max_request)
    if admit_body is not None and not admit_body(n):
        raise OverBudget(f"request of {n} bytes is over the peer's byte budget")
    with trio.move_on_after(transfer_timeout(n, REQUEST_BODY_BASE_TIMEOUT)) as scope:
        body = await read_exactly(stream, n)
    if scope.cancelled_caught:
        raise FrameError(f"request body of {n} bytes not received in time", code="frame_timeout")
    return body


async def _run_handler(spec: HandlerSpec, peer_id: ID, request: bytes, protocol: str) -> bytes:
    """Run the handler; return the full response payload (status byte included)."""
    try:
        with trio.fail_after(spec.handler_timeout):
            response = await spec.handler(peer_id, request)
    except ProtocolError as exc:
        return _error_payload(f"{exc.code}: {exc}")
    except trio.TooSlowError:
        logger.warning("handler for %s timed out after %.0f s", protocol, spec.handler_timeout)
        return _error_payload("internal: the handler timed out")
    except Exception:
        logger.exception("handler for %s failed on a request from %s", protocol, peer_id)
        return _error_payload(INTERNAL_ERROR_MESSAGE)
    if not isinstance(response, bytes | bytearray | memoryview):
        logger.error("handler for %s returned %s, not bytes", protocol, type(response).__name__)
        return _error_payload(INTERNAL_ERROR_MESSAGE)
    if len(response) > spec.max_response:
        logger.error(
            "handler for %s returned %d bytes, over its limit of %d",
            protocol,
            len(response),
            spec.max_response,
        )
        return _error_payload("internal: response too large")
    return bytes([STATUS_OK]) + bytes(response)


async def serve_stream(
    stream: INetStream,
    spec: HandlerSpec,
    violations: ViolationLog,
    gate: Gate | None = None,
    shed: Callable[[ID, str | None], bool] | None = None,
) -> None:
    """Serve one inbound request on ``stream``, then close it. Never raises (except Cancelled).

    With ``gate``, the request is charged to the peer's budget for the stream's protocol first:
    a peer in backoff or over budget has its stream reset before a byte is read. With ``shed``
    (:mod:`echo.p2p.shedding`), a stream it names is reset unread before that.
    """
    peer_id = stream.muxed_conn.peer_id
    protocol = str(stream.get_protocol())
    peer, address = str(peer_id), remote_ip(stream)
    ok = False
    try:
        if shed is not None and shed(peer_id, address):
            return
        admit_body = None
        if gate is not None:
            if gate.in_backoff(peer):
                gate.admit(peer, address, protocol)  # counted as refused, nothing charged
                return
            if not gate.admit(peer, address, protocol):
                gate.punish(peer)
                logger.info("%s from %s refused: over its request budget", protocol, peer)
                return

            def admit_body(n: int) -> bool:
                return gate.admit_bytes(peer, address, protocol, n)

        try:
            request = await _read_request(stream, spec.max_request, admit_body)
        except Abandoned:
            logger.debug("%s from %s: abandoned before the request", protocol, peer_id)
            return
        except FrameError as exc:
            # Booked (its listeners decide what it costs the peer); its bytes were budgeted.
            violations.record(peer_id, exc)
            return
        except OverBudget as exc:
            assert gate is not None
            gate.punish(peer)
            logger.info("%s from %s refused: %s", protocol, peer, exc)
            return
        if spec.direct_only and is_relayed(stream):
            # Answered, not reset: the client learns why and can look for a direct path.
            logger.info("%s from %s refused: it came through a relay", protocol, peer_id)
            payload = _error_payload(
                f"{RELAYED_CODE}: {protocol} is served on direct connections only "
                "(bulk data never crosses a relay)"
            )
        else:
            payload = await _run_handler(spec, peer_id, request, protocol)
            if gate is not None and spec.charge_response:
                payload = _charged(gate, peer, address, protocol, payload)
        with trio.move_on_after(transfer_timeout(len(payload), REQUEST_BODY_BASE_TIMEOUT)) as sc:
            await write_frame(stream, payload, spec.max_response + 1)
        if sc.cancelled_caught:
            logger.info("peer %s did not take its %s response in time", peer_id, protocol)
            return
        ok = True
    except BaseLibp2pError as exc:
        # Reset / closed by the peer (e.g. its client timed out): not a framing violation.
        logger.debug("stream from %s on %s failed: %r", peer_id, protocol, exc)
    except Exception:
        logger.exception("unexpected error serving %s for %s", protocol, peer_id)
    finally:
        await end_stream(stream, clean=ok)


async def call(
    host: IHost,
    peer_id: ID,
    protocol_id: str,
    payload: bytes,
    *,
    timeout: float,
    max_response: int,
    violations: ViolationLog | None = None,
    max_request: int = MAX_FRAME_BYTES,
) -> bytes:
    """Send ``payload`` to ``peer_id`` on ``protocol_id``; return the response payload.

    The whole exchange (stream open, negotiation, request, response) runs under ``timeout``.

    :raises RemoteError: the server answered with status 1.
    :raises RpcTimeout: ``timeout`` passed first.
    :raises RpcConnectionError: no connection / protocol not supported / stream reset or closed
        before a response frame started (a server that refuses a request unread does that).
    :raises FrameError: the request exceeds ``max_request`` (nothing sent), or the response is
        empty, oversized or truncated (recorded in ``violations`` when given).
    """
    if len(payload) > max_request:
        raise FrameError(f"request of {len(payload)} bytes exceeds the limit of {max_request}")
    stream: INetStream | None = None
    ok = False
    try:
        with trio.fail_after(timeout):
            try:
                stream = await host.new_stream(peer_id, [TProtocol(protocol_id)])
                await write_frame(stream, payload, max_request)
                header = await read_header(stream)
                if header is None:
                    # Ended before a response began: the server refused the request unread
                    # (over the peer's budget, in backoff) or went away. A failed call, not a
                    # malformed frame: the caller retries as after any dropped connection.
                    raise RpcConnectionError(
                        f"{protocol_id} to {peer_id}: the stream ended before a response "
                        "(refused, or the server went away)"
                    )
                response = await read_exactly(stream, decode_length(header, max_response + 1))
            except FrameError as exc:
                if violations is not None:
                    violations.record(peer_id, exc)
                raise
            except BaseLibp2pError as exc:
                raise RpcConnectionError(
                    f"{protocol_id} to {peer_id} failed: {type(exc).__name__}: {exc}"
                ) from exc
            ok = True
    except trio.TooSlowError:
        raise RpcTimeout(f"{protocol_id} to {peer_id} timed out after {timeout} s") from None
    finally:
        if stream is not None:
            await end_stream(stream, clean=ok)
    if not response:
        exc = FrameError("empty response frame (no status byte)", code="frame_status")
        if violations is not None:
            violations.record(peer_id, exc)
        raise exc
    status, body = response[0], response[1:]
    if status == STATUS_OK:
        return body
    if status == STATUS_ERROR:
        raise RemoteError(body.decode("utf-8", errors="replace"))
    exc = FrameError(f"unknown response status {status}", code="frame_status")
    if violations is not None:
        violations.record(peer_id, exc)
    raise exc
