"""Which inbound connections a host keeps: a per-prefix cap at admission, idle reaping.

A host takes at most ``INBOUND_CONNECTION_CAP`` open connections (:mod:`echo.p2p.host`), and
identities are free: one stranger could open that many idle connections -- from one address --
hold them, and shut every honest peer out. :class:`ConnectionGuard` bounds that in two ways:

* **Admission by network prefix.** Before the Noise handshake of an inbound connection (so
  before any stream can be served, and before we spend a handshake on it), the connection's
  remote address is mapped to its prefix (:func:`prefix_of`: the /24 of an IPv4 address, the
  /48 of an IPv6 one) and refused -- its socket closed -- when that prefix already holds its
  cap of open or handshaking inbound connections. Public, private and loopback prefixes have
  separate caps (:class:`GuardPolicy`); loopback is uncapped by default because tests and local
  swarms run every node on 127.0.0.1. A capped prefix also has a handshake rate: its cap at
  once, then its cap's worth every ``handshake_refill_s`` (a stranger shut out comes back as a
  fresh identity on a fresh connection; the rate bounds what that costs us in handshakes).
* **Idle reaping under pressure.** A connection on which no stream was opened or closed, in
  either direction, for ``idle_timeout_s`` is idle. While the host holds more than
  ``pressure_fraction`` of its cap, or a connection's prefix is at its own cap, the reaper closes
  the idle inbound connections. A protected peer (:meth:`ConnectionGuard.protect`: the
  coordinator protects the peers it has reason to keep, such as nodes with an accepted group)
  has a longer grace, ``protected_idle_timeout_s``, for one connection -- its most recently
  active -- and none for any other: protection is a head start, not immunity. (It was immunity:
  one accepted group each, 16 idle connections from each of 16 /24s held the host over its
  cap of 250 for good; issue 26, finding 5.) Outbound connections are never reaped (we chose to
  open them).

How it hooks py-libp2p 0.8.1: a notifee (``INotifee.opened_stream`` / ``closed_stream`` fire for
streams in both directions, from ``SwarmConn._add_stream`` and the stream's close) stamps each
connection's last activity; the swarm's ``upgrade_inbound_raw_conn`` is wrapped on the instance
(the listener path and a hole punch's responder side both go through it) to check and reserve a
prefix slot synchronously -- check and reservation have no checkpoint between them, so
concurrent handshakes cannot all pass -- and to release the reservation when the upgrade ends
(by then the connection is in the swarm's table, where it is counted from).

Owns: its bookkeeping (activity stamps, reservations, the protected set -- whose size is the
caller's: unprotect what you protected) and the reaper task (:meth:`ConnectionGuard.run`, run
in a nursery the host owns). Closes: refused inbound sockets, and reaped connections (one
``SwarmConn`` each, not the peer's other connections); a reaped peer left with no connection
also loses its peerstore addresses (so py-libp2p's AutoConnector does not dial it back).
Raises: ``ValueError`` for a bad policy; the wrapped upgrade raises ``SwarmException`` for a
refused connection (py-libp2p's inbound handler, and :mod:`echo.p2p.nat.holepunch`, handle it).
Closing errors are logged, never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.rcmgr import Direction
from multiaddr import Multiaddr

from echo.p2p.budget import LruMap
from echo.p2p.prefixes import Prefix, prefix_of, wide_of
from echo.p2p.wide_rate import WideRate

logger = logging.getLogger(__name__)

# Open (or handshaking) inbound connections one public /24 or /48 may hold. An honest Echo peer
# holds one connection to a host (two for a moment while a dial races an inbound one), and it is
# rare for more than a handful of volunteers to share one public network (a home, a NAT'd lab);
# 16 of them still fit. A holder then needs 250 / 16 = 16 distinct /24s to fill a host, instead
# of one address.
PUBLIC_PREFIX_CAP = 16
# Private, link-local and unique-local prefixes (10/8, 172.16/12, 192.168/16, fc00::/7, ...): the
# peer shares our LAN or our own NAT -- a room of our own machines more often than an attacker --
# so it gets room for a lab's worth of nodes on one /24.
PRIVATE_PREFIX_CAP = 64
# Loopback: no cap by default. Tests, benchmarks and local swarms run every node on 127.0.0.1;
# a process on our own machine can hurt us in worse ways than holding sockets. A policy may set
# one (each loopback address is then its own prefix, so tests can tell 127.0.0.1 from 127.0.0.2).
LOOPBACK_CAP: int | None = None
# A capped prefix may start its whole cap of handshakes at once and then its cap's worth again
# every this many seconds (a public /24: 16 at once, then 2 a second). An honest peer dials a
# host once and keeps the connection; a stranger who is refused or shut out comes back as a
# fresh identity on a fresh connection, and each costs a Noise handshake before any budget can
# see it (benchmarks/attack.py's junk submitter: 5-8 new identities a second from one address).
HANDSHAKE_REFILL_S = 8.0
# Prefixes whose handshake rate is tracked at once (least recently seen dropped; a dropped one
# starts again with a full allowance, so the bound costs only a burst, never a wrongful refusal).
MAX_TRACKED_PREFIXES = 20_000
# No stream opened or closed, in either direction, for this long: the connection is idle. A
# working node opens streams far more often (status every 10 s, a re-register every 6 s when
# idle, chunk pulls per version); a reaped honest peer pays only a re-dial on its next request.
IDLE_TIMEOUT_S = 60.0
# Reaping starts above this share of the host's connection cap: below it, idle connections cost
# nothing anybody needs, and honest peers that happen to be quiet keep theirs.
PRESSURE_FRACTION = 0.5
# A protected peer's connection is reaped under pressure after this long without a stream. An
# honest node opens one every 10 s (its status) and a learner with every batch request, so five
# minutes of silence is a holder, not a worker; a reaped peer that was working pays one re-dial.
PROTECTED_IDLE_TIMEOUT_S = 300.0
# How often the reaper looks: an idle holder is closed at most IDLE_TIMEOUT_S + this after its
# last stream. A pass is a scan of at most the cap's worth of connections.
REAP_INTERVAL_S = 5.0
# Bound on closing one pass's victims (concurrently; py-libp2p's SwarmConn.close sleeps 0.1 s).
REAP_CLOSE_TIMEOUT_S = 5.0
# Bound on closing a refused socket (it has not done a handshake: one close call).
REFUSE_CLOSE_TIMEOUT_S = 1.0

Endpoint = tuple[str, int]
UpgradeFn = Callable[[Any, Multiaddr], Awaitable[Any]]


@dataclass(frozen=True)
class GuardPolicy:
    """The guard's settings (every one configurable; the defaults are the module constants).

    A cap of None means no cap for that kind of prefix.

    :raises ValueError: a cap below 1, a non-positive timeout or interval, or a pressure
        fraction outside (0, 1].
    """

    public_cap: int | None = PUBLIC_PREFIX_CAP
    private_cap: int | None = PRIVATE_PREFIX_CAP
    loopback_cap: int | None = LOOPBACK_CAP
    handshake_refill_s: float | None = HANDSHAKE_REFILL_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    protected_idle_timeout_s: float = PROTECTED_IDLE_TIMEOUT_S
    pressure_fraction: float = PRESSURE_FRACTION
    reap_interval_s: float = REAP_INTERVAL_S

    def __post_init__(self) -> None:
        for name in ("public_cap", "private_cap", "loopback_cap"):
            cap = getattr(self, name)
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {cap}")
        if self.handshake_refill_s is not None and self.handshake_refill_s <= 0:
            raise ValueError(
                f"handshake_refill_s must be positive or None, got {self.handshake_refill_s}"
            )
        if self.idle_timeout_s <= 0 or self.reap_interval_s <= 0:
            raise ValueError("idle_timeout_s and reap_interval_s must be positive")
        if self.protected_idle_timeout_s <= 0:
            raise ValueError("protected_idle_timeout_s must be positive")
        if not 0 < self.pressure_fraction <= 1:
            raise ValueError(f"pressure_fraction must be in (0, 1], got {self.pressure_fraction}")

    def cap_for(self, prefix: Prefix) -> int | None:
        """The cap on open inbound connections from ``prefix`` (None: uncapped)."""
        if prefix.kind == "loopback":
            return self.loopback_cap
        return self.private_cap if prefix.kind == "private" else self.public_cap


def _remote_endpoint(conn: object) -> Endpoint | None:
    """(ip, port) of a raw, secured, muxed or swarm connection; None when it has none."""
    target = getattr(conn, "muxed_conn", conn)
    try:
        remote = target.get_remote_address()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 (a connection without a transport address)
        return None
    if not remote:
        return None
    return str(remote[0]), int(remote[1])


def is_inbound(conn: INetConn) -> bool:
    """Whether ``conn`` was opened by the remote peer."""
    return getattr(conn, "direction", Direction.UNKNOWN) == Direction.INBOUND


async def close_quietly(conn: Any, timeout: float) -> None:
    """Close ``conn``, giving up after ``timeout`` s; a peer that already left raises nothing."""
    with trio.move_on_after(timeout):
        try:
            await conn.close()
        except Exception as exc:  # noqa: BLE001 (it is being dropped either way)
            logger.debug("closing a guarded connection: %s", exc)


class ConnectionGuard:
    """Admission by prefix and idle reaping for one host's swarm; see the module docstring.

    ``connection_cap`` is the host's cap on open connections (the pressure threshold is a share
    of it); ``clock`` is monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        policy: GuardPolicy | None = None,
        *,
        connection_cap: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if connection_cap < 1:
            raise ValueError(f"connection_cap must be at least 1, got {connection_cap}")
        self.policy = policy or GuardPolicy()
        self.connection_cap = connection_cap
        self._clock = clock
        self._network: Any = None
        self._last_active: dict[INetConn, float] = {}
        # Each connection's remote endpoint and prefix, looked up once: admission scans every
        # connection per handshake (8% of the coordinator's loop with every attacker).
        self._where: dict[INetConn, tuple[Endpoint | None, Prefix | None]] = {}
        self._pending: dict[Endpoint, Prefix] = {}
        self._protected: set[ID] = set()
        # Per capped prefix: (handshakes it may still start, when that was counted).
        self._allowance: LruMap[Prefix, tuple[float, float]] = LruMap(MAX_TRACKED_PREFIXES)
        self.wide = WideRate(clock=clock)  # /16s without a protected peer: a rate of their own
        # Set by echo.p2p.shedding: whether a capped prefix's handshake is refused for now.
        self.refuse_newcomer: Callable[[str], bool] | None = None
        self.refused = 0  # inbound connections refused over their prefix's cap or rate, ever
        self.reaped = 0  # idle connections closed by the reaper, ever

    # -- protection -----------------------------------------------------------------------------

    def protect(self, peer_id: ID | str) -> None:
        """Give ``peer_id``'s most recently active connection the longer idle grace
        (``protected_idle_timeout_s``) until :meth:`unprotect`. Admission is not affected: it
        happens before the handshake says who the peer is."""
        self._protected.add(_peer(peer_id))

    def unprotect(self, peer_id: ID | str) -> None:
        """Undo :meth:`protect` (a no-op for a peer that is not protected)."""
        self._protected.discard(_peer(peer_id))

    def is_protected(self, peer_id: ID | str) -> bool:
        return _peer(peer_id) in self._protected

    # -- wiring ---------------------------------------------------------------------------------

    def install(self, network: Any) -> None:
        """Hook ``network`` (a py-libp2p 0.8.1 ``Swarm``, before it runs): register the activity
        notifee and wrap its ``upgrade_inbound_raw_conn`` with the prefix admission.

        :raises RuntimeError: installed twice.
        """
        if self._network is not None:
            raise RuntimeError("this ConnectionGuard is installed already")
        self._network = network
        network.register_notifee(_ActivityNotifee(self))
        original: UpgradeFn = network.upgrade_inbound_raw_conn

        async def upgrade_inbound_raw_conn(raw_conn: Any, maddr: Multiaddr) -> Any:
            endpoint = _remote_endpoint(raw_conn)
            if endpoint is not None and not self._reserve(endpoint):
                self.refused += 1
                with trio.CancelScope(shield=True):
                    await close_quietly(raw_conn, REFUSE_CLOSE_TIMEOUT_S)
                raise SwarmException(f"inbound connection from {endpoint[0]}: prefix at its cap")
            try:
                return await original(raw_conn, maddr)
            finally:
                if endpoint is not None:
                    self._pending.pop(endpoint, None)

        network.upgrade_inbound_raw_conn = upgrade_inbound_raw_conn

    # -- admission ------------------------------------------------------------------------------

    def _reserve(self, endpoint: Endpoint) -> bool:
        """Admit a handshake from ``endpoint`` and hold its prefix slot, or refuse it.

        Synchronous on purpose: no checkpoint between the count and the reservation."""
        prefix = prefix_of(endpoint[0])
        if prefix is None:
            return True
        cap = self.policy.cap_for(prefix)
        if cap is not None and self.inbound_count(prefix) >= cap:
            # debug, not info: a refused stranger can retry as fast as it likes (see .refused)
            logger.debug("refused inbound from %s: %s is at its cap", endpoint[0], prefix.network)
            return False
        if cap is not None and not self._take_handshake(prefix, cap):
            logger.debug("refused inbound from %s: %s over its rate", endpoint[0], prefix.network)
            return False
        shed = self.refuse_newcomer
        if cap is not None and shed is not None and shed(endpoint[0]):
            logger.debug("refused inbound from %s: the loop lags, strangers wait", endpoint[0])
            return False
        wide = cap is not None and prefix.kind != "private"  # a LAN lab starts all at once
        if wide and not self.wide.take(endpoint[0], self._vouched):
            logger.debug("refused inbound from %s: its /16 proved nothing yet", endpoint[0])
            return False
        self._pending[endpoint] = prefix
        return True

    def _take_handshake(self, prefix: Prefix, cap: int) -> bool:
        """Spend one of ``prefix``'s handshakes (a token bucket of ``cap`` refilled over
        ``handshake_refill_s``); False, spending nothing, when none is left."""
        refill_s = self.policy.handshake_refill_s
        if refill_s is None:
            return True
        now = self._clock()
        left, at = self._allowance.get(prefix) or (float(cap), now)
        left = min(float(cap), left + (now - at) * cap / refill_s)
        if left < 1.0:
            self._allowance.put(prefix, (left, now))
            return False
        self._allowance.put(prefix, (left - 1.0, now))
        return True

    def _vouched(self, network: str) -> bool:
        """Whether a protected peer is connected from the wide ``network`` (wide_rate)."""
        mine = self._protected
        eps = (self.where(c)[0] for c in self.connections() if c.muxed_conn.peer_id in mine)
        return any(ep is not None and wide_of(ep[0]) == network for ep in eps)

    def inbound_count(self, prefix: Prefix) -> int:
        """Open inbound connections plus handshakes under way from ``prefix``."""
        endpoints = {ep for ep, p in self._pending.items() if p == prefix}
        for conn in self.connections():
            if is_inbound(conn):
                ep, p = self.where(conn)
                if ep is not None and p == prefix:
                    endpoints.add(ep)
        return len(endpoints)

    def where(self, conn: INetConn) -> tuple[Endpoint | None, Prefix | None]:
        """``conn``'s remote endpoint and its prefix (kept until :meth:`forget`)."""
        known = self._where.get(conn)
        if known is None:
            ep = _remote_endpoint(conn)
            known = self._where[conn] = (ep, prefix_of(ep[0]) if ep is not None else None)
        return known

    # -- activity -------------------------------------------------------------------------------

    def connections(self) -> Iterator[INetConn]:
        """Every open connection of the host, inbound and outbound (a snapshot per peer)."""
        conns = getattr(self._network, "connections", None) or {}
        for per_peer in list(conns.values()):
            yield from list(per_peer)

    def touch(self, conn: INetConn) -> None:
        """Stamp ``conn`` as active now (the notifee calls this on every stream event)."""
        self._last_active[conn] = self._clock()

    def forget(self, conn: INetConn) -> None:
        self._last_active.pop(conn, None)
        self._where.pop(conn, None)

    def idle_for(self, conn: INetConn) -> float:
        """Seconds since ``conn``'s last stream event (0 for one the guard has not seen yet:
        it is stamped now)."""
        now = self._clock()
        return now - self._last_active.setdefault(conn, now)

    # -- reaping --------------------------------------------------------------------------------

    def under_pressure(self) -> bool:
        """Whether the host holds more than ``pressure_fraction`` of its connection cap."""
        total = sum(1 for _ in self.connections())
        return total > self.policy.pressure_fraction * self.connection_cap

    def _kept(self, inbound: list[INetConn]) -> dict[ID, INetConn]:
        """Per protected peer, the one inbound connection its protection covers: the most
        recently active (a protected peer's other connections are anybody's)."""
        kept: dict[ID, INetConn] = {}
        for conn in inbound:
            peer = conn.muxed_conn.peer_id
            if peer in self._protected and (
                peer not in kept or self.idle_for(conn) < self.idle_for(kept[peer])
            ):
                kept[peer] = conn
        return kept

    def reapable(self) -> list[INetConn]:
        """The inbound connections that are idle -- past ``idle_timeout_s``, or
        ``protected_idle_timeout_s`` for the one a protection covers (:meth:`_kept`) -- and
        under pressure (the host's, or their prefix's: at its cap). Also drops stamps of
        connections gone."""
        conns = list(self.connections())
        live = set(conns)
        for gone in [c for c in self._last_active if c not in live]:
            del self._last_active[gone]
        for gone in [c for c in self._where if c not in live]:
            del self._where[gone]
        host_pressure = self.under_pressure()
        per_prefix: dict[Prefix, int] = {}
        inbound: list[tuple[INetConn, Prefix | None]] = []
        for conn in conns:
            if not is_inbound(conn):
                continue
            prefix = self.where(conn)[1]
            if prefix is not None:
                per_prefix[prefix] = per_prefix.get(prefix, 0) + 1
            inbound.append((conn, prefix))
        kept = self._kept([conn for conn, _ in inbound])
        victims = []
        for conn, prefix in inbound:
            covered = kept.get(conn.muxed_conn.peer_id) is conn
            grace = self.policy.idle_timeout_s
            if covered:  # never shorter than anybody's
                grace = max(grace, self.policy.protected_idle_timeout_s)
            if self.idle_for(conn) < grace:
                continue
            cap = self.policy.cap_for(prefix) if prefix is not None else None
            prefix_full = prefix is not None and cap is not None and per_prefix[prefix] >= cap
            if host_pressure or prefix_full:
                victims.append(conn)
        return victims

    async def reap(self) -> int:
        """Close every connection :meth:`reapable` names (concurrently, within
        :data:`REAP_CLOSE_TIMEOUT_S`); return how many were asked to close."""
        victims = self.reapable()
        if not victims:
            return 0
        logger.info("reaping %d idle inbound connection(s)", len(victims))
        async with trio.open_nursery() as nursery:
            for conn in victims:
                self.forget(conn)
                nursery.start_soon(close_quietly, conn, REAP_CLOSE_TIMEOUT_S)
        self.reaped += len(victims)
        self._forget_addrs({conn.muxed_conn.peer_id for conn in victims})
        return len(victims)

    def _forget_addrs(self, peers: set[ID]) -> None:
        """Drop the addresses of reaped peers we hold no other connection to.

        py-libp2p 0.8.1's AutoConnector dials every peerstore peer with addresses while the
        host has fewer than 100 connections, 60 s after it left (measured: a peer disconnected
        by the host was dialled back 65 s later). Without this, each reaped holder whose
        identify told us a listen address would come back as an *outbound* connection, never
        reaped and counted against the host's cap. Echo's own dials name their addresses
        (``EchoHost.connect``), so nothing of ours needs them; the peer's next identify puts
        them back."""
        conns = getattr(self._network, "connections", None) or {}
        store = getattr(self._network, "peerstore", None)
        for peer in peers:
            if store is not None and not conns.get(peer):
                store.clear_addrs(peer)

    async def run(self) -> None:
        """Reap every ``reap_interval_s`` until cancelled (start it in the host's nursery)."""
        while True:
            await trio.sleep(self.policy.reap_interval_s)
            await self.reap()


def _peer(peer_id: ID | str) -> ID:
    return peer_id if isinstance(peer_id, ID) else ID.from_base58(peer_id)


class _ActivityNotifee(INotifee):
    """Stamps a connection's activity on every stream opened or closed, in either direction."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def _stamp(self, stream: INetStream) -> None:
        conn = getattr(stream, "swarm_conn", None)
        if conn is not None and not conn.is_closed:
            self._guard.touch(conn)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        self._stamp(stream)

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        self._stamp(stream)

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._guard.touch(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._guard.forget(conn)

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


__all__ = [
    "IDLE_TIMEOUT_S",
    "LOOPBACK_CAP",
    "PRESSURE_FRACTION",
    "PROTECTED_IDLE_TIMEOUT_S",
    "PRIVATE_PREFIX_CAP",
    "PUBLIC_PREFIX_CAP",
    "REAP_INTERVAL_S",
    "ConnectionGuard",
    "GuardPolicy",
    "close_quietly",
    "is_inbound",
    "Prefix",
    "prefix_of",
]
