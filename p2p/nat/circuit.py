"""Circuit relay v2 (issue 14), client side and addresses: a node behind NAT keeps a slot on a
relay, and others reach it through that relay.

A node behind a NAT router (endpoint-independent or symmetric) cannot be dialled. It keeps an
outbound connection to a public *relay* (the coordinator, or a volunteer that can be dialled)
and a *reservation* on it; anyone can then reach the node at its *circuit address*
``<relay addr>/p2p/<relay id>/p2p-circuit/p2p/<node id>``: the dialler asks the relay to
CONNECT, the relay opens a STOP stream to the node over the node's own connection, and from
then on the relay copies bytes between the two streams. Noise and yamux run end to end inside
that pipe, so the relay sees ciphertext and cannot forge the node's identity. The relay's side
(the hop handler a public host runs: ``RelayLimits``, ``offer_relay``) is
:mod:`echo.p2p.nat.circuit_relay`.

Relayed connections carry control messages only. Bulk chunks travel on direct connections:
:func:`is_relayed` tells a chunk server (or any handler given the stream) that a stream or
connection runs through a relay, and :func:`has_direct_connection` tells a requester whether
it has a direct path. The relay's per-circuit data and duration limits are the backstop.

**Built on py-libp2p 0.8.1's ``libp2p.relay.circuit_v2``** (the wire protocol: protobufs,
length-delimited framing, the CONNECT/STOP handshake, the inbound upgrade of a relayed
stream). Measured in netem_nat's internet (``tests/nat/test_circuit_relay.py``) it works with our
host (TCP + Noise + our yamux variant). What is worked around on this side, and why (the
relay's workarounds are listed in :mod:`echo.p2p.nat.circuit_relay`):

- ``CircuitV2Transport`` (the client) reserves a slot on the relay every time it *dials*
  through it (client role), stores circuit addresses in the peerstore with a ~68-year TTL,
  tries those first with unbounded reads, and sends the non-spec ``peer`` field on RESERVE;
  and the swarm cannot take it as a transport (its ``dial`` returns an upgraded connection,
  which the swarm rejects: ``TypeError('Expected an IRawConnection to upgrade')``). The client
  side here (:func:`reserve`, :func:`dial_circuit`) speaks the same messages directly, every
  wait bounded;
- the library's STOP handler accepts a relayed connection from any relay; a node here accepts
  one only from a relay it holds a reservation with (:func:`keep_reservation`).

API:

- NAT side: ``async with keep_reservation(host, relay_addr) as res`` connects, reserves (raises
  :class:`RelayRefused` if refused), refreshes at half the remaining TTL and at once when the
  connection to the relay drops, and accepts relayed connections from that relay;
  ``res.circuit_addr`` is what to announce;
- dialler: ``await dial_circuit(host, circuit_addr)`` (or :func:`circuit_addr` to build one);
- :func:`is_relayed` (defined in :mod:`echo.p2p.rpc`, whose direct-only handlers use it),
  :func:`has_direct_connection`, and :func:`dial_direct` for a direct connection to a peer
  that may already be reached through a relay.

Owns: the STOP handler (while any ``keep_reservation`` block of the host is open) and the
refresh task; leaving a block removes its handler and cancels its refresh task. Relayed
connections themselves belong to the swarm (closed with the host, by ``EchoHost.disconnect``,
or when the relay resets the circuit).

Errors: ``ValueError`` for malformed addresses; :class:`RelayRefused` (an
:class:`~echo.p2p.rpc.RpcConnectionError`, with the relay's :class:`StatusCode`) when the relay
answered no; :class:`~echo.p2p.rpc.RpcTimeout` and :class:`~echo.p2p.rpc.RpcConnectionError`
for timeouts and broken connections.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from echo.p2p.host import EchoHost, as_peer_id
from echo.p2p.rpc import RpcConnectionError, RpcTimeout, is_relayed
from echo.p2p.streams import close_quietly, reset_quietly, stream_peer

log = logging.getLogger(__name__)

# Reserve / dial defaults: a relay round trip plus Noise and yamux inside the circuit (~0.1-0.5 s
# on a busy 2-core machine, see the measurements in tests/nat/test_circuit_relay.py).
DEFAULT_TIMEOUT_S = 10.0
# A STOP stream must be upgraded (Noise + yamux through the relay) within this.
STOP_UPGRADE_TIMEOUT_S = 20.0
# Closing a stream on the way out: a frame or two.
CLOSE_TIMEOUT_S = 2.0
# keep_reservation: refresh when half of the reservation's remaining time has passed (measured
# on our monotonic clock from the relay's answer, so clock skew between the two only moves the
# refresh earlier, or later by at most the skew); look at the connection to the relay this
# often (a dropped connection loses the reservation on the relay at once); retry a failed
# refresh after a backoff that doubles up to RETRY_MAX_S.
REFRESH_FRACTION = 0.5
MIN_REFRESH_S = 1.0
CHECK_INTERVAL_S = 5.0
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
_CIRCUIT = "/p2p-circuit"


class RelayRefused(RpcConnectionError):
    """The relay answered with a status other than OK (``status``: the relay's code, e.g.
    RESOURCE_LIMIT_EXCEEDED for a reservation over its limit, NO_RESERVATION for a dial to a
    peer that holds none, PERMISSION_DENIED for a peer the relay does not admit)."""

    def __init__(self, message: str, status: StatusCode) -> None:
        super().__init__(message)
        self.status = status


# -- addresses & connection kinds ----------------------------------------------------------------


def circuit_addr(relay_addr: str, peer_id: ID | str) -> str:
    """``<relay_addr>/p2p-circuit/p2p/<peer_id>``; ``relay_addr`` must end in ``/p2p/<relay>``.

    :raises ValueError: malformed address or peer id, or a relay address without ``/p2p/``.
    """
    pid = as_peer_id(peer_id)
    try:
        info = info_from_p2p_addr(Multiaddr(relay_addr))
    except Exception as exc:
        raise ValueError(f"not a dialable /p2p/ relay address: {relay_addr!r}") from exc
    if _CIRCUIT in relay_addr:
        raise ValueError(f"relay address {relay_addr!r} is itself a circuit address")
    if info.peer_id == pid:
        raise ValueError("a peer cannot be its own relay")
    return f"{relay_addr}{_CIRCUIT}/p2p/{pid}"


def parse_circuit_addr(addr: str) -> tuple[str, ID, ID]:
    """``(relay_addr, relay_id, peer_id)`` of a circuit address.

    :raises ValueError: not ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>``.
    """
    relay_part, sep, tail = addr.partition(_CIRCUIT)
    if not sep or not tail.startswith("/p2p/") or tail.count("/") != 2:
        raise ValueError(f"not a circuit address <relay>/p2p-circuit/p2p/<peer>: {addr!r}")
    try:
        relay = info_from_p2p_addr(Multiaddr(relay_part)).peer_id
        peer = ID.from_base58(tail[len("/p2p/") :])
    except Exception as exc:
        raise ValueError(f"malformed circuit address {addr!r}") from exc
    if relay == peer:
        raise ValueError(f"circuit address {addr!r} names the relay as its target")
    return relay_part, relay, peer


def has_direct_connection(host: EchoHost, peer_id: ID | str) -> bool:
    """Whether ``host`` holds a connection to ``peer_id`` that does not run through a relay."""
    conns = host.libp2p.get_network().connections.get(as_peer_id(peer_id), [])
    return any(not is_relayed(c) for c in conns)


async def dial_direct(host: EchoHost, addr: str, timeout: float = DEFAULT_TIMEOUT_S) -> ID:
    """Connect to the peer at ``addr`` (``.../p2p/<peer id>``, not a circuit) over a direct
    connection; return the peer id. Where one is up already nothing is dialled. Where the
    peer is reached only through a relay, a new connection is dialled beside that one:
    ``EchoHost.connect`` would take the relayed connection as it is, and bulk data, a LAN
    path or a parent's way in needs the direct one.

    :raises ValueError: a malformed or a circuit address.
    :raises RpcTimeout: not connected within ``timeout``.
    :raises RpcConnectionError: the dial or the handshake failed.
    """
    if _CIRCUIT in addr:
        raise ValueError(f"a circuit address, not a direct one: {addr!r}")
    try:
        ma = Multiaddr(addr)
        peer = info_from_p2p_addr(ma).peer_id
    except Exception as exc:
        raise ValueError(f"not a dialable /p2p/ multiaddr: {addr!r}") from exc
    if has_direct_connection(host, peer):
        return peer
    if not host.libp2p.get_network().connections.get(peer):
        return await host.connect(addr, timeout=timeout)
    try:
        with trio.fail_after(timeout):
            await host.libp2p.get_network().dial_addr(ma, peer)
    except trio.TooSlowError:
        raise RpcTimeout(f"dialling {addr} timed out after {timeout:g} s") from None
    except (BaseLibp2pError, OSError) as exc:
        raise RpcConnectionError(f"dialling {addr} failed: {exc}") from exc
    return peer


# -- client side: reserve, keep, dial ------------------------------------------------------------


@dataclass
class ReservationInfo:
    relay_id: ID
    expire_unix: int  # the relay's clock
    ttl_s: float  # as seen on receipt: expire_unix - our time.time(), at least MIN_REFRESH_S*2
    circuit_duration_s: int  # the relay's per-circuit limits (0: none)
    circuit_data_bytes: int
    relay_addrs: list[str] = field(default_factory=list)


async def _open_hop(host: EchoHost, relay_id: ID) -> INetStream:
    try:
        return await host.libp2p.new_stream(relay_id, [HOP_PROTOCOL_ID])
    except Exception as exc:
        raise RpcConnectionError(f"no hop stream to relay {relay_id}: {exc}") from exc


async def reserve(
    host: EchoHost, relay_id: ID | str, timeout: float = DEFAULT_TIMEOUT_S
) -> ReservationInfo:
    """One RESERVE exchange with a relay ``host`` is connected to (or can dial).

    :raises RelayRefused: the relay said no (over its limit, not admitted).
    :raises RpcTimeout: no answer within ``timeout``.
    :raises RpcConnectionError: no stream, or the stream broke.
    """
    rid = as_peer_id(relay_id)
    try:
        with trio.fail_after(timeout):
            stream = await _open_hop(host, rid)
            try:
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                resp = await read_delimited_msg(stream, HopMessage)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise RpcConnectionError(f"reserving on {rid}: {exc!r}") from exc
            finally:
                await close_quietly(stream, CLOSE_TIMEOUT_S)
    except trio.TooSlowError:
        raise RpcTimeout(f"reserving on relay {rid} timed out after {timeout} s") from None
    status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
    if status != StatusCode.OK or not resp.HasField("reservation"):
        raise RelayRefused(f"relay {rid} refused the reservation: {status.name}", status)
    addrs = []
    for raw in resp.reservation.addrs:
        try:
            addrs.append(str(Multiaddr(bytes(raw))))
        except Exception:  # noqa: BLE001 (an address we cannot read is no use to us)
            continue
    seen = resp.reservation.expire - time.time()
    return ReservationInfo(
        relay_id=rid,
        expire_unix=int(resp.reservation.expire),
        ttl_s=max(seen, 2 * MIN_REFRESH_S),
        circuit_duration_s=int(resp.limit.duration) if resp.HasField("limit") else 0,
        circuit_data_bytes=int(resp.limit.data) if resp.HasField("limit") else 0,
        relay_addrs=addrs,
    )


class _StopAcceptor:
    """The STOP handler of one host: accepts relayed connections from relays the host holds a
    reservation with (the library's accepts them from any relay)."""

    def __init__(self, host: IHost) -> None:
        self._proto = CircuitV2Protocol(host)  # only its STOP handling is used; never run
        self.relays: Counter[ID] = Counter()
        self.accepted = 0
        self.refused = 0

    async def handle(self, stream: INetStream) -> None:
        relay = stream_peer(stream)
        if self.relays[relay] <= 0 or is_relayed(stream):
            self.refused += 1
            log.debug("circuit: STOP from %s refused (no reservation with it)", relay)
            await reset_quietly(stream, CLOSE_TIMEOUT_S)
            return
        with trio.move_on_after(STOP_UPGRADE_TIMEOUT_S) as scope:
            await self._proto._handle_stop_stream(stream)
            self.accepted += 1
        if scope.cancelled_caught:
            await reset_quietly(stream, CLOSE_TIMEOUT_S)


_acceptors: weakref.WeakKeyDictionary[IHost, _StopAcceptor] = weakref.WeakKeyDictionary()


def _allow_relay(host: EchoHost, relay_id: ID) -> _StopAcceptor:
    acc = _acceptors.get(host.libp2p)
    if acc is None:
        acc = _acceptors[host.libp2p] = _StopAcceptor(host.libp2p)
    if sum(acc.relays.values()) == 0:
        host.libp2p.set_stream_handler(STOP_PROTOCOL_ID, acc.handle)
    acc.relays[relay_id] += 1
    return acc


def _disallow_relay(host: EchoHost, relay_id: ID) -> None:
    acc = _acceptors.get(host.libp2p)
    if acc is None:
        return
    acc.relays[relay_id] -= 1
    if acc.relays[relay_id] <= 0:
        del acc.relays[relay_id]
    if not acc.relays:
        host.libp2p.remove_stream_handler(STOP_PROTOCOL_ID)


@dataclass
class Reservation:
    """A reservation :func:`keep_reservation` keeps (read-only for callers)."""

    relay_addr: str
    relay_id: ID
    circuit_addr: str  # announce this: where others reach us
    info: ReservationInfo
    active: bool = True  # False after an expiry or a lost connection, until the next success
    refreshes: int = 0
    failures: int = 0
    last_error: str = ""
    reserved_in_s: float = 0.0  # connect + first RESERVE
    _renew_at: float = 0.0  # trio clock


def _renew_after(info: ReservationInfo) -> float:
    return max(MIN_REFRESH_S, info.ttl_s * REFRESH_FRACTION)


async def _connect_and_reserve(host: EchoHost, res: Reservation, timeout: float) -> None:
    if res.relay_id not in host.libp2p.get_network().connections:
        host.forget_dial_failures(res.relay_id)
        await host.connect(res.relay_addr, timeout=timeout)
    res.info = await reserve(host, res.relay_id, timeout)
    res._renew_at = trio.current_time() + _renew_after(res.info)
    res.active = True


async def _keep(host: EchoHost, res: Reservation, timeout: float) -> None:
    backoff = RETRY_MIN_S
    expires_at = trio.current_time() + res.info.ttl_s
    while True:
        now = trio.current_time()
        connected = res.relay_id in host.libp2p.get_network().connections
        if not connected and res.active:
            res.active = False  # the relay dropped our slot with the connection
            res.last_error = "connection to the relay lost"
        if now >= expires_at:
            res.active = False
        if connected and now < res._renew_at:
            await trio.sleep(min(CHECK_INTERVAL_S, res._renew_at - now))
            continue
        try:
            await _connect_and_reserve(host, res, timeout)
        except (RpcConnectionError, RpcTimeout, ValueError) as exc:
            res.failures += 1
            res.last_error = str(exc)
            log.info("circuit: keeping the reservation on %s failed: %s", res.relay_id, exc)
            await trio.sleep(backoff)
            backoff = min(RETRY_MAX_S, backoff * 2)
            continue
        res.refreshes += 1
        expires_at = trio.current_time() + res.info.ttl_s
        backoff = RETRY_MIN_S


@asynccontextmanager
async def keep_reservation(
    host: EchoHost, relay_addr: str, *, timeout: float = DEFAULT_TIMEOUT_S
) -> AsyncIterator[Reservation]:
    """Hold a reservation on the relay at ``relay_addr`` (``.../p2p/<relay id>``) for the block:
    connect, reserve (failures raise, as :func:`reserve`, so a caller can try another relay),
    accept relayed connections from it, and refresh in the background -- at half the remaining
    TTL, and at once when the connection to the relay is gone (retries back off up to
    :data:`RETRY_MAX_S`; the block is not interrupted, ``res.active`` says whether the slot is
    held). Leaving the block stops the refresh and refuses further circuits via that relay
    (circuits already open stay, as other connections do)."""
    try:
        relay_id = info_from_p2p_addr(Multiaddr(relay_addr)).peer_id
    except Exception as exc:
        raise ValueError(f"not a dialable /p2p/ relay address: {relay_addr!r}") from exc
    addr = circuit_addr(relay_addr, host.peer_id)
    _allow_relay(host, relay_id)
    try:
        t0 = time.monotonic()
        res = Reservation(relay_addr, relay_id, addr, info=None)  # type: ignore[arg-type]
        await _connect_and_reserve(host, res, timeout)
        res.reserved_in_s = time.monotonic() - t0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep, host, res, timeout)
            try:
                yield res
            finally:
                nursery.cancel_scope.cancel()
    finally:
        _disallow_relay(host, relay_id)


