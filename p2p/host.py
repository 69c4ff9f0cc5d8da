"""The libp2p host every Echo process runs: TCP + Noise + yamux, stream RPC, optional gossipsub.

:func:`open_host` is an async context manager. It builds a py-libp2p host with exactly one
transport (TCP), one security protocol (Noise: the peer id is authenticated) and one muxer
(yamux: about 5x mplex's throughput here, in :mod:`echo.p2p.yamux`'s variant whose reader never
waits to write); QUIC, secio, TLS and plaintext are not offered. The
host, its pubsub services and all tasks we start run inside the context; leaving it cancels and
closes them all. Which inbound connections the host keeps -- a per-prefix cap at admission,
idle reaping under pressure -- is :attr:`EchoHost.guard`'s (:mod:`echo.p2p.conn_guard`).

Errors raised by :class:`EchoHost` methods: ``ValueError`` for malformed multiaddrs / peer ids,
:class:`~echo.p2p.rpc.RpcTimeout` and :class:`~echo.p2p.rpc.RpcConnectionError` from
:meth:`EchoHost.connect` and :meth:`EchoHost.request`, plus ``RemoteError`` / ``FrameError``
from :meth:`EchoHost.request` (see :mod:`echo.p2p.rpc`), ``RuntimeError`` for pubsub use on a
host opened with ``pubsub=False`` and for any use after the context exited.

Request handlers run in py-libp2p's per-stream tasks (inside the host's service nursery), so
they are cancelled when the host closes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.tools.anyio_service import background_trio_service
from libp2p.transport.tcp.tcp import TCP
from multiaddr import Multiaddr

from echo.p2p.budget import Gate, UploadLimiter
from echo.p2p.conn_guard import ConnectionGuard, GuardPolicy
from echo.p2p.identity import Identity
from echo.p2p.pubsub import PubsubConfig, PubsubService, Subscription, Validator
from echo.p2p.rpc import (
    DEFAULT_HANDLER_TIMEOUT,
    Handler,
    HandlerSpec,
    RpcConnectionError,
    RpcTimeout,
    ViolationCallback,
    ViolationLog,
    call,
    serve_stream,
)
from echo.p2p.yamux import NonBlockingReaderYamux, ReadHold, hold_reads, install_yamux
from echo.protocol.limits import MAX_FRAME_BYTES

logger = logging.getLogger(__name__)

# Loopback with an OS-chosen port: safe default for tests and local runs; deployments pass
# their own addresses (e.g. /ip4/0.0.0.0/tcp/4001).
DEFAULT_LISTEN_ADDRS = ("/ip4/127.0.0.1/tcp/0",)
# Default dial timeout. py-libp2p waits a fixed 0.25 s per dial (happy-eyeballs delay) before
# Noise and yamux negotiation; 10 s leaves room for slow links without hanging a caller.
DEFAULT_CONNECT_TIMEOUT = 10.0
# Pubsub's queue tasks start within milliseconds; a bound so a broken start cannot hang us.
PUBSUB_START_TIMEOUT = 10.0
# Closing a host's connections on the way out of open_host: a few round trips at most.
HOST_CLOSE_TIMEOUT = 5.0
# Open connections a host accepts more from (py-libp2p's own figure: 300 minus 50 kept for
# dialling out).
INBOUND_CONNECTION_CAP = 250
# A response frame carries one status byte before the payload.
_STATUS_LEN = 1


def as_peer_id(peer_id: ID | str) -> ID:
    """``peer_id`` as a libp2p ``ID`` (the host's calls take either form).

    :raises ValueError: if a string is not a base58 peer id.
    """
    if isinstance(peer_id, ID):
        return peer_id
    try:
        return ID.from_base58(peer_id)
    except Exception as exc:
        raise ValueError(f"malformed peer id {peer_id!r}") from exc


class EchoHost:
    """A running libp2p host (only valid inside :func:`open_host`)."""

    def __init__(
        self,
        host: IHost,
        identity: Identity,
        pubsub: PubsubService | None,
        guard: ConnectionGuard | None = None,
    ) -> None:
        self.libp2p = host
        self.identity = identity
        self.pubsub = pubsub
        # Which inbound connections the host keeps (per-prefix cap, idle reaping): the
        # coordinator protects the peers it must keep (guard.protect(peer_id)).
        self.guard = guard or ConnectionGuard(connection_cap=INBOUND_CONNECTION_CAP)
        self._violations = ViolationLog()
        # Every request handler's admission: per-peer and per-prefix budgets, backoff. The
        # defaults are generous; a daemon sets tighter limits per protocol (gate.set_limit).
        self.gate = Gate()
        # Set by echo.p2p.shedding (the coordinator): whose streams are reset unread for now.
        self.shed_stream: Callable[[ID, str | None], bool] | None = None
        # Optional shared cap on what this host uploads to peers (relay pushes and chunks served):
        # set by the relay when its config has an upload limit; chunk serving waits on it too.
        self.upload_limiter: UploadLimiter | None = None
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the host is closed (used after leaving open_host)")

    # -- identity & addresses ---------------------------------------------------------------------

    @property
    def peer_id(self) -> ID:
        return self.libp2p.get_id()

    @property
    def listen_multiaddrs(self) -> list[str]:
        """Full addresses a peer can dial, each ending in ``/p2p/<our peer id>``."""
        return [str(a) for a in self.libp2p.get_addrs()]

    @property
    def tcp_listen_endpoint(self) -> tuple[str, int]:
        """(ip, port) of our first IPv4 TCP listen socket, as bound (``0.0.0.0`` for a wildcard
        listen). A hole punch (:mod:`echo.p2p.nat.holepunch`) dials from it: the SYN must leave from
        the port the NAT maps to our public port.

        :raises ValueError: no IPv4 TCP listener.
        """
        for listener in self.libp2p.get_network().listeners.values():
            for sock_listener in getattr(listener, "listeners", []):
                name = sock_listener.socket.getsockname()
                if sock_listener.socket.family == socket.AF_INET:
                    return str(name[0]), int(name[1])
        raise ValueError("this host has no IPv4 TCP listener")

    def connected_peers(self) -> list[ID]:
        return list(self.libp2p.get_connected_peers())

    # -- connections --------------------------------------------------------------------------

    async def connect(self, multiaddr: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> ID:
        """Dial ``multiaddr`` (which must end in ``/p2p/<peer id>``); return the peer id.

        Noise checks that the remote holds the key of that peer id.

        :raises ValueError: malformed address or no ``/p2p/`` part.
        :raises RpcTimeout: not connected within ``timeout``.
        :raises RpcConnectionError: the dial or the handshake failed.
        """
        self._check_open()
        try:
            info = info_from_p2p_addr(Multiaddr(multiaddr))
        except Exception as exc:
            raise ValueError(f"not a dialable /p2p/ multiaddr: {multiaddr!r}") from exc
        try:
            with trio.fail_after(timeout):
                await self.libp2p.connect(info)
        except trio.TooSlowError:
            raise RpcTimeout(f"connecting to {multiaddr} timed out after {timeout} s") from None
        except (BaseLibp2pError, OSError) as exc:
            raise RpcConnectionError(f"connecting to {multiaddr} failed: {exc}") from exc
        return info.peer_id

    def hold_reads(self, hold: ReadHold) -> None:
        """Leave a peer's connections unread while ``hold(peer_id)`` says so (seconds left), on
        every connection from now on (:func:`echo.p2p.yamux.hold_reads`)."""
        hold_reads(self.libp2p.get_network(), hold)

    async def disconnect(self, peer_id: ID | str) -> None:
        await self.libp2p.disconnect(as_peer_id(peer_id))

    # -- request / response ---------------------------------------------------------------------

    def set_handler(
        self,
        protocol_id: str,
        handler: Handler,
        *,
        max_request: int,
        max_response: int = MAX_FRAME_BYTES - _STATUS_LEN,
        handler_timeout: float = DEFAULT_HANDLER_TIMEOUT,
        direct_only: bool = False,
        charge_response: bool = True,
    ) -> None:
        """Serve ``protocol_id``: ``await handler(peer_id, request) -> response``.

        Requests over ``max_request`` bytes are refused before their body is read, and every
        request is charged to its peer's budget in :attr:`gate` first; so is its response, by
        size, where the gate has a limit for the protocol (``charge_response=False``: the
        handler charges its bytes itself). A handler that raises ``ProtocolError`` sends
        ``"{code}: {message}"`` to the client; any other exception is logged and answered with
        a generic error. With ``direct_only`` (bulk data), a request that came over a
        circuit-relayed connection is answered with a ``relayed`` error.
        """
        spec = HandlerSpec(
            handler, max_request, max_response, handler_timeout, direct_only, charge_response
        )

        async def _stream_handler(stream: INetStream) -> None:
            await serve_stream(stream, spec, self._violations, self.gate, self.shed_stream)

        self.libp2p.set_stream_handler(TProtocol(protocol_id), _stream_handler)

    def remove_handler(self, protocol_id: str) -> None:
        self.libp2p.remove_stream_handler(TProtocol(protocol_id))

    async def request(
        self,
        peer_id: ID | str,
        protocol_id: str,
        payload: bytes,
        *,
        timeout: float,
        max_response: int,
    ) -> bytes:
        """One request/response exchange with a connected (or dialable, known) peer.

        See :func:`echo.p2p.rpc.call` for the errors.
        """
        self._check_open()
        return await call(
            self.libp2p,
            as_peer_id(peer_id),
            protocol_id,
            payload,
            timeout=timeout,
            max_response=max_response,
            violations=self._violations,
        )

    def forget_dial_failures(self, peer_id: ID | str) -> None:
        """Let the next request dial ``peer_id`` at once even if every address failed lately.

        libp2p refuses to dial a peer for 60 s after all its addresses failed; for the one peer
        a caller cannot work without (a node's coordinator, restarted after a crash) that would
        turn a few seconds of restart into a minute of idling, so such callers clear it and pace
        their retries themselves.
        """
        self.libp2p.get_network().unblock_peer(as_peer_id(peer_id))

    # -- violations ---------------------------------------------------------------------------

    @property
    def violations(self) -> Mapping[ID, int]:
        """Framing violations per peer since the host started (missing peers read as 0)."""
        return self._violations.counts

    def add_violation_listener(self, callback: ViolationCallback) -> None:
        """``callback(peer_id, error)`` runs (synchronously) on every framing violation."""
        self._violations.add_listener(callback)

    # -- pubsub ---------------------------------------------------------------------------------

    def _require_pubsub(self) -> PubsubService:
        self._check_open()
        if self.pubsub is None:
            raise RuntimeError("this host was opened with pubsub=False")
        return self.pubsub

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` (signed by our key) on ``topic``; see :class:`PubsubService`."""
        await self._require_pubsub().publish(topic, data)

    async def subscribe(self, topic: str, validator: Validator | None = None) -> Subscription:
        """Subscribe to ``topic``; iterate the result for ``(from_peer_id, data)``."""
        return await self._require_pubsub().subscribe(topic, validator)

    async def wait_for_subscribers(self, topic: str, count: int = 1, timeout: float = 10.0) -> None:
        """Wait until ``count`` peers announced ``topic`` (``trio.TooSlowError`` after timeout)."""
        await self._require_pubsub().wait_for_subscribers(topic, count, timeout)


class LiveConnectionCap:
    """Stands in for py-libp2p's inbound-connection limiter, counting live connections.

    py-libp2p 0.8.1 holds one slot of a ``trio.CapacityLimiter(max - min)`` per inbound
    connection until the whole swarm stops (its handler waits on the swarm's manager, not on
    the connection), so a host accepted 250 inbound connections in its life and refused every
    later one: a coordinator, after its 250th node connection, took no new node. This one
    admits a connection while fewer than ``cap`` are open; ``release`` has nothing to give back.
    """

    def __init__(self, network: object, cap: int) -> None:
        self._network = network
        self.total_tokens = cap

    @property
    def borrowed_tokens(self) -> int:
        conns = getattr(self._network, "connections", {})
        return sum(len(c) for c in list(conns.values()))

    def acquire_nowait(self) -> None:
        if self.borrowed_tokens >= self.total_tokens:
            raise trio.WouldBlock

    def release(self) -> None:
        pass


def _release_inbound_handlers(network: Any) -> None:
    """End each inbound connection's handler task when its connection closes.

    py-libp2p 0.8.1's handler, once the connection is up, waits on the swarm's manager, so one
    task (with its frames and its TCP stream object) stayed parked per connection ever accepted
    until the host stopped: memory grew with the churn of identities (benchmarks/soak.py).
    This handler upgrades the connection the same way (the swarm's ``upgrade_inbound_raw_conn``,
    which the connection guard wraps with its admission) and then waits only for that
    connection's close. trio's listener does not close a stream when its handler returns, so
    the connection lives on as before. py-libp2p's connection gate (allow-all by default, no
    Echo code configures it) is not consulted: the guard's admission stands in for it.
    """

    async def handle(read_write_closer: Any, maddr: Multiaddr, failure_event: Any) -> None:
        raw = RawConnection(read_write_closer, False)
        try:
            muxed = await network.upgrade_inbound_raw_conn(raw, maddr)
        except Exception as exc:  # noqa: BLE001 (a stranger's failed handshake: drop it)
            logger.debug("inbound connection on %s not upgraded: %s", maddr, exc)
            with contextlib.suppress(Exception):
                await raw.close()
            return
        conn = next(
            (c for cs in list(network.connections.values()) for c in cs
             if getattr(c, "muxed_conn", None) is muxed),
            None,
        )
        if conn is not None:
            await conn.event_closed.wait()

    network._do_handle_inbound_connection = handle


def _keep_own_keys(host: IHost) -> None:
    """Keep the host's own entry out of its peerstore's eviction.

    py-libp2p 0.8.1 caps a peerstore at 1,000 peers and evicts entries without addresses
    first, our own among them; the next ``get_public_key`` raised PeerStoreError and the
    coordinator died (benchmarks/soak.py: about 1,000 churned identities in). Our entry is
    set aside while the store evicts, then put back."""
    store: Any = host.get_peerstore()
    own = host.get_id()
    evict = store._enforce_peer_limit

    def enforce() -> None:
        mine = store.peer_data_map.pop(own, None)
        try:
            evict()
        finally:
            if mine is not None:
                store.peer_data_map[own] = mine

    store._enforce_peer_limit = enforce


def _build_libp2p_host(identity: Identity, addrs: Sequence[Multiaddr]) -> IHost:
    install_yamux()
    keypair = identity.libp2p_keypair()
    # Noise's static DH key is separate from the identity key; the handshake signs it with the
    # identity key, which is what binds the session to our peer id.
    noise = NoiseTransport(keypair, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(
        key_pair=keypair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: NonBlockingReaderYamux},
        listen_addrs=list(addrs),
        transports=[TCP()],
    )


def _parse_listen_addrs(listen_addrs: Sequence[str]) -> list[Multiaddr]:
    addrs = []
    for a in listen_addrs:
        try:
            ma = Multiaddr(a)
        except Exception as exc:
            raise ValueError(f"malformed listen address {a!r}") from exc
        names = [p.name for p in ma.protocols()]
        if "tcp" not in names or any(n in names for n in ("quic", "quic-v1", "ws", "wss", "udp")):
            raise ValueError(f"only plain TCP listen addresses are supported, got {a!r}")
        addrs.append(ma)
    if not addrs:
        raise ValueError("at least one listen address is required")
    return addrs


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen_addrs: Sequence[str] = DEFAULT_LISTEN_ADDRS,
    *,
    pubsub: bool = True,
    pubsub_config: PubsubConfig | None = None,
    on_violation: ViolationCallback | None = None,
    guard_policy: GuardPolicy | None = None,
) -> AsyncIterator[EchoHost]:
    """Run a host for ``identity`` listening on ``listen_addrs`` for the duration of the block.

    ``guard_policy`` sets which inbound connections the host keeps (:mod:`echo.p2p.conn_guard`:
    per-prefix caps, idle reaping under pressure; its defaults when None). The guard's reaper
    runs in the host's nursery.

    :raises ValueError: malformed or non-TCP listen addresses.
    """
    addrs = _parse_listen_addrs(listen_addrs)
    host = _build_libp2p_host(identity, addrs)
    network = host.get_network()
    network._inbound_limiter = LiveConnectionCap(network, INBOUND_CONNECTION_CAP)  # type: ignore[attr-defined]
    guard = ConnectionGuard(guard_policy, connection_cap=INBOUND_CONNECTION_CAP)
    guard.install(network)
    _release_inbound_handlers(network)
    _keep_own_keys(host)
    service = PubsubService(host, pubsub_config) if pubsub else None
    echo = EchoHost(host, identity, service, guard)
    if on_violation is not None:
        echo.add_violation_listener(on_violation)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(host.run(addrs))
        if service is not None:
            await stack.enter_async_context(background_trio_service(service.pubsub))
            await stack.enter_async_context(background_trio_service(service.router))
            with trio.fail_after(PUBSUB_START_TIMEOUT):
                await service.pubsub.wait_until_ready()
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        if service is not None:
            service.bind_nursery(nursery)
        nursery.start_soon(guard.run)
        logger.info("host %s listening on %s", echo.peer_id, echo.listen_multiaddrs)
        try:
            yield echo
        finally:
            echo._closed = True
            await _close_connections(host)
    logger.debug("host %s closed", identity.peer_id_str)


async def _close_connections(host: IHost) -> None:
    """Close every connection of ``host`` (bounded by :data:`HOST_CLOSE_TIMEOUT`, shielded: it
    runs on the way out of a cancelled block too). Leaving ``host.run`` does not (py-libp2p
    0.8.1): each host a process opened and left kept its TCP connections, and the peer at the
    other end kept them too -- a coordinator takes at most 250 inbound connections, so a
    churn of short-lived peers (benchmarks/soak.py) shut every later one out."""
    with trio.move_on_after(HOST_CLOSE_TIMEOUT) as scope:
        scope.shield = True
        for peer in list(host.get_network().connections):
            try:
                await host.disconnect(peer)
            except Exception as exc:  # noqa: BLE001 (best effort: the process is leaving it)
                logger.debug("closing the connection to %s: %s", peer, exc)


__all__ = ["DEFAULT_LISTEN_ADDRS", "EchoHost", "open_host"]
