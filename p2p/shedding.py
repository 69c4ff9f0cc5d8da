"""Strangers shed first while a host's event loop lags: the coordinator's priority for proven peers.

Every request a host serves runs on one trio loop. When more work arrives than that loop gets
CPU for -- a machine shared with other work, strangers that open connections and streams as fast
as they can -- every task waits its turn, the proven peers' with the rest. Measured in
``benchmarks/attack.py`` with every attacker (2 busy cores, load 17-25): the coordinator's
process was runnable for all but a few percent of the attack phase (py-spy ``--idle`` never
caught its loop waiting in ``epoll``; ``/proc/<pid>/task/*/schedstat`` had it 105% of the phase
in the run queue against 7.5% on a core), so it was saturated at the share of a core it got,
and honest lease calls waited 8-10 s behind strangers' connections and streams (TCP, Noise,
yamux frames, multiselect, pubsub hello) -- work that happens before any handler or budget of
ours can tell who asked.

:class:`LoopLag` measures how late the loop runs a task that asked to sleep (it includes the
time the OS did not run the process at all). While that lag is over :data:`LAG_SHED_S`, and
for :data:`SHED_HOLD_S` after, the :class:`Shedder` puts proven peers first:

* inbound handshakes from capped prefixes that hold no protected peer's connection are refused
  before any handshake (:meth:`Shedder.refuses_newcomer`, the connection guard's admission);
* streams of peers that are not protected, from capped prefixes, are reset unread
  (:meth:`Shedder.sheds_stream`, :func:`echo.p2p.rpc.serve_stream`);
* their inbound connections are closed (:meth:`Shedder.run`), so that each one's next try is
  a refused handshake, the cheapest thing a host can do with it.

Protected peers (the guard's: the learner, nodes with accepted work) are never shed, and
neither is anything from an uncapped prefix (loopback unless ``loopback_is_network``: tests and
local swarms). A volunteer that is new while the loop lags is refused and retries: the node
re-registers every few seconds, so it joins once the lag is gone. Owns: the lag probe and the
shedding task (run both in the host's nursery via :meth:`Shedder.run`); closes stranger
connections; raises nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
from libp2p.peer.id import ID

from echo.p2p.conn_guard import (
    REAP_CLOSE_TIMEOUT_S,
    ConnectionGuard,
    _close_quietly,
    _is_inbound,
    _remote_endpoint,
)
from echo.p2p.host import EchoHost
from echo.p2p.prefixes import prefix_of

logger = logging.getLogger(__name__)

# How often the probe asks to be woken: 10 wake-ups a second cost the loop ~0.1% of a core.
PROBE_S = 0.1
# A loop that runs a ready task this late is behind: an honest request needs ~10 turns of the
# loop (stream open, multiselect, request, handler, reply, close), so 0.2 s a turn is seconds a
# call. Far above an idle or ordinarily busy loop's lag (a few ms).
LAG_SHED_S = 0.2
# Shedding lasts this long after the last late turn: strangers shut out come back at once, and
# a shorter hold lets them in to load the loop again between two probes.
SHED_HOLD_S = 5.0
# How often, while shedding, strangers' connections are looked for and closed.
SHED_SWEEP_S = 0.5


class LoopLag:
    """Whether the trio loop this runs on is behind (see the module docstring); ``clock`` is
    monotonic seconds (injectable for tests)."""

    def __init__(
        self,
        threshold_s: float = LAG_SHED_S,
        hold_s: float = SHED_HOLD_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold_s <= 0 or hold_s < 0:
            raise ValueError(f"threshold_s must be > 0 and hold_s >= 0: {threshold_s}, {hold_s}")
        self.threshold_s, self.hold_s, self._clock = threshold_s, hold_s, clock
        self._until = float("-inf")
        self.worst_s = 0.0  # the largest lag seen, ever (for logs and tests)
        self.late_turns = 0  # probes over the threshold, ever

    def observe(self, lag_s: float) -> None:
        """One measured lag: a late one starts (or extends) the shedding hold."""
        self.worst_s = max(self.worst_s, lag_s)
        if lag_s > self.threshold_s:
            self.late_turns += 1
            self._until = self._clock() + self.hold_s

    @property
    def lagging(self) -> bool:
        return self._clock() < self._until

    async def run(self, probe_s: float = PROBE_S) -> None:
        """Measure until cancelled."""
        while True:
            asked = time.monotonic()
            await trio.sleep(probe_s)
            self.observe(time.monotonic() - asked - probe_s)


class Shedder:
    """Puts ``guard``'s protected peers first while ``lag`` says the loop is behind."""

    def __init__(self, guard: ConnectionGuard, lag: LoopLag | None = None) -> None:
        self.guard, self.lag = guard, lag or LoopLag()
        self.refused = 0  # handshakes refused while shedding, ever
        self.streams = 0  # streams reset unread while shedding, ever
        self.closed = 0  # stranger connections closed while shedding, ever

    def _capped(self, address: str | None) -> bool:
        prefix = prefix_of(address) if address else None
        return prefix is not None and self.guard.policy.cap_for(prefix) is not None

    def refuses_newcomer(self, address: str) -> bool:
        """Whether a handshake from ``address`` is refused now: the loop lags, its prefix is
        capped and holds no protected peer's connection."""
        if not self.lag.lagging or not self._capped(address):
            return False
        prefix = prefix_of(address)
        for conn in self.guard._connections():
            if conn.muxed_conn.peer_id in self.guard._protected:
                ep = _remote_endpoint(conn)
                if ep is not None and prefix_of(ep[0]) == prefix:
                    return False
        self.refused += 1
        return True

    def sheds_stream(self, peer_id: ID, address: str | None) -> bool:
        """Whether a stream of ``peer_id`` (from ``address``) is reset unread now."""
        if not self.lag.lagging or self.guard.is_protected(peer_id) or not self._capped(address):
            return False
        self.streams += 1
        return True

    def strangers(self) -> list:
        """Inbound connections of unprotected peers from capped prefixes."""
        out = []
        for conn in self.guard._connections():
            if not _is_inbound(conn) or conn.muxed_conn.peer_id in self.guard._protected:
                continue
            ep = _remote_endpoint(conn)
            if ep is not None and self._capped(ep[0]):
                out.append(conn)
        return out

    async def run(self) -> None:
        """Probe the loop's lag and, while it lags, close strangers' connections (until
        cancelled; start it in the host's nursery)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.lag.run)
            was = False
            while True:
                await trio.sleep(SHED_SWEEP_S)
                now = self.lag.lagging
                if now != was:
                    logger.info(
                        "loop lag %s (worst %.2f s): %s strangers",
                        "over" if now else "back under",
                        self.lag.worst_s,
                        "shedding" if now else "serving",
                    )
                    was = now
                if not now:
                    continue
                victims = self.strangers()
                if victims:
                    async with trio.open_nursery() as closing:
                        for conn in victims:
                            self.guard.forget(conn)
                            closing.start_soon(_close_quietly, conn, REAP_CLOSE_TIMEOUT_S)
                    self.closed += len(victims)


def install_shedder(host: EchoHost, lag: LoopLag | None = None) -> Shedder:
    """Shed strangers first on ``host`` while its loop lags: hooks its guard's admission and
    its stream handlers; the caller runs :meth:`Shedder.run` in a nursery of its own."""
    shedder = Shedder(host.guard, lag)
    host.guard.refuse_newcomer = shedder.refuses_newcomer
    host.shed_stream = shedder.sheds_stream
    return shedder


__all__ = ["LAG_SHED_S", "PROBE_S", "SHED_HOLD_S", "LoopLag", "Shedder", "install_shedder"]
