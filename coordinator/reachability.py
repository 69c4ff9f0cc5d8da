"""The coordinator's dial-backs: which registered nodes can be dialled, for the planner.

:func:`run_reachability` serves :data:`~echo.protocol.reachability.PROTO_DIALBACK` on the
coordinator's host (nodes and ``echo-node doctor`` ask it "can you dial me?") and probes every
node whose addresses no dial-back has judged yet (:meth:`Dissemination.unprobed`: after each
registration that brings new addresses), from a prober host of its own, on a fresh connection
(:mod:`echo.p2p.reachability`). The verdict goes to :meth:`Dissemination.set_reachable`: a node
that cannot be dialled relays only to peers it can reach; two behind NAT may be connected by a punch
(:func:`echo.coordinator.punching.run_punching`, run here beside the dial-backs).

Owns the prober host, its probe tasks and the punching loop; runs until cancelled and raises
nothing else (a failed probe is logged and retried at the next registration).
"""

from __future__ import annotations

import logging

import trio

from echo.coordinator.dissemination import Dissemination
from echo.coordinator.punching import run_punching
from echo.p2p.host import EchoHost
from echo.p2p.reachability import DialBack, observed_ip, open_dialback, serve_dialback

log = logging.getLogger("echo.coordinator.reachability")

# How often the prober looks for nodes to judge, and how many it dials back at once.
POLL_S = 0.2
PARALLEL = 8


async def _probe(
    host: EchoHost, dialback: DialBack, dissemination: Dissemination, node: str, addrs: list[str]
) -> None:
    reply = await dialback.probe(node, addrs, observed_ip(host, node))
    link = dissemination.links.get(node)
    if link is None or link.addrs != addrs:  # re-registered meanwhile: judge the new ones
        return
    dissemination.set_reachable(
        node, reply.reachable, verdict=reply.verdict, observed_ip=reply.observed_ip
    )
    log.info(
        "node %s %s (%s%s)",
        node[-8:],
        "can be dialled" if reply.reachable else "cannot be dialled: relays to dialable peers",
        reply.verdict,
        f", seen from {reply.observed_ip}" if reply.observed_ip else "",
    )


async def run_reachability(host: EchoHost, dissemination: Dissemination) -> None:
    """Serve dial-backs on ``host``, judge every node :class:`Dissemination` learns of and
    punch between the nodes judged "nat"; runs until cancelled."""
    async with open_dialback() as dialback, trio.open_nursery() as nursery:
        serve_dialback(host, dialback)
        nursery.start_soon(run_punching, host, dissemination)
        limiter = trio.CapacityLimiter(PARALLEL)
        busy: set[str] = set()

        async def one(node: str, addrs: list[str]) -> None:
            try:
                async with limiter:
                    await _probe(host, dialback, dissemination, node, addrs)
            except Exception:  # a probe must not take the coordinator down
                log.exception("dial-back of %s failed", node[-8:])
            finally:
                busy.discard(node)

        while True:
            for node, addrs in dissemination.unprobed():
                # Only while it is connected: the observed address is the connection's.
                if node in busy or not addrs or observed_ip(host, node) is None:
                    continue
                busy.add(node)
                nursery.start_soon(one, node, addrs)
            await trio.sleep(POLL_S)


__all__ = ["run_reachability"]
