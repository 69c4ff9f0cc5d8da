"""Relays among volunteers: a public node offers reservations, a node behind NAT takes one.

The coordinator's relay is one place for every node behind NAT to be reached through; in a real
swarm the public volunteers share that load (issue 32). :class:`VolunteerRelays` runs beside the
node's session once its dial-back verdict is in (:meth:`CoordinatorSession.keep_relay_slot`):

- **reachable, with spare uplink** (no upload cap, or one of at least
  :data:`MIN_SPARE_UPLINK_BPS`): it offers circuit relay v2 on its host
  (:func:`echo.p2p.nat.circuit_relay.offer_relay`) with the limits the coordinator's relay has
  (:data:`~echo.p2p.nat.circuit_relay.CONTROL_RELAY_LIMITS`: per circuit 1 MiB and 2 minutes, 4
  circuits per reserved peer, at most 8 reservations per IP and 16 per network). Anyone may
  reserve: the caps, not an admission list, bound what a stranger gets. Its figures are said
  when they change (``volunteer relay: ...``);
- **behind NAT**: besides the coordinator's, it keeps a reservation on one public peer that a
  plan announced with verified addresses (:meth:`saw_plan`: the coordinator vouched for them,
  so the node dials no address a peer merely declared). Peers are tried in an order of their
  own per node (a hash of both ids), so nodes behind NAT spread over the volunteers; one that
  refuses, or does not speak the relay protocol, is skipped for good, one whose slot is lost for
  :data:`LOST_AFTER_S` is left for the next. The circuit address it gets is registered with the
  coordinator at once, which announces it in plans (``coordinator/dissemination/circuits.py``).

Owns its relay (while it offers one), its reservation and their tasks; runs until cancelled
and raises nothing else.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable

import trio

from echo.node.display import Display
from echo.p2p.host import EchoHost
from echo.p2p.nat import dcutr
from echo.p2p.nat.circuit import RelayRefused, Reservation, keep_reservation
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay
from echo.p2p.rpc import RpcError
from echo.protocol import broadcast as b
from echo.protocol.nat import DialBackReply

log = logging.getLogger("echo.node.relay_slots")

# A node offers reservations only with this much uplink to spare (bytes/s): relayed control
# traffic is small, but a volunteer who capped its upload tightly asked us not to spend it.
MIN_SPARE_UPLINK_BPS = 250_000
# A reservation that stays lost this long (the relay left or restarted) is given up.
LOST_AFTER_S = 30.0
# How often the relay's figures are looked at (said only when they changed).
REPORT_S = 10.0
# After the first candidate appears, wait this long for more before picking: the first plans
# name only the public peers whose dial-back is done, and nodes that all picked from those
# piled onto one volunteer (measured: 4 of 4 on p0 in one nat_swarm run).
SETTLE_S = 10.0
# Candidates remembered at most (the newest plan's public peers).
MAX_CANDIDATES = 64
_CIRCUIT = "/p2p-circuit"


class VolunteerRelays:
    """A node's part in relays offered by volunteers (see the module docstring).

    ``announce`` is awaited after a reservation is held (the session registers again, so the
    coordinator learns the circuit address).
    """

    def __init__(
        self,
        host: EchoHost,
        display: Display,
        *,
        upload_limit_bps: float,
        announce: Callable[[], Awaitable[None]],
    ) -> None:
        self.host = host
        self.display = display
        self.offer = not upload_limit_bps or upload_limit_bps >= MIN_SPARE_UPLINK_BPS
        self.announce = announce
        self.me = host.peer_id.to_base58()
        self.candidates: dict[str, str] = {}  # public peer -> its verified address
        self.skipped: set[str] = set()  # refused us, or no relay there
        self.slot: Reservation | None = None  # the reservation held on a volunteer
        self.relay = None  # our relay, while we offer one (echo.p2p.nat.circuit_relay)
        self._changed = trio.Event()

    @property
    def circuit_addrs(self) -> list[str]:
        return [self.slot.circuit_addr] if self.slot is not None and self.slot.active else []

    def saw_plan(self, ann: b.PlanAnnouncement) -> None:
        """Take the public peers of a plan the coordinator signed as relay candidates (the
        first entry is the source: the learner offers no relay)."""
        for p in ann.peers[1:]:
            direct = [a for a in p.addrs if _CIRCUIT not in a]
            if p.peer_id != self.me and direct and p.peer_id not in self.candidates:
                if len(self.candidates) >= MAX_CANDIDATES:
                    self.candidates.pop(next(iter(self.candidates)))
                self.candidates[p.peer_id] = direct[0]
                self._changed.set()

    async def run(self, verdict: DialBackReply | None) -> None:
        """Offer a relay or keep a reservation, by ``verdict``; until cancelled."""
        if verdict is not None and verdict.reachable:
            if self.offer:
                await self._offer()
            return
        if verdict is None:  # nobody knows whether we can be dialled: the coordinator's slot
            return
        while not self.candidates:
            self._changed = trio.Event()
            await self._changed.wait()
        await trio.sleep(SETTLE_S)
        while True:
            pick = self._pick()
            if pick is None:
                self._changed = trio.Event()
                await self._changed.wait()
                continue
            await self._hold(*pick)

    def _pick(self) -> tuple[str, str] | None:
        """The first candidate in this node's own order (spreads nodes over relays)."""

        def rank(peer: str) -> bytes:
            return hashlib.sha256(f"{self.me}|{peer}".encode()).digest()

        left = sorted((p for p in self.candidates if p not in self.skipped), key=rank)
        return (left[0], self.candidates[left[0]]) if left else None

    async def _hold(self, peer: str, addr: str) -> None:
        """Keep a reservation on ``peer`` until it is lost for :data:`LOST_AFTER_S`."""
        try:
            async with keep_reservation(self.host, addr) as res:
                self.slot = res
                self.display.say(
                    f"behind NAT: relay reservation held on volunteer {peer[-8:]} "
                    f"(in {res.reserved_in_s:.2f} s) · reachable through it at {res.circuit_addr}"
                )
                with trio.move_on_after(10.0):
                    await self.announce()
                lost_since = None
                while True:
                    await trio.sleep(1.0)
                    now = trio.current_time()
                    lost_since = None if res.active else (lost_since or now)
                    if lost_since is not None and now - lost_since > LOST_AFTER_S:
                        self.display.say(f"volunteer relay {peer[-8:]} lost: trying another")
                        break
        except (RelayRefused, RpcError, ValueError) as exc:
            log.info("no reservation on volunteer %s: %s", peer[-8:], exc)
        finally:
            self.slot = None
        self.skipped.add(peer)

    async def _offer(self) -> None:
        async with offer_relay(self.host, CONTROL_RELAY_LIMITS) as relay:
            self.relay = relay
            self.display.say(
                "reachable with uplink to spare: offering a circuit relay to peers behind NAT "
                f"(control messages only, at most {CONTROL_RELAY_LIMITS.max_reservations_per_ip}"
                f" reservations per IP, {CONTROL_RELAY_LIMITS.max_reservations_per_network} "
                "per network)"
            )
            last: tuple = ()
            try:
                while True:
                    await trio.sleep(REPORT_S)
                    now = (len(relay.reservations), relay.circuits_opened,
                           relay.circuits_limited, relay.bytes_relayed, dcutr.upgrades(self.host))
                    if now != last:
                        last = now
                        self.display.say(
                            f"volunteer relay: {now[0]} reservations held, {now[1]} circuits "
                            f"opened ({now[2]} cut at a limit), {now[3]} bytes relayed, "
                            f"refused {dict(relay.refused) or 'none'}; {now[4]} peers behind NAT "
                            "dialled us back when asked over their relay (DCUtR)"
                        )
            finally:
                self.relay = None


__all__ = ["MIN_SPARE_UPLINK_BPS", "VolunteerRelays"]
