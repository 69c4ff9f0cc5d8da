"""What a relay knows of other peers: whom it no longer trusts, whom it cannot reach for now,
where to dial them, and how it reports a parent that lied or stalled.

:class:`Peers` is shared by the relay's jobs: the receiver and the watchdog report parents, the
pullers skip excluded and unreachable peers, the pushers and pullers dial through it. It owns
no connection beyond the ones it dials (the host keeps them) and never raises into its callers
except from :meth:`Peers.connect`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
from libp2p.peer.id import ID

from echo.p2p.host import EchoHost
from echo.p2p.nat import dcutr
from echo.p2p.nat.circuit import dial_circuit, dial_direct, has_direct_connection
from echo.p2p.relay.transfer import Transfer
from echo.p2p.rpc import RpcError
from echo.p2p.streams import STREAM_CLOSE_TIMEOUT
from echo.protocol import broadcast as b

log = logging.getLogger(__name__)

BadPeerCallback = Callable[[b.BadPeerReport], None]

# A peer that failed to answer at all is skipped by pulls for this long.
_UNREACHABLE_S = 5.0
# How often a push to a peer without an address looks for that peer's own connection.
_INBOUND_POLL_S = 0.05
# A peer known only by circuit addresses (behind NAT) dials its parents itself when it joins a
# plan; a parent that sees no connection from it within this asks it to over the relay.
_REVERSAL_GRACE_S = 2.0
_CIRCUIT = "/p2p-circuit"


def peer_str(peer: ID | str) -> str:
    """A peer id as the base58 text plans and reports use."""
    return peer if isinstance(peer, str) else peer.to_base58()


class Peers:
    """The relay's standing of other peers (see the module docstring)."""

    def __init__(
        self, host: EchoHost, connect_timeout_s: float, on_bad_peer: BadPeerCallback | None
    ) -> None:
        self.host = host
        self.me = peer_str(host.peer_id)
        self.on_bad_peer = on_bad_peer
        self.connect_timeout_s = connect_timeout_s
        # Never pushed from nor pulled from again (they lied or broke the protocol).
        self.excluded: set[str] = set()
        # Went silent once: pulls prefer other holders.
        self.stalled: set[str] = set()
        self._unreachable: dict[str, float] = {}
        self._addrs: dict[str, list[str]] = {}

    def reachable(self, peer: str, now: float) -> bool:
        """False while ``peer`` is skipped after failing to answer (:meth:`unreachable`)."""
        return self._unreachable.get(peer, 0.0) <= now

    def unreachable(self, peer: str) -> None:
        """``peer`` failed to answer at all: skip it for a few seconds."""
        self._unreachable[peer] = time.monotonic() + _UNREACHABLE_S

    def report(
        self, t: Transfer, peer: str, reason: str, index: int = -1, detail: str = ""
    ) -> None:
        """Exclude (``bad_chunk``, ``protocol``) or mark (``stalled``) ``peer`` and tell
        ``on_bad_peer``, once per peer, reason and transfer. A failing callback is logged."""
        if reason in ("bad_chunk", "protocol"):
            self.excluded.add(peer)
        elif reason == "stalled":
            self.stalled.add(peer)
        if (peer, reason) in t.reported:
            return
        t.reported.add((peer, reason))
        log.warning("%s v%d: parent %s %s (chunk %d) %s", t.job_id, t.version, peer[-8:],
                    reason, index, detail)
        if self.on_bad_peer is not None:
            report = b.BadPeerReport(job_id=t.job_id, version=t.version, peer_id=peer,
                                     reason=reason, chunk_index=index, detail=detail[:200])
            try:
                self.on_bad_peer(report)
            except Exception:
                log.exception("on_bad_peer callback failed")

    def remember_addrs(self, route: b.Route) -> None:
        """Keep the addresses a route gives for its children, sources and origin."""
        peers = [c for kids in route.children for c in kids] + list(route.sources)
        if route.origin is not None:
            peers.append(route.origin)
        for p in peers:
            if p.addrs:
                self._addrs[p.peer_id] = list(p.addrs)

    def connected(self, peer: str, *, direct: bool = False) -> bool:
        """Whether a connection to ``peer`` is up (with ``direct``: one that does not run
        through a circuit relay)."""
        if direct:
            return has_direct_connection(self.host, peer)
        return any(peer_str(p) == peer for p in self.host.connected_peers())

    async def connect(self, peer: str, *, direct: bool = False) -> None:
        """Make sure a connection to ``peer`` exists (dialing a remembered address if needed).

        With ``direct`` (pushes and chunk pulls: bulk data), a connection through a circuit
        relay does not count: the peer is dialled at its remembered addresses, or, without
        any, waited for (a node behind NAT dials its parents); a peer known only by circuit
        addresses that has not dialled us within :data:`_REVERSAL_GRACE_S` is asked over the
        relay to dial us (DCUtR, :mod:`echo.p2p.nat.dcutr`). Without ``direct`` (control messages)
        a circuit address is dialled through its relay.

        :raises RpcError: no remembered address could be dialed, or (``direct``) the peer is
            reached only through a relay.
        """
        if self.connected(peer, direct=direct):
            return
        known = self._addrs.get(peer, [])
        circuits = [a for a in known if _CIRCUIT in a]
        plain = [a for a in known if _CIRCUIT not in a]
        if direct and not plain and circuits:
            # Said at DEBUG: how often pushes need the fallback (the swarm's relays log their
            # circuit counts only every 10 s, which short runs miss).
            log.debug("%s (known by its circuits only) not connected yet: waiting for its dial",
                      peer[-8:])
            started = time.monotonic()
            # One connect timeout in all (a pull from a peer that cannot be reached must not
            # cost more than it did before circuits): its own dial, else DCUtR, else its dial.
            with trio.move_on_after(self.connect_timeout_s):
                with trio.move_on_after(_REVERSAL_GRACE_S):
                    while not self.connected(peer, direct=True):
                        await trio.sleep(_INBOUND_POLL_S)
                if not self.connected(peer, direct=True):
                    await self._reverse(peer, circuits)
                while not self.connected(peer, direct=True):
                    await trio.sleep(_INBOUND_POLL_S)
            log.debug("%s: direct connection %s after %.2f s", peer[-8:],
                      "up" if self.connected(peer, direct=True) else "not up",
                      time.monotonic() - started)
            if not self.connected(peer, direct=True) and self.connected(peer):
                raise RpcError(f"{peer[-8:]} is reached only through a relay: no bulk data")
            return
        errors = []
        if not plain and (direct or not circuits):
            # No address: a peer that cannot be dialled (behind NAT) dials its parents itself
            # (reach_out); wait for that connection.
            with trio.move_on_after(self.connect_timeout_s):
                while not self.connected(peer, direct=direct):
                    await trio.sleep(_INBOUND_POLL_S)
            if direct and not self.connected(peer, direct=True) and self.connected(peer):
                raise RpcError(f"{peer[-8:]} is reached only through a relay: no bulk data")
            return
        for addr in plain or circuits:
            try:
                if _CIRCUIT in addr:
                    await dial_circuit(self.host, addr, timeout=self.connect_timeout_s)
                elif direct:
                    await dial_direct(self.host, addr, timeout=self.connect_timeout_s)
                else:
                    await self.host.connect(addr, timeout=self.connect_timeout_s)
                return
            except (RpcError, ValueError) as exc:
                errors.append(str(exc))
        raise RpcError(f"cannot reach {peer[-8:]}: {'; '.join(errors) or 'no address'}")

    async def _reverse(self, peer: str, circuits: list[str]) -> None:
        """Reach ``peer`` through one of its relays and ask it to dial us (DCUtR). Failures are
        logged: the caller then waits for the peer's own dial as before."""
        for addr in circuits:
            try:
                if not self.connected(peer):
                    await dial_circuit(self.host, addr, timeout=self.connect_timeout_s)
            except (RpcError, ValueError) as exc:
                log.debug("circuit to %s at %s: %s", peer[-8:], addr, exc)
                continue
            ok = await dcutr.upgrade(self.host, peer, timeout=self.connect_timeout_s)
            log.info("asked %s through its relay to dial us (DCUtR): %s", peer[-8:],
                     "direct connection up" if ok else "no direct connection")
            return

    async def reach_out(self, peers: list[b.PeerAddr]) -> None:
        """Dial ``peers`` (a node's parents in a plan) so they can push over a connection this
        node opened: the only way in to a node behind NAT. Failures are logged, never raised."""

        async def one(p: b.PeerAddr) -> None:
            try:
                with trio.move_on_after(self.connect_timeout_s):
                    for addr in p.addrs:
                        if _CIRCUIT in addr:  # reach_out is for direct paths
                            continue
                        try:
                            # A relayed connection to a parent (control messages) is no way
                            # in for its pushes.
                            await dial_direct(self.host, addr, timeout=self.connect_timeout_s)
                            return
                        except (RpcError, ValueError):
                            continue
            except Exception:  # never into the caller
                log.debug("reaching out to %s failed", p.peer_id[-8:], exc_info=True)

        async with trio.open_nursery() as nursery:
            for p in peers:
                if p.addrs and p.peer_id != self.me:
                    nursery.start_soon(one, p)

    async def drop_connection(self, peer: str) -> None:
        """Forget a connection that no longer carries requests, so the next use dials afresh."""
        with trio.move_on_after(STREAM_CLOSE_TIMEOUT):
            try:
                await self.host.disconnect(peer)
            except Exception:  # already gone
                log.debug("disconnecting %s failed", peer[-8:], exc_info=True)
