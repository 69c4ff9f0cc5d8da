"""How long a node waits for a version's push before it pulls the version itself.

A lease reply names the version a node must hold; a plan (by gossip) decides whether the version
arrives pushed down the relay tree. :func:`await_push` lets the node's relay bring it while the
push is worth waiting for: the plan may arrive moments after the lease reply, and the relay pulls
around a stalled parent itself. :func:`until_overtaken` ends the wait once it is not: a newer
version completed first, or the push stalled. The caller then pulls what is missing. Neither
raises; both only wait (every wait bounded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import trio

from echo.node.display import Display
from echo.p2p.relay import Relay
from echo.p2p.relay.transfer import Transfer

log = logging.getLogger("echo.node")

# A lease reply can name a version before its plan arrives by gossip: wait this long for the
# push to start before pulling, then this long for the relay (which pulls around stalls itself)
# to complete the version before falling back to pulling it whole.
PLAN_WAIT_S = 1.0
BROADCAST_WAIT_S = 30.0
# A push that brought no chunk for this long is given up for a direct fetch: a chunk is at most
# 4 MiB, under 10 s on a 4 Mb/s home downlink; the relay's own stall watchdog and its pulls
# from other holders can take longer than that again when those holders sit behind NAT.
BROADCAST_STALL_S = 10.0
# How often a node waiting for a version's push checks whether a newer one completed first:
# a fraction of the fastest version period (about half a second in the tiny demo).
OVERTAKEN_POLL_S = 0.1


async def await_push(relay: Relay | None, display: Display, job_id: str, target: int) -> None:
    """Let ``relay`` bring ``target`` into the node's store if a plan covers the node: wait
    :data:`PLAN_WAIT_S` for its plan, then until the push completes, is overtaken or stalls
    (:func:`until_overtaken`), at most :data:`BROADCAST_WAIT_S`; ``display`` shows its
    progress. Returns at once without a relay."""
    if relay is None:
        return
    t = relay.transfer(job_id, target)
    if t is None:
        with trio.move_on_after(PLAN_WAIT_S):
            while (t := relay.transfer(job_id, target)) is None:
                await trio.sleep(0.02)
    if t is None:
        return
    with trio.move_on_after(BROADCAST_WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_overtaken, relay.transfers, t, nursery.cancel_scope)
            await display.relay_progress(t, target)
            nursery.cancel_scope.cancel()


async def until_overtaken(
    transfers: Mapping[tuple[str, int], Transfer], t: Transfer, scope: trio.CancelScope
) -> None:
    """Cancel ``scope`` once ``t`` is not worth waiting for: a newer version of its job
    completed here first, or no chunk of ``t`` arrived for :data:`BROADCAST_STALL_S`. Its push
    was lost (a parent gone, a path that never came up) and waiting out
    :data:`BROADCAST_WAIT_S` would cost a whole short job (tests/test_nat_swarm: a node behind
    NAT held v1 while v3..v30 arrived and missed the run waiting for v2; another waited 37 s
    for v0 and served nothing). The caller then fetches ``t``'s version from the learner and
    patches on from there."""
    while not t.done.is_set():
        last = t.arrived_at[-1] if t.arrived_at else t.created
        if time.monotonic() - last > BROADCAST_STALL_S:
            log.info("v%d: no chunk pushed for %.0f s: fetching it", t.version, BROADCAST_STALL_S)
            scope.cancel()
            return
        if any(
            o.job_id == t.job_id and o.version > t.version and o.done.is_set()
            for o in list(transfers.values())
        ):
            log.info(
                "v%d overtaken by a newer version before its push completed: fetching it",
                t.version,
            )
            scope.cancel()
            return
        await trio.sleep(OVERTAKEN_POLL_S)
