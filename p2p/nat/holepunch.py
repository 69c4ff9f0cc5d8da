"""Open a direct connection to a peer behind an endpoint-independent NAT by a coordinated punch.

Two nodes, each behind a home router, cannot dial each other: each router drops a SYN that
matches no connection opened from inside. Both can still *connect* at once (TCP simultaneous
open): each side dials the other's public address from its OWN LISTEN PORT (SO_REUSEPORT, so
the dial socket shares the port with the listener). An endpoint-independent (eim) router maps
that port to the same public port for every remote -- Linux MASQUERADE keeps the source port
when it is free -- so the other side's SYN, addressed to that public port, matches the
conntrack entry our own SYN created and is let in. Whichever SYN gets through first meets the
other side's socket in SYN_SENT, and the kernel completes the connection. The order does not
matter as long as both sides' dials overlap in time: an unanswered SYN stays in the router's
conntrack for minutes and the dialling socket waits for the whole punch timeout, so a start
skew of a few seconds only delays the connection (the later side's first SYN meets the earlier
side's waiting socket).

A symmetric router (MASQUERADE ``--random-fully``) gives every remote a new random port: the
peer's SYN then never matches, and :func:`punch` raises :class:`HolePunchFailed` after its
timeout. That is expected: such a pair needs a relay.

**Roles.** After a simultaneous open both sides hold an *outbound* socket, but Noise and
multistream-select need exactly one initiator. Both sides derive the roles from the two peer
ids (:func:`is_initiator`: the smaller id initiates), so no message is needed: the initiator
upgrades its socket as outbound (Noise initiator, multistream dialer), the responder upgrades
its socket as inbound (as py-libp2p's ``dial_addr_as_responder`` does for DCUtR). Measured in
netem_nat's internet: both sides upgrading as initiator (a plain ``dial_addr`` from the listen
port on each side) fails the Noise handshake every time.

**Why both sides keep their dial socket.** The variant "one side only sends a SYN to open its
router's conntrack and abandons it, the other side dials into its listener" fails behind Linux
routers (measured: 0 of 1 in netem_nat, and it works once the routers set
``nf_conntrack_tcp_be_liberal=1``): the listener answers with a new initial sequence number,
which the router's TCP window tracking, primed by the abandoned SYN, marks INVALID, so the
SYN-ACK is not NATed and never arrives. A socket that stays in SYN_SENT answers the peer's SYN
with its own sequence numbers, which conntrack expects (its simultaneous-open state). If the
peer's SYN does reach our listener (a liberal router), the listener upgrades it as inbound --
roles still agree -- and :func:`punch` picks that connection up.

**Only for two peers that cannot be dialled.** Where nothing drops the early side's SYN (one
side public, or loopback), it reaches the other side's listener before that side dials. That is
fine when the early side is the initiator, but if it is the responder, the initiator's listener
upgrades it as inbound too: two Noise responders, and the punch fails after its timeout. A
peer that can be dialled should simply be dialled.

**What the caller provides.** On both sides, at about the same time: the peer's id, its
public address ``/ip4/<router WAN ip>/tcp/<port>``, and a shared start time ``start_at`` (wall
clock, e.g. from the coordinator's go message; within :data:`MAX_START_SKEW_S` of now). Behind
an eim router the public port is the peer's listen port, unless another host behind the same
router already uses that port towards the same remote: two nodes behind one router that
listen on the same port cannot both punch to one peer (its two dials would share one 4-tuple),
so they should listen on different ports or learn their mapped port from an observer. The host
must listen on an IPv4 TCP address (:attr:`EchoHost.tcp_listen_endpoint`).

Owns: the dial socket(s) it opens; every one is closed on failure or cancellation, and on
success the socket belongs to the libp2p connection (closed with the host or by
``EchoHost.disconnect``). It does not close the peer's other connections.

Errors: ``ValueError`` for a malformed address, our own peer id, a host without an IPv4 TCP
listener, or a ``start_at`` too far away; :class:`HolePunchFailed` (an
:class:`~echo.p2p.rpc.RpcConnectionError`) when no authenticated connection to the peer came up
within the timeout, when the handshake failed, or when someone else answered.
"""

from __future__ import annotations

import errno
import logging
import socket as stdlib_socket
import time
from dataclasses import dataclass

import trio
from libp2p.abc import INetConn
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from echo.p2p.host import EchoHost, as_peer_id
from echo.p2p.rpc import RpcConnectionError, is_relayed

log = logging.getLogger(__name__)

