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
time the OS did not run the process at all) and how much of each second the loop spent idle in
its I/O wait. While a turn is later than :data:`LAG_SHED_S` or the loop is busy
:data:`BUSY_SHED` of a second, and for :data:`SHED_HOLD_S` after, the :class:`Shedder` puts
proven peers first:

* inbound handshakes from capped prefixes that hold no protected peer's connection are refused
  before any handshake (:meth:`Shedder.refuses_newcomer`, the connection guard's admission);
* streams of peers that are not protected, from capped prefixes, are reset unread
  (:meth:`Shedder.sheds_stream`, :func:`echo.p2p.rpc.serve_stream`);
* their inbound connections are closed (:meth:`Shedder.run`), so that each one's next try is
  a refused handshake, the cheapest thing a host can do with it;
* when the hold ends, their handshakes are admitted at :data:`READMIT_PER_S` for as long as a
  relapse would count and the rate still turns some away, not all at once.

Protected peers (the guard's: the learner, nodes with accepted work) are never shed, and
neither is anything from an uncapped prefix (loopback unless ``loopback_is_network``: tests and
local swarms) or a private network (the operator's own LAN, as the wide rate exempts it). A
volunteer that is new while the loop lags is refused and retries: the node re-registers every
few seconds, so it joins once the lag is gone. Owns: the lag probe and the
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
    close_quietly,
    is_inbound,
)
from echo.p2p.host import EchoHost
from echo.p2p.prefixes import Prefix, prefix_of

logger = logging.getLogger(__name__)

# How often the probe asks to be woken: 10 wake-ups a second cost the loop ~0.1% of a core.
PROBE_S = 0.1
# A loop that runs a ready task this late is behind: an honest request needs ~10 turns of the
# loop (stream open, multiselect, request, handler, reply, close), so 0.2 s a turn is seconds a
# call. Far above an idle or ordinarily busy loop's lag (a few ms).
LAG_SHED_S = 0.2
# A loop that never waits for I/O is saturated: work is queued faster than it runs (or than the
# machine lets it run), and every ready task, the honest ones too, waits behind the queue. The
# share of a window the loop is not idle in epoll, over windows of this length. Measured in the
# attack benchmark (load ~20): busy with every attacker, lease calls at 1.7 s while no single
# turn was 0.2 s late.
BUSY_SHED = 0.9
BUSY_WINDOW_S = 1.0
# Shedding lasts this long after the last late turn or busy window: strangers shut out come
# back at once, and a shorter hold lets them in to saturate the loop again.
SHED_HOLD_S = 10.0
# Saturated again within this long of a hold's end: the strangers let back in saturated it at
# once (run 5: 1.5 s after each 10 s hold), so the next hold is twice as long, up to this many
# times SHED_HOLD_S; a calm spell of RELAPSE_S starts again from one hold.
RELAPSE_S = 10.0
MAX_HOLD_FACTOR = 8
# How often, while shedding, strangers' connections are looked for and closed.
SHED_SWEEP_S = 0.5
# After a hold, strangers' handshakes come back at this rate (burst READMIT_BURST) for as long
# as a relapse would count (RELAPSE_S times the hold's multiple): every stranger shut out during
# the hold retried at once when it ended, the loop saturated within 2 s, and the honest calls of
# those 2 s were the attack phase's slowest (lease 0.4-1.1 s, submit 1.3-1.4 s in two runs of
# benchmarks/attack.py, each just after "back to normal").
READMIT_PER_S = 1.0
READMIT_BURST = 2
# ... and for as long after as the rate still turns strangers away, the readmission lasts, and a
# saturation meanwhile is a relapse: ending it on the clock let the ones still queued in at
# once. In one run (benchmarks/attack.py, 60 s phases) the loop saturated again 1.1-1.2 s after
# each 10 s readmission ended, three times in a row, each time 11 s after the hold (no relapse:
# the hold never grew), with honest leases at 0.38-0.44 s against a p50 of 48 ms.


class _IdleClock(trio.abc.Instrument):
    """Seconds the loop spent waiting for I/O with nothing else to run (trio calls its I/O wait
    with a zero timeout while tasks are ready: those are not idle)."""

    def __init__(self) -> None:
        self.idle_s = 0.0
        self._since: float | None = None

    def before_io_wait(self, timeout: float) -> None:
        self._since = time.perf_counter() if timeout > 0 else None

    def after_io_wait(self, timeout: float) -> None:
        if self._since is not None:
            self.idle_s += time.perf_counter() - self._since
            self._since = None


class LoopLag:
    """Whether the trio loop this runs on is behind (see the module docstring): a turn later than
    ``threshold_s``, or a window of :data:`BUSY_WINDOW_S` in which the loop was idle less than
    ``1 - busy_share`` of the time. Either starts a hold of ``hold_s``, doubled for each
    relapse within :data:`RELAPSE_S` of the last hold's end (up to :data:`MAX_HOLD_FACTOR`).
    ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(
        self,
        threshold_s: float = LAG_SHED_S,
        hold_s: float = SHED_HOLD_S,
        busy_share: float = BUSY_SHED,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold_s <= 0 or hold_s < 0 or not 0 < busy_share <= 1:
            raise ValueError(
                f"need threshold_s > 0, hold_s >= 0, 0 < busy_share <= 1: "
                f"{threshold_s}, {hold_s}, {busy_share}"
            )
        self.threshold_s, self.hold_s, self.busy_share = threshold_s, hold_s, busy_share
        self._clock = clock
        self._until = float("-inf")
        self._factor = 1  # the hold's multiple: doubled by each relapse (see _hold)
        self._paced_at = float("-inf")  # when the readmission's rate last turned one away
        self.worst_s = 0.0  # the largest lag seen, ever (for logs and tests)
        self.busiest = 0.0  # the largest busy share of a window, ever
        self.late_turns = 0  # probes over the threshold, ever
        self.busy_windows = 0  # windows over the busy share, ever

    def _hold(self) -> None:
        now = self._clock()
        if now >= self._until:  # a new episode: a relapse soon after the last one holds longer
            relapse = now - self._until < RELAPSE_S or self.readmitting
            self._factor = min(self._factor * 2, MAX_HOLD_FACTOR) if relapse else 1
        self._until = max(self._until, now + self.hold_s * self._factor)

    def observe(self, lag_s: float) -> None:
        """One measured lag: a late one starts (or extends) the shedding hold."""
        self.worst_s = max(self.worst_s, lag_s)
        if lag_s > self.threshold_s:
            self.late_turns += 1
            self._hold()

    def observe_busy(self, share: float) -> None:
        """The share of one window the loop was not idle: a saturated one starts the hold."""
        self.busiest = max(self.busiest, share)
        if share >= self.busy_share:
            self.busy_windows += 1
            self._hold()

    @property
    def lagging(self) -> bool:
        return self._clock() < self._until

    def now(self) -> float:
        """The clock's time (monotonic seconds)."""
        return self._clock()

    @property
    def readmitting(self) -> bool:
        """Whether a hold ended so recently that strangers come back at a bounded rate, or the
        rate turned one away within :data:`RELAPSE_S` (:meth:`paced`)."""
        now = self._clock()
        since = now - self._until
        recent = since < RELAPSE_S * self._factor or now - self._paced_at < RELAPSE_S
        return since >= 0 and recent

    def paced(self) -> None:
        """The readmission's rate turned a stranger away: it goes on while that happens."""
        self._paced_at = self._clock()

    async def run(self, probe_s: float = PROBE_S) -> None:
        """Measure until cancelled."""
        idle = _IdleClock()
        trio.lowlevel.add_instrument(idle)
        try:
            window_at, idle_at = time.perf_counter(), idle.idle_s
            while True:
                asked = time.monotonic()
                await trio.sleep(probe_s)
                self.observe(time.monotonic() - asked - probe_s)
                now = time.perf_counter()
                if now - window_at >= BUSY_WINDOW_S:
                    self.observe_busy(1.0 - (idle.idle_s - idle_at) / (now - window_at))
                    window_at, idle_at = now, idle.idle_s
        finally:
            trio.lowlevel.remove_instrument(idle)


class Shedder:
    """Puts ``guard``'s protected peers first while ``lag`` says the loop is behind."""

    def __init__(self, guard: ConnectionGuard, lag: LoopLag | None = None) -> None:
        self.guard, self.lag = guard, lag or LoopLag()
        self.refused = 0  # handshakes refused while shedding, ever
        self.streams = 0  # streams reset unread while shedding, ever
        self.closed = 0  # stranger connections closed while shedding, ever
        self.paced = 0  # handshakes refused for the readmission's rate, ever
        self._tokens, self._refilled_at = float(READMIT_BURST), float("-inf")

    def _capped(self, address: str | None) -> bool:
        prefix = prefix_of(address) if address else None
        return self._sheddable(prefix)

    def _sheddable(self, prefix: Prefix | None) -> bool:
        # Private networks are the operator's own (a LAN lab, nodes behind the same router as
        # the coordinator, the NAT emulation's routers): as with the wide rate, never shed.
        if prefix is None or prefix.kind == "private":
            return False
        return self.guard.policy.cap_for(prefix) is not None

    def refuses_newcomer(self, address: str) -> bool:
        """Whether a handshake from ``address`` is refused now: its prefix is capped and holds
        no protected peer's connection, and the loop lags, or a hold just ended and the
        readmission's rate is spent."""
        lagging = self.lag.lagging
        if not (lagging or self.lag.readmitting) or not self._capped(address):
            return False
        prefix = prefix_of(address)
        for conn in self.guard.connections():
            mine = self.guard.is_protected(conn.muxed_conn.peer_id)
            if mine and self.guard.where(conn)[1] == prefix:
                return False
        if lagging:
            self.refused += 1
            return True
        now = self.lag.now()
        if self._refilled_at == float("-inf"):
            self._refilled_at = now
        self._tokens = min(
            float(READMIT_BURST), self._tokens + (now - self._refilled_at) * READMIT_PER_S
        )
        self._refilled_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return False
        self.paced += 1
        self.lag.paced()
        return True

    def holds_back(self, address: str | None) -> bool:
        """Whether optional work for a stranger at ``address`` (a dial-back) waits now: the loop
        lags or a hold's readmission is under way, and the address is on a capped network."""
        return (self.lag.lagging or self.lag.readmitting) and self._capped(address)

    def sheds_stream(self, peer_id: ID, address: str | None) -> bool:
        """Whether a stream of ``peer_id`` (from ``address``) is reset unread now."""
        if not self.lag.lagging or self.guard.is_protected(peer_id) or not self._capped(address):
            return False
        self.streams += 1
        return True

    def strangers(self) -> list:
        """Inbound connections of unprotected peers from capped prefixes."""
        out = []
        for conn in self.guard.connections():
            if not is_inbound(conn) or self.guard.is_protected(conn.muxed_conn.peer_id):
                continue
            if self._sheddable(self.guard.where(conn)[1]):
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
                        "loop %s (worst turn %.2f s late, busiest %.0f%%): %s strangers "
                        "from capped public networks",
                        "saturated" if now else "back to normal",
                        self.lag.worst_s,
                        100 * self.lag.busiest,
                        "shedding" if now else "serving again",
                    )
                    was = now
                if not now:
                    continue
                victims = self.strangers()
                if victims:
                    async with trio.open_nursery() as closing:
                        for conn in victims:
                            self.guard.forget(conn)
                            closing.start_soon(close_quietly, conn, REAP_CLOSE_TIMEOUT_S)
                    self.closed += len(victims)


def install_shedder(host: EchoHost, lag: LoopLag | None = None) -> Shedder:
    """Shed strangers first on ``host`` while its loop lags: hooks its guard's admission and
    its stream handlers; the caller runs :meth:`Shedder.run` in a nursery of its own."""
    shedder = Shedder(host.guard, lag)
    host.guard.refuse_newcomer = shedder.refuses_newcomer
    host.shed_stream = shedder.sheds_stream
    return shedder


__all__ = [
    "BUSY_SHED",
    "BUSY_WINDOW_S",
    "LAG_SHED_S",
    "PROBE_S",
    "READMIT_BURST",
    "READMIT_PER_S",
    "RELAPSE_S",
    "SHED_HOLD_S",
    "LoopLag",
    "Shedder",
    "install_shedder",
]