async def dial_circuit(
    host: EchoHost, addr: str, timeout: float = DEFAULT_TIMEOUT_S, *, new: bool = False
) -> ID:
    """Connect to the peer at circuit address ``addr`` through its relay (dialling the relay
    first if needed); return the peer id. Like ``EchoHost.connect``, a peer we already hold a
    connection to (direct or relayed) is not dialled again unless ``new``: every circuit counts
    against the relay's ``max_circuits_per_peer`` for that peer. The connection is marked
    relayed (:func:`is_relayed`).

    :raises ValueError: not a circuit address.
    :raises RelayRefused: the relay said no (the peer holds no reservation there, its circuit
        limit is reached, we are not admitted, or the peer refused).
    :raises RpcTimeout: not connected within ``timeout``.
    :raises RpcConnectionError: the relay or the handshake through it failed.
    """
    relay_addr, relay_id, peer = parse_circuit_addr(addr)
    if peer == host.peer_id:
        raise ValueError("a circuit address to ourselves")
    network = host.libp2p.get_network()
    if network.connections.get(peer) and not new:
        return peer
    try:
        with trio.fail_after(timeout):
            if relay_id not in network.connections:
                await host.connect(relay_addr, timeout=timeout)
            stream = await _open_hop(host, relay_id)
            try:
                await write_delimited_msg(
                    stream,
                    HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=peer.to_bytes())),
                )
                resp = await read_delimited_msg(stream, HopMessage)
                status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
                if status != StatusCode.OK:
                    raise RelayRefused(
                        f"relay {relay_id} refused a circuit to {peer}: {status.name}", status
                    )
                raw = RawConnection(
                    stream=stream,
                    initiator=True,
                    connection_type=ConnectionType.RELAYED,
                    addresses=[Multiaddr(f"/p2p/{relay_id}{_CIRCUIT}/p2p/{peer}")],
                )
                conn = await network.upgrade_outbound_raw_conn(raw, peer)  # type: ignore[attr-defined]
            except BaseException:
                await reset_quietly(stream, CLOSE_TIMEOUT_S)
                raise
    except trio.TooSlowError:
        raise RpcTimeout(f"circuit to {peer} via {relay_id} timed out after {timeout} s") from None
    except RelayRefused:
        raise
    except RpcConnectionError:
        raise
    except Exception as exc:
        raise RpcConnectionError(f"circuit to {peer} via {relay_id} failed: {exc!r}") from exc
    with suppress(Exception):  # the raw connection is marked relayed anyway
        conn.set_transport_info([Multiaddr(addr)], ConnectionType.RELAYED)
    return peer


__all__ = [
    "RelayRefused",
    "Reservation",
    "ReservationInfo",
    "StatusCode",
    "circuit_addr",
    "dial_circuit",
    "dial_direct",
    "has_direct_connection",
    "is_relayed",
    "keep_reservation",
    "parse_circuit_addr",
    "reserve",
]
