"""Circuit relay v2 (issue 14), relay side: a public host offers reservations to nodes behind
NAT and relays circuits to them.

A node behind NAT keeps an outbound connection and a *reservation* on a relay (the coordinator,
or a volunteer that can be dialled; the node's side is :mod:`echo.p2p.nat.circuit`). A dialler
asks the relay to CONNECT to that node; the relay opens a STOP stream to the node over the
node's own connection, and from then on copies bytes between the two streams. Noise and yamux
run end to end inside that pipe, so the relay sees ciphertext. Relayed connections carry
control messages only (:func:`~echo.p2p.rpc.is_relayed`); the per-circuit data and duration
limits here (:class:`RelayLimits`) are the backstop.

**Built on py-libp2p 0.8.1's ``libp2p.relay.circuit_v2``** (``CircuitV2Protocol``: protobufs,
length-delimited framing, reservation bookkeeping with signed vouchers, the CONNECT/STOP
handshake). Measured in netem_nat's internet (``tests/nat/test_circuit_relay.py``) it works with our
host (TCP + Noise + our yamux variant). What is worked around here, and why (details in the
docstrings below):

- the relay takes the reserving peer's id from the RESERVE message when present
  (``_handle_reserve``: ``ID(msg.peer.id)``), so anyone could reserve, refresh or hold a slot
  in another peer's name; :class:`_Relay` reserves for the Noise-authenticated peer only;
- a reservation slot stays taken until its TTL after its holder disconnected (spec: valid only
  while connected); :class:`_Relay` prunes those before counting;
- the hop handler reads further messages on a stream until 30 s of silence, logging an error
  for every client that closed after its RESERVE; here one message per stream (the spec);
- the byte pump (``_relay_data``) does not recognise yamux's end-of-stream (it retries 3 times
  with backoff and logs errors on every circuit close), checks the duration limit only when
  data arrives (an idle circuit outlives it), writes a STATUS message into the middle of the
  relayed byte stream on a limit, and on its way out closes the streams it finds under the
  *peer id* in ``_active_relays`` -- keyed by peer, so one circuit's end can close another
  circuit of the same source; :meth:`_Relay._relay_data` resets exactly its own two streams.

API: ``async with offer_relay(host, RelayLimits(...)) as relay`` serves the hop protocol for
the block (``relay.reservations`` lists the current holders).

Owns: the hop handler (while an ``offer_relay`` block is open) and the tasks it starts; leaving
the block removes the handler and cancels its circuits.

Errors: ``ValueError`` from :class:`RelayLimits` for limits out of range. Refusals go to the
peer as STATUS messages (counted in ``relay.refused``); nothing is raised to the caller.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext, suppress
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits as _Libp2pLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from echo.p2p.conn_guard import PUBLIC_PREFIX_CAP
from echo.p2p.host import INBOUND_CONNECTION_CAP, EchoHost
from echo.p2p.nat.circuit import CLOSE_TIMEOUT_S
from echo.p2p.prefixes import prefix_of
from echo.p2p.rpc import is_relayed, remote_ip
from echo.p2p.streams import close_quietly, reset_quietly, stream_peer

log = logging.getLogger(__name__)

# One hop or stop message is a few hundred bytes; a peer that sends nothing for this long is
# dropped (the library waits 30 s per message, in a loop).
MESSAGE_TIMEOUT_S = 10.0
# A hop stream's end: how long we wait for the client to close after our answer.
FINISH_WAIT_S = 1.0
# The pump's read size: a yamux frame's worth.
_PUMP_READ = 64 * 1024


@dataclass(frozen=True)
class RelayLimits:
    """What a relay grants. Defaults fit control messages, not bulk data."""

    max_reservations: int = 32  # peers holding a slot at once
    reservation_ttl_s: int = 600  # a reservation lasts this long unless refreshed
    max_circuits_per_peer: int = 4  # concurrent circuits to one reserved peer
    circuit_duration_s: int = 600  # a circuit is reset after this long (0: no limit)
    circuit_data_bytes: int = 8 << 20  # both directions together (0: no limit)
    # Reservations held at once from one remote IP and from one network (/24, /48): identities
    # are free, so one address must not take every slot (0: no limit).
    max_reservations_per_ip: int = 0
    max_reservations_per_network: int = 0

    def __post_init__(self) -> None:
        if self.max_reservations < 0 or self.max_circuits_per_peer < 0:
            raise ValueError("reservation and circuit counts must be >= 0")
        if self.reservation_ttl_s < 1:
            raise ValueError("reservation_ttl_s must be >= 1")
        if self.circuit_duration_s < 0 or self.circuit_data_bytes < 0:
            raise ValueError("circuit limits must be >= 0")
        if self.max_reservations_per_ip < 0 or self.max_reservations_per_network < 0:
            raise ValueError("per-ip and per-network reservation limits must be >= 0")

    def _libp2p(self) -> _Libp2pLimits:
        return _Libp2pLimits(
            duration=self.circuit_duration_s,
            data=self.circuit_data_bytes,
            max_circuit_conns=self.max_circuits_per_peer,
            max_reservations=self.max_reservations,
            reservation_ttl=self.reservation_ttl_s,
        )


async def _finish(stream: INetStream) -> None:
    """End a hop stream after our last message: FIN first (a reset alone can overtake the
    answer: the client then reads StreamReset instead of the status), a short wait for the
    client's own close, then reset (a client that never closes must not hold the stream)."""
    await close_quietly(stream, CLOSE_TIMEOUT_S)
    with trio.move_on_after(FINISH_WAIT_S), suppress(Exception):
        while await stream.read(_PUMP_READ):
            pass
    await reset_quietly(stream, CLOSE_TIMEOUT_S)