# Both SYNs must cross while both dial sockets wait. A dial waits the whole timeout (the kernel
# resends the SYN at 1, 3, 7 s), so this bounds the start skew plus a few RTTs plus the Noise and
# yamux handshakes (py-libp2p needs ~0.1-0.5 s on a busy 2-core machine).
PUNCH_TIMEOUT_S = 10.0
# A go signal that reaches the two sides seconds apart still works (the earlier SYN waits in
# its router's conntrack); more than this is a caller bug, not clock skew.
MAX_START_SKEW_S = 30.0
# After a refused or reset dial (the peer restarted its listener, a stale conntrack entry), a
# short pause before the next SYN: long enough not to spin, short against the timeout.
RETRY_PAUSE_S = 0.2
# How often we look for a connection that our listener accepted from the peer instead (its SYN
# reached the listener because our dial socket was not there): a fraction of an RTT budget.
WATCH_INTERVAL_S = 0.05
# Errors that a later SYN may fix: the peer's SYN reset ours, or it already reached our listener
# and now owns the 4-tuple (EADDRNOTAVAIL / EADDRINUSE until the watcher sees its connection).
_RETRYABLE = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.EADDRNOTAVAIL,
    errno.EADDRINUSE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
}


class HolePunchFailed(RpcConnectionError):
    """No direct connection to the peer came up (symmetric NAT, wrong public port, the peer did
    not punch at the same time, or the handshake failed)."""


@dataclass(frozen=True)
class Punched:
    """A direct connection opened by :func:`punch`."""

    peer_id: ID
    initiator: bool  # we were the Noise initiator
    via: str  # "dial" (our dial socket won) or "listener" (our listener accepted the peer's SYN)
    elapsed_s: float  # from start_at (or the call) to the upgraded connection


def is_initiator(ours: ID | str, theirs: ID | str) -> bool:
    """The role both sides of a punch agree on without talking: the smaller peer id initiates."""
    return str(ours) < str(theirs)


def _parse_public(addr: str, peer_id: ID) -> tuple[str, int]:
    try:
        ma = Multiaddr(addr)
        ip = ma.value_for_protocol("ip4")
        port = int(ma.value_for_protocol("tcp"))
    except Exception as exc:
        raise ValueError(f"not an /ip4/<ip>/tcp/<port> address: {addr!r}") from exc
    try:
        named = ma.value_for_protocol("p2p")
    except Exception:
        named = None
    if named and named != str(peer_id):
        raise ValueError(f"address {addr!r} names another peer than {peer_id}")
    return ip, port


async def _connect_from(source: tuple[str, int], target: tuple[str, int]) -> trio.SocketStream:
    """One TCP connect from ``source`` (our listen ip and port) to ``target``; the socket is
    closed unless returned (on OSError and on cancellation alike)."""
    sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
    try:
        # Both flags: the listener holds this (ip, port) with SO_REUSEPORT, and Linux lets a
        # second socket bind it only if it sets the flag too.
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEPORT, 1)
        await sock.bind(source)
        await sock.connect(target)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def _conns(host: EchoHost, peer_id: ID) -> list[INetConn]:
    conns = host.libp2p.get_network().connections.get(peer_id, [])
    return list(conns) if isinstance(conns, list) else [conns]


def _remote(conn: INetConn) -> tuple[str, int] | None:
    try:
        return conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
    except Exception:
        return None


async def _upgrade(
    host: EchoHost, stream: trio.SocketStream, peer_id: ID, initiator: bool, addr: str
) -> None:
    """Noise + yamux on our dial socket in our role; the swarm registers the connection. On any
    failure the socket is closed and :class:`HolePunchFailed` raised."""
    network = host.libp2p.get_network()
    raw = RawConnection(TrioTCPStream(stream), initiator)
    try:
        if initiator:
            await network.upgrade_outbound_raw_conn(raw, peer_id)  # type: ignore[attr-defined]
            return
        muxed = await network.upgrade_inbound_raw_conn(raw, Multiaddr(addr))  # type: ignore[attr-defined]
    except trio.Cancelled:
        await _close_quietly(raw)
        raise
    except Exception as exc:
        await _close_quietly(raw)
        why = f"{type(exc).__name__}: {exc}"
        if exc.__cause__ is not None:
            why += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        raise HolePunchFailed(
            f"{'outbound' if initiator else 'inbound'} handshake with {peer_id} at {addr} "
            f"failed (does the peer take the other role?): {why}"
        ) from exc
    if muxed.peer_id != peer_id:
        with trio.CancelScope(shield=True):
            await _close_quietly(muxed)
        raise HolePunchFailed(f"{addr} answered as {muxed.peer_id}, not {peer_id}")


