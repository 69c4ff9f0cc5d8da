"""DCUtR (libp2p's Direct Connection Upgrade through Relay) over our circuits.

A peer that reaches a node behind NAT only through a circuit relay (:mod:`echo.p2p.nat.circuit`)
can ask it, over that relayed connection, for a direct one: the DCUtR exchange (CONNECT with
each side's addresses, CONNECT back, SYNC) after which both sides dial each other at once. When
the asking side can be dialled, the node's dial simply reaches it (a *connection reversal*); when
both are behind endpoint-independent routers, the crossing dials are a TCP hole punch. Bulk data
then travels on the direct connection, as it must (pushes and chunk pulls refuse relayed ones).

**Built on py-libp2p 0.8.1's** ``libp2p.relay.circuit_v2.dcutr.DCUtRProtocol`` (the wire
protocol, the RTT-timed SYNC, dials bound to the listen port, the initiator upgrading as Noise
responder so a merged simultaneous open has one initiator). Used without its service loop (its
``_auto_drive_loop`` would punch every relayed peer, including relays' own clients, on its own
schedule): :func:`serve_dcutr` installs the responder's handler and :func:`upgrade` runs one
exchange. Two things are mended here (:class:`_DCUtR`): the unilateral dial it tries first is
skipped (it timed out on every exchange after the first, see the method), and the library
decides "direct" from the connection's
transport addresses, which our circuit connections (built by
:func:`echo.p2p.nat.circuit.dial_circuit` and the STOP handler) do not always carry; :class:`_DCUtR`
asks
:func:`echo.p2p.nat.circuit.has_direct_connection` (a connection is relayed when its raw connection
is, :func:`echo.p2p.rpc.is_relayed`).

Owns: the DCUtR handler on a host (while :func:`serve_dcutr`'s registration lasts; hosts are
closed with it) and the dials of one :func:`upgrade` call (the connection it opens belongs to
the host). Raises nothing: :func:`upgrade` says whether a direct connection exists afterwards.

Bounds (a CONNECT makes the responder dial what it names): DCUtR only over relayed
connections, :data:`PEER_EXCHANGES` per peer per :data:`PEER_WINDOW_S`, at most
:data:`MAX_DIAL_ADDRS` of the peer's addresses.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import suppress

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID, DCUtRProtocol

from echo.p2p.budget import LruMap
from echo.p2p.host import EchoHost, as_peer_id
from echo.p2p.nat.circuit import has_direct_connection
from echo.p2p.rpc import is_relayed

log = logging.getLogger(__name__)

# One exchange: a relay round trip or two, then dials. The library's defaults wait 30 s per
# message and 10 s per dial; a control channel that slow is better abandoned.
READ_TIMEOUT_S = 10
DIAL_TIMEOUT_S = 5
UPGRADE_TIMEOUT_S = 20.0
# A CONNECT makes the responder dial the addresses it names, and anyone a relay admits can send
# one: a peer gets PEER_EXCHANGES exchanges per PEER_WINDOW_S (the spec's initiator tries up to
# three times), only over a relayed connection (the spec's case), and at most MAX_DIAL_ADDRS of
# its addresses are dialled (a stranger cannot aim a node at twenty hosts at once).
PEER_EXCHANGES = 3
PEER_WINDOW_S = 60.0
MAX_DIAL_ADDRS = 4
_MAX_PEERS_REMEMBERED = 4096


class _DCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR with our test for a direct connection (module docstring)."""

    def __init__(self, host: EchoHost) -> None:
        super().__init__(
            host.libp2p,
            read_timeout=READ_TIMEOUT_S,
            write_timeout=READ_TIMEOUT_S,
            dial_timeout=DIAL_TIMEOUT_S,
        )
        self.echo_host = host
        self.upgrades = 0  # exchanges that ended with a direct connection (either role)

    async def _verify_direct_connection(self, peer_id: ID) -> bool:
        return has_direct_connection(self.echo_host, peer_id)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list:  # type: ignore[override]
        return super()._decode_observed_addrs(addr_bytes)[:MAX_DIAL_ADDRS]

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        # The spec's step 0 (a plain dial of the peer's known addresses first) only costs time
        # here: we reach a peer through a circuit because no dial-back reached it, and what the
        # peerstore holds for it are the addresses of its last exchange (its LAN ones), which
        # time out. Measured in netem_nat (tools/dcutr_netns.py): 5.4 s per exchange with the
        # step, 0.6 s without.
        return False


_protocols: weakref.WeakKeyDictionary[IHost, _DCUtR] = weakref.WeakKeyDictionary()


def _proto(host: EchoHost) -> _DCUtR:
    proto = _protocols.get(host.libp2p)
    if proto is None:
        proto = _protocols[host.libp2p] = _DCUtR(host)
    return proto


def serve_dcutr(host: EchoHost) -> None:
    """Answer DCUtR on ``host``: a peer connected through a relay may ask us to dial it."""
    proto = _proto(host)
    recent: LruMap[ID, list[float]] = LruMap(_MAX_PEERS_REMEMBERED)

    async def handle(stream) -> None:  # type: ignore[no-untyped-def]
        peer, now = stream.muxed_conn.peer_id, trio.current_time()
        times = [t for t in recent.setdefault(peer, list) if now - t < PEER_WINDOW_S]
        if not is_relayed(stream) or len(times) >= PEER_EXCHANGES:
            with trio.move_on_after(2.0), suppress(Exception):
                await stream.reset()
            return
        recent.put(peer, [*times, now])
        with trio.move_on_after(UPGRADE_TIMEOUT_S):
            await proto._handle_dcutr_stream(stream)
        if has_direct_connection(host, stream.muxed_conn.peer_id):
            proto.upgrades += 1

    host.libp2p.set_stream_handler(PROTOCOL_ID, handle)


async def upgrade(host: EchoHost, peer_id: ID | str, timeout: float = UPGRADE_TIMEOUT_S) -> bool:
    """Run one DCUtR exchange with ``peer_id`` (connected through a relay); True when a direct
    connection to it exists afterwards. Never raises (but cancellation)."""
    pid = as_peer_id(peer_id)
    if has_direct_connection(host, pid):
        return True
    proto = _proto(host)
    with trio.move_on_after(timeout):
        try:
            await proto.initiate_hole_punch(pid)
        except Exception:  # noqa: BLE001 (the library logs; the answer is the connection)
            log.debug("DCUtR with %s failed", pid, exc_info=True)
    ok = has_direct_connection(host, pid)
    if ok:
        proto.upgrades += 1
    return ok


def upgrades(host: EchoHost) -> int:
    """DCUtR exchanges on ``host`` that ended with a direct connection."""
    proto = _protocols.get(host.libp2p)
    return proto.upgrades if proto is not None else 0


__all__ = ["PROTOCOL_ID", "serve_dcutr", "upgrade", "upgrades"]
