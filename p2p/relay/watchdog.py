"""The watchdog of a transfer: which stripes still have a healthy feed, and so which missing
chunks must be pulled.

A stripe has no healthy feed when its parent never connected, went silent for
``stall_timeout_s`` (keep-alives from a parent waiting on its own upstream double that), ended
early, or sent a chunk that failed its hash. The :class:`Watchdog` cancels a silent parent's
feed and reports it as ``stalled``, sets ``Transfer.want`` to the missing chunks of unfed
stripes, and starts the transfer's pullers (:class:`~echo.p2p.relay.pull.Puller`) on first need.
A pause of our own process (CPU starvation, a blocked disk) is not blamed on the parents.

It runs as one task per incomplete transfer, in the transfer's nursery, until the transfer is
complete; it owns nothing else and raises nothing.
"""

from __future__ import annotations

import time

import trio

from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.peers import Peers
from echo.p2p.relay.pull import Puller
from echo.p2p.relay.transfer import Transfer

# The watchdog counts a tick this much later than planned as a pause of our own process (CPU
# starvation, a stalled disk): parents are not blamed for it.
_PAUSE_SLACK_S = 1.0


class Watchdog:
    """Watches the feeds of one relay's transfers (see the module docstring)."""

    def __init__(self, config: RelayConfig, peers: Peers, puller: Puller) -> None:
        self.config = config
        self.peers = peers
        self.puller = puller

    async def run(self, t: Transfer) -> None:
        """Decide which missing chunks must be pulled; report silent parents."""
        cfg = self.config
        tick = min(0.5, cfg.stall_timeout_s / 4)
        last = time.monotonic()
        while not t.complete:
            now = time.monotonic()
            pause = now - last - tick
            last = now
            if pause > _PAUSE_SLACK_S:
                # We were not running (starved of CPU, blocked on disk): the silence we would
                # measure is ours, not our parents'. Credit them with the pause.
                for f in t.feeds:
                    f.last_byte += pause
                    f.last_beat += pause
                    f.last_chunk += pause
            fed: set[int] = set()
            for f in t.feeds:
                if f.state != "open":
                    continue
                if now - max(f.last_byte, f.last_beat) > cfg.stall_timeout_s:
                    f.state = "stalled"
                    f.scope.cancel()
                    self.peers.report(t, f.peer, "stalled", detail="no data or keep-alive in time")
                    continue
                # Data is flowing, or the parent says it waits for its own upstream (then give
                # it twice the time before pulling around it).
                recent = now - f.last_byte <= cfg.stall_timeout_s
                waiting = (now - f.last_beat <= cfg.stall_timeout_s
                           and now - f.last_chunk <= 2 * cfg.stall_timeout_s)
                if recent or waiting:
                    fed.add(f.stripe)
            if now - t.created <= cfg.stall_timeout_s:
                # Parents may still be connecting: stripes nobody feeds yet are not lost yet.
                seen = {f.stripe for f in t.feeds}
                fed |= {s for s in range(t.stripes) if s not in seen}
            t.set_want({i for i in t.missing() if t.stripe_of(i) not in fed})
            if t.want:
                self.puller.start(t)
            with trio.move_on_after(tick):
                await t.done.wait()
