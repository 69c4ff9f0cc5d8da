"""The coordinator's go signals: direct connections between nodes behind NAT.

The coordinator is the one peer connected to both nodes of a pair that no dial-back reached, so
it sends the go signal: :func:`run_punching` asks :meth:`RelayBeliefs.punch_pairs` for pairs,
sends each node of a pair a :class:`~echo.protocol.nat.PunchRequest` at the same moment
(over the connection the node keeps to the coordinator), waits for both
:class:`~echo.protocol.nat.PunchReply` answers and books the pair with
:meth:`RelayBeliefs.set_punched`: a path exists only when both ends said ok, and only then does
the planner use it.

Owns its per-pair tasks (in its nursery); runs until cancelled and raises nothing else (a pair
whose request fails counts as failed, so it is not retried while its addresses stay the same).
"""

from __future__ import annotations

import logging
from collections import Counter

import trio

from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.dissemination.punch_pairs import PunchPair, pair_key
from echo.p2p.host import EchoHost
from echo.p2p.nat.dialback import observed_ip
from echo.p2p.nat.holepunch import PUNCH_TIMEOUT_S
from echo.p2p.rpc import RpcError
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.nat import PROTO_PUNCH, PunchReply, PunchRequest

log = logging.getLogger("echo.coordinator.dissemination.punching")

# How often we look for pairs to punch.
POLL_S = 0.5
# Pairs in flight at once (each holds two node tasks for up to the punch timeout).
PARALLEL = 16
# Both requests leave together; the start gives the slower one time to arrive (a round trip to
# a busy home node) so both sides dial within a fraction of a second of each other.
GO_DELAY_S = 2.0
# The reply comes when the punch is over: delay + punch timeout, plus the handshakes' slack.
REPLY_TIMEOUT_S = GO_DELAY_S + PUNCH_TIMEOUT_S + 5.0
_REPLY_MAX = 1024


async def _ask(host: EchoHost, node: str, req: PunchRequest) -> PunchReply:
    """Send one node its go signal; a failed call is a failed punch. Never raises."""
    try:
        raw = await host.request(
            node, PROTO_PUNCH, m.encode(req), timeout=REPLY_TIMEOUT_S, max_response=_REPLY_MAX
        )
        return m.decode(PunchReply, raw)
    except (RpcError, ProtocolError) as exc:
        return PunchReply(ok=False, detail=f"request failed: {exc}"[:250])


async def punch_pair(host: EchoHost, dissemination: Dissemination, pair: PunchPair) -> bool:
    """Ask both nodes of ``pair`` to connect now, book the outcome; True when both said ok."""
    replies: dict[str, PunchReply] = {}

    async def one(node: str, peer: str, addrs: tuple[str, ...]) -> None:
        req = PunchRequest(
            peer_id=peer,
            method=pair.method,
            peer_addrs=list(addrs),
            start_in_s=GO_DELAY_S,
            timeout_s=PUNCH_TIMEOUT_S,
        )
        replies[node] = await _ask(host, node, req)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, pair.a, pair.b, pair.addrs_for_a)
        nursery.start_soon(one, pair.b, pair.a, pair.addrs_for_b)
    ra, rb = replies[pair.a], replies[pair.b]
    ok = ra.ok and rb.ok
    dissemination.relays.set_punched(pair, ok)
    if ok:
        log.info(
            "punched %s <-> %s (%s): ok via %s/%s in %.2f/%.2f s",
            pair.a[-8:], pair.b[-8:], pair.method, ra.via, rb.via, ra.elapsed_s, rb.elapsed_s,
        )
    else:
        log.info(
            "punched %s <-> %s (%s): failed (%s | %s)",
            pair.a[-8:], pair.b[-8:], pair.method,
            "ok" if ra.ok else ra.detail[:120], "ok" if rb.ok else rb.detail[:120],
        )
    return ok


async def run_punching(host: EchoHost, dissemination: Dissemination) -> None:
    """Connect the pairs :class:`~.relays.RelayBeliefs` names, :data:`PARALLEL` at once (each node
    in a few at most, see :func:`~echo.coordinator.dissemination.punch_pairs.punch_pairs`); runs
    until cancelled."""
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(PARALLEL)
        busy: Counter[str] = Counter()
        in_flight: set[frozenset[str]] = set()

        async def one(pair: PunchPair) -> None:
            try:
                async with limiter:
                    await punch_pair(host, dissemination, pair)
            except Exception:  # a punch must not take the coordinator down
                log.exception("punch %s <-> %s failed", pair.a[-8:], pair.b[-8:])
            finally:
                busy.subtract((pair.a, pair.b))
                in_flight.discard(pair_key(pair.a, pair.b))

        while True:
            for pair in dissemination.relays.punch_pairs(busy, in_flight):
                # Only while both are connected: the go signal travels on their connections.
                if observed_ip(host, pair.a) is None or observed_ip(host, pair.b) is None:
                    continue
                busy.update((pair.a, pair.b))
                in_flight.add(pair_key(pair.a, pair.b))
                nursery.start_soon(one, pair)
            await trio.sleep(POLL_S)


__all__ = ["run_punching", "punch_pair"]