async def _close_quietly(conn: object) -> None:
    try:
        with trio.move_on_after(1.0):
            await conn.close()  # type: ignore[attr-defined]
    except Exception:
        pass


async def punch(
    host: EchoHost,
    peer_id: ID | str,
    peer_public_addr: str,
    *,
    start_at: float | None = None,
    timeout: float = PUNCH_TIMEOUT_S,
    initiator: bool | None = None,
) -> Punched:
    """Open a direct, authenticated connection to ``peer_id`` by a simultaneous TCP open.

    The peer must call :func:`punch` with our id and public address at the same ``start_at``
    (``time.time()`` seconds; ``None``: now). From then on we dial ``peer_public_addr``
    (``/ip4/<its router's WAN ip>/tcp/<its public port>``) from our listen port, re-dialling
    after refusals, and upgrade in the role :func:`is_initiator` gives us (``initiator``
    overrides it; both sides must then pass opposite values).

    :raises ValueError: see the module docstring.
    :raises HolePunchFailed: no connection within ``timeout`` seconds of ``start_at``; nothing
        we opened is left open.
    """
    pid = as_peer_id(peer_id)
    if pid == host.peer_id:
        raise ValueError("cannot punch a hole to ourselves")
    target = _parse_public(peer_public_addr, pid)
    source = host.tcp_listen_endpoint
    role = is_initiator(host.peer_id, pid) if initiator is None else initiator
    now = time.time()
    start = now if start_at is None else start_at
    if abs(start - now) > MAX_START_SKEW_S:
        raise ValueError(f"start_at is {start - now:+.1f} s from now (at most {MAX_START_SKEW_S})")
    before = _conns(host, pid)
    dialled: list[trio.SocketStream] = []
    accepted: list[INetConn] = []
    last_error: list[OSError] = []

    async def dial(race: trio.CancelScope) -> None:
        while True:
            try:
                dialled.append(await _connect_from(source, target))
                race.cancel()
                return
            except OSError as exc:
                if exc.errno not in _RETRYABLE:
                    raise HolePunchFailed(
                        f"dialling {peer_public_addr} from {source[0]}:{source[1]} failed: {exc}"
                    ) from exc
                last_error[:] = [exc]
            await trio.sleep(RETRY_PAUSE_S)

    async def watch(race: trio.CancelScope) -> None:
        while True:
            # A circuit through a relay (a plan's control connection, say) may come up while
            # we punch; it is not the direct path the caller asked for.
            fresh = [
                c
                for c in _conns(host, pid)
                if not c.is_closed
                and not is_relayed(c)
                and not any(c is old for old in before)
            ]
            if fresh:
                accepted.append(fresh[0])
                race.cancel()
                return
            await trio.sleep(WATCH_INTERVAL_S)

    deadline = trio.current_time() + max(0.0, start - now) + timeout
    via = ""
    try:
        with trio.move_on_at(deadline):
            await trio.sleep(max(0.0, start - now))
            with trio.CancelScope() as race:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(dial, race)
                    nursery.start_soon(watch, race)
            if accepted:
                # Our listener already holds an upgraded connection; a socket our dial may
                # have completed at the same moment would be a second, unneeded one.
                via = "listener"
            elif dialled:
                # From here the socket belongs to the upgrade (closed by it on failure).
                stream = dialled.pop()
                await _upgrade(host, stream, pid, role, peer_public_addr)
                via = "dial"
    finally:
        for stream in dialled:
            with trio.CancelScope(shield=True):
                await stream.aclose()
    if not via:
        why = f" (last error: {last_error[0]})" if last_error else ""
        raise HolePunchFailed(
            f"no direct connection to {pid} at {peer_public_addr} within {timeout:g} s of the "
            f"start: no SYN got through both NATs (a symmetric NAT on either side, a wrong "
            f"public port, or the peer did not punch at the same time){why}"
        )
    elapsed = time.time() - start
    log.info("punched a hole to %s via %s in %.2f s (initiator=%s)", pid, via, elapsed, role)
    return Punched(pid, role, via, elapsed)


__all__ = [
    "MAX_START_SKEW_S",
    "PUNCH_TIMEOUT_S",
    "HolePunchFailed",
    "Punched",
    "is_initiator",
    "punch",
]
