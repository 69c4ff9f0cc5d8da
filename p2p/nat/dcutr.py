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

import errno
import logging
import weakref
from contextlib import suppress

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID, DCUtRProtocol, _tcp_ip_port
from multiaddr import Multiaddr

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
# What connect() says when the address pair a dial from our listen port needs is already held
# by a socket of ours (a connection on that pair that our listener accepted: _DCUtR._dial_peer).
_PAIR_TAKEN = frozenset({errno.EADDRNOTAVAIL, errno.EADDRINUSE})


def pair_taken(exc: BaseException) -> bool:
    """Whether ``exc`` (py-libp2p wraps the OSError two or three times) says that the source
    address and port are already connected to that destination."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _PAIR_TAKEN:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


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
        self.pair_fallbacks = 0  # dials re-made from an ephemeral port (see _dial_peer)
        self._dialling: set[tuple[ID, str, int]] = set()  # (peer, ip, port) dials in flight

    async def _verify_direct_connection(self, peer_id: ID) -> bool:
        return has_direct_connection(self.echo_host, peer_id)

    async def _have_direct_connection(self, peer_id: ID) -> bool:
        # The library trusts a cache of peers it once punched, emptied only by a host that
        # knows the service (``_dcutr_protocol``, which ours is not): after that connection
        # closed, the peer's next CONNECT would be answered "already direct" and never dialled.
        return has_direct_connection(self.echo_host, peer_id)

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        """The library's dial from our listen port (``source``); on the side that dials
        back (the exchange's responder, ``as_responder`` False), when the kernel refuses that
        address pair because a socket of ours already holds it, the same dial again from an
        ephemeral port.

        What holds the pair (measured, docs/results/2026-12-07-nat-redial.md): the initiator
        dials too (the punch's other half), upgrading as Noise *responder*; where nothing
        drops its SYN (loopback, a peer that can be dialled, a router whose conntrack still
        knows the pair) and it arrives before our own dial, our listener accepts it as
        inbound, both sides wait as responders until the 10 s inbound upgrade timeout, and
        every dial of ours from the listen port to the initiator fails with EADDRNOTAVAIL
        meanwhile (13 of them in the CI failure of tests/nat/test_nat_circuits.py). Our own
        TIME_WAIT is not the cause: Linux lets a socket bound to a shared port reuse its
        TIME_WAIT pair at once. An ephemeral port cannot punch through the initiator's
        router, but neither can the held pair; it does reach an initiator that can be
        dialled (the connection reversal, the case circuits use DCUtR for), as a plain
        outbound dial that its listener takes as inbound, so the Noise roles agree. The
        initiator does not fall back: the peer it reaches by a circuit is one that could not
        be dialled. Never raises: the exchange judges by the connections.
        """
        # The peer's CONNECT often names one endpoint twice (with and without /p2p/<id>): a
        # second dial from the listen port would only collide with the first (EADDRNOTAVAIL)
        # and, taken for a held pair, add an ephemeral-port connection beside it.
        tcp = _tcp_ip_port(addr)
        key = (peer_id, tcp[1], tcp[2]) if tcp is not None else None
        if key is not None:
            if key in self._dialling:
                return
            self._dialling.add(key)
        try:
            await self._dial_or_fall_back(peer_id, addr, source, as_responder)
        finally:
            if key is not None:
                self._dialling.discard(key)

    async def _dial_or_fall_back(
        self, peer_id: ID, addr: Multiaddr, source: tuple[str, int] | None, as_responder: bool
    ) -> None:
        network = self.host.get_network()
        try:
            with trio.fail_after(self.dial_timeout):
                if as_responder:
                    await network.dial_addr_as_responder(addr, peer_id, source)
                else:
                    await network.dial_addr(addr, peer_id, source)
            return
        except trio.TooSlowError:
            log.debug("DCUtR dial to %s at %s timed out", peer_id, addr)
            return
        except Exception as exc:  # noqa: BLE001 (the library's dial raises many kinds)
            if source is None or as_responder or not pair_taken(exc):
                log.debug("DCUtR dial to %s at %s failed: %s", peer_id, addr, exc)
                return
        if has_direct_connection(self.echo_host, peer_id):
            # The pair was taken by the peer's punch dial, merged or upgraded by now.
            return
        log.info(
            "DCUtR dial to %s at %s from our listen port %s:%d refused: a connection of ours "
            "already holds that address pair; dialling from an ephemeral port",
            peer_id,
            addr,
            *source,
        )
        self.pair_fallbacks += 1
        try:
            with trio.fail_after(self.dial_timeout):
                await network.dial_addr(addr, peer_id)
        except trio.TooSlowError:
            log.debug("DCUtR dial to %s at %s from an ephemeral port timed out", peer_id, addr)
        except Exception as exc:  # noqa: BLE001
            log.debug(
                "DCUtR dial to %s at %s from an ephemeral port failed: %s", peer_id, addr, exc
            )

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


def pair_fallbacks(host: EchoHost) -> int:
    """DCUtR dials on ``host`` re-made from an ephemeral port because the listen port's address
    pair to that peer was held (:meth:`_DCUtR._dial_peer`)."""
    proto = _protocols.get(host.libp2p)
    return proto.pair_fallbacks if proto is not None else 0


__all__ = ["PROTOCOL_ID", "pair_fallbacks", "pair_taken", "serve_dcutr", "upgrade", "upgrades"]