# -- relay (hop) side ----------------------------------------------------------------------------


class _Relay(CircuitV2Protocol):
    """py-libp2p's relay with the fixes listed in the module docstring. Not run as a service:
    :func:`offer_relay` sets and removes its hop handler (the library's ``run`` would also take
    over the STOP handler, which :func:`keep_reservation` owns)."""

    def __init__(
        self, host: IHost, limits: RelayLimits, admit: Callable[[ID], bool] | None
    ) -> None:
        super().__init__(host, limits=limits._libp2p(), allow_hop=True)
        self._admit = admit
        self._limits = limits
        self._where: dict[ID, tuple[str, str]] = {}  # holder -> (its ip, its network)
        self._scopes: set[trio.CancelScope] = set()
        self.circuits_opened = 0  # CONNECT requests taken to the library's handler
        self.circuits_limited = 0
        self.bytes_relayed = 0  # circuit payload copied, both directions (Noise ciphertext)
        self.refused: Counter[str] = Counter()

    @property
    def reservations(self) -> list[ID]:
        self._prune()
        return list(self.resource_manager._reservations)

    def _prune(self) -> None:
        """Drop reservations that expired or whose holder is no longer connected (the spec ties
        a reservation to its connection; the library counted them until their TTL)."""
        rm = self.resource_manager
        for pid, res in list(rm._reservations.items()):
            if res.is_expired() or not rm._is_peer_connected(pid):
                del rm._reservations[pid]
        for pid in list(self._where):
            if pid not in rm._reservations:
                del self._where[pid]

    def _crowded(self, peer: ID, stream: INetStream) -> str:
        """Why ``peer`` (asking on ``stream``) may not take a new slot: its IP or network
        already holds its cap (:class:`RelayLimits`); "" when it may. Remembers where it is."""
        ip = remote_ip(stream) or ""
        prefix = prefix_of(ip) if ip else None
        net = prefix.network if prefix is not None else ip
        lim = self._limits
        others = [w for p, w in self._where.items() if p != peer]
        if lim.max_reservations_per_ip and sum(w[0] == ip for w in others) >= (
            lim.max_reservations_per_ip
        ):
            return f"{ip} holds {lim.max_reservations_per_ip} reservations"
        if lim.max_reservations_per_network and sum(w[1] == net for w in others) >= (
            lim.max_reservations_per_network
        ):
            return f"network {net} holds {lim.max_reservations_per_network} reservations"
        self._where[peer] = (ip, net)
        return ""

    async def _status(self, stream: INetStream, code: StatusCode, why: str) -> None:
        self.refused[code.name] += 1
        log.debug("relay: %s to %s (%s)", code.name, stream_peer(stream), why)
        with trio.move_on_after(CLOSE_TIMEOUT_S), suppress(Exception):  # the peer left
            await write_delimited_msg(
                stream, HopMessage(type=HopMessage.STATUS, status=to_proto_status(code))
            )

    async def _handle_hop_stream(self, stream: INetStream) -> None:  # type: ignore[override]
        """One HOP message per stream (spec), every wait bounded, cancelled with the relay."""
        scope = trio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                await self._serve_hop(stream)
        finally:
            self._scopes.discard(scope)
            for key, pair in list(self._active_relays.items()):
                if stream in pair:
                    del self._active_relays[key]
            await _finish(stream)

    async def _serve_hop(self, stream: INetStream) -> None:
        if is_relayed(stream):
            await self._status(stream, StatusCode.PERMISSION_DENIED, "over a relayed connection")
            return
        try:
            with trio.fail_after(MESSAGE_TIMEOUT_S):
                msg = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:  # noqa: BLE001 (timeout, reset, junk: the stream is dropped)
            log.debug("relay: no hop message from %s: %r", stream_peer(stream), exc)
            return
        peer = stream_peer(stream)
        if self._admit is not None and not self._admit(peer):
            await self._status(stream, StatusCode.PERMISSION_DENIED, "not admitted")
            return
        if msg.type == HopMessage.RESERVE:
            # Reserve for the authenticated peer only: the library honours msg.peer.
            msg.ClearField("peer")
            msg.ClearField("senderRecord")
            self._prune()
            before = self.resource_manager.get_reservation(peer)
            crowded = "" if before is not None else self._crowded(peer, stream)
            if crowded:
                await self._status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, crowded)
                return
            await self._handle_reserve(stream, msg)
            if self.resource_manager.get_reservation(peer) is None and before is None:
                self.refused[StatusCode.RESOURCE_LIMIT_EXCEEDED.name] += 1
                self._where.pop(peer, None)
        elif msg.type == HopMessage.CONNECT:
            try:
                target = ID(msg.peer.id) if msg.HasField("peer") else None
            except Exception:  # noqa: BLE001 (junk bytes for a peer id)
                target = None
            if target is None or target == peer:
                await self._status(stream, StatusCode.MALFORMED_MESSAGE, "no or own target")
                return
            self.circuits_opened += 1
            await self._handle_connect(stream, msg)
        else:
            await self._status(stream, StatusCode.UNEXPECTED_MESSAGE, f"type {msg.type}")

    async def _relay_data(  # type: ignore[override]
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        """Copy ``src`` to ``dst`` until either ends or a limit is hit; then reset both (the
        other direction's pump ends on the reset). ``deadline`` is on ``time.monotonic``."""
        limit_hit = False
        if deadline is not None:
            at = trio.current_time() + (deadline - time.monotonic())
            scope_cm = trio.move_on_at(at)
        else:
            scope_cm = nullcontext()
        try:
            with scope_cm as scope:
                while True:
                    try:
                        data = await src_stream.read(_PUMP_READ)
                    except Exception:  # noqa: BLE001 (EOF or reset: the circuit ends)
                        break
                    if not data:
                        break
                    if circuit_data_limit is not None:
                        if len(data) > circuit_data_limit[0]:
                            limit_hit = True
                            break
                        circuit_data_limit[0] -= len(data)
                    try:
                        with trio.fail_after(self.write_timeout):
                            await dst_stream.write(data)
                    except Exception:  # noqa: BLE001 (timeout, reset)
                        break
                    self.bytes_relayed += len(data)
            if scope is not None and getattr(scope, "cancelled_caught", False):
                limit_hit = True
        finally:
            if limit_hit:
                self.circuits_limited += 1
                log.debug("relay: circuit via %s hit its limit, reset", peer_id)
            await reset_quietly(src_stream, CLOSE_TIMEOUT_S)
            await reset_quietly(dst_stream, CLOSE_TIMEOUT_S)

    def cancel_all(self) -> None:
        for scope in list(self._scopes):
            scope.cancel()


# The relay for control messages that the coordinator and public volunteers offer (issue 14,
# issue 32). Only control messages may cross it (chunks and pushes refuse relayed connections),
# so the limits are those of control traffic:
CONTROL_RELAY_LIMITS = RelayLimits(
    # One slot per node: a reservation lives on its holder's connection, and a host keeps at
    # most this many inbound connections, so more slots could never be used.
    max_reservations=INBOUND_CONNECTION_CAP,
    # Nodes refresh at half the TTL (one RESERVE per node every 2.5 minutes); a node that left
    # loses its slot with its connection anyway.
    reservation_ttl_s=300,
    # A few peers at once may hold a control channel to one node.
    max_circuits_per_peer=4,
    # A control exchange (a have-map, a DCUtR or punch rendezvous) takes seconds; a longer
    # circuit is cut and dialled again. 1 MiB covers Noise, yamux, identify and gossip control
    # inside it many times over, while a peer that tried to pull weights through us is cut
    # after 1 MiB.
    circuit_duration_s=120,
    circuit_data_bytes=1 << 20,
    # As many as the connection guard admits from one public network; a home router's few
    # volunteers share one IP.
    max_reservations_per_ip=8,
    max_reservations_per_network=PUBLIC_PREFIX_CAP,
)


@asynccontextmanager
async def offer_relay(
    host: EchoHost,
    limits: RelayLimits | None = None,
    *,
    admit: Callable[[ID], bool] | None = None,
) -> AsyncIterator[_Relay]:
    """Serve circuit relay v2 (hop) on ``host`` for the block: reservations and circuits within
    ``limits``. ``admit(peer_id)``, if given, decides who may reserve or dial through us (a
    coordinator may admit only its registered nodes). Leaving the block removes the handler
    and resets the circuits in flight. The relay object reports ``reservations``,
    ``circuits_opened``, ``circuits_limited``, ``bytes_relayed`` and ``refused`` (counts by
    status name)."""
    relay = _Relay(host.libp2p, limits or RelayLimits(), admit)
    host.libp2p.set_stream_handler(HOP_PROTOCOL_ID, relay._handle_hop_stream)
    try:
        yield relay
    finally:
        host.libp2p.remove_stream_handler(HOP_PROTOCOL_ID)
        relay.cancel_all()


__all__ = ["CONTROL_RELAY_LIMITS", "RelayLimits", "offer_relay"]
