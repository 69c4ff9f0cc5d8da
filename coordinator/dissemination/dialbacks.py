"""The coordinator's dial-backs: which registered nodes can be dialled, for the planner.

:func:`run_reachability` serves :data:`~echo.protocol.nat.PROTO_DIALBACK` on the
coordinator's host (nodes and ``echo-node doctor`` ask it "can you dial me?") and probes every
node whose addresses no dial-back has judged yet (after each registration that brings new
addresses), from a prober host of its own, on a fresh connection (:mod:`echo.p2p.nat.dialback`).
The verdict goes to :meth:`~.relays.RelayBeliefs.set_reachable`: a node that cannot be dialled
relays only to peers it can reach; two behind NAT may be connected by a punch
(:func:`echo.coordinator.dissemination.punching.run_punching`, run here beside the dial-backs).

The nodes to probe come from a :class:`ProbeQueue` that registrations feed
(``RelayBeliefs.on_new_addrs``), not from a scan of every link ever registered: a churn of
identities that register and leave left thousands of unprobed links, each looked up (a base58
decode and a connection lookup) every :data:`POLL_S`. A node that is not connected when its turn
comes waits at most :data:`PENDING_S`.

Nodes with accepted work are probed at once (``worked``, and :meth:`ProbeQueue.earned` on a
node's first accepted group); others only from a small shared budget (:data:`STRANGER_BURST`,
then one every :data:`STRANGER_EVERY_S`), and none while the coordinator sheds the stranger's
network (:attr:`ProbeQueue.held_back`). Identities are free, and a churn of them cost the
coordinator a second connection each (TCP, Noise, yamux, identify), about a third of the ~40 ms
of CPU a churned identity cost (``benchmarks/churn_cost.py``); with no probe at all before
accepted work, though, a swarm that starts at once was planned for its first minute as if every
node were behind NAT, and the circuits that reach a NAT'd node slow to dial its parent were
never announced (``tests/e2e/test_nat_swarm.py``). A node without a verdict is planned as not
dialable: it receives over the connections it opens to its parents, as a node behind NAT does.

Owns the prober host, its probe tasks, the queue and the punching loop; runs until cancelled and
raises nothing else (a failed probe is logged and retried at the next registration).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.dissemination.punching import run_punching
from echo.p2p.host import EchoHost
from echo.p2p.nat.dialback import DialBack, observed_ip, open_dialback, serve_dialback

log = logging.getLogger("echo.coordinator.dissemination.dialbacks")

# How often the prober looks for nodes to judge, and how many it dials back at once.
POLL_S = 0.2
PARALLEL = 8
# A node waiting for its dial-back is only probed while connected (the observed address is the
# connection's); one that stays away this long is dropped until it registers again. A node dials
# the coordinator to register, so an honest one is connected at once.
PENDING_S = 30.0
# Dial-backs for nodes with no accepted work: a burst that judges an operator's swarm started at
# once (the NAT swarm's 7 nodes, a lab's 16), then one every 2 s, so a churn of identities at
# 5 a second costs one probe in ten.
STRANGER_BURST = 16
STRANGER_EVERY_S = 2.0
# Nodes waiting at once, at most (oldest dropped): registrations are admission-limited per peer
# and per network, so this is only a backstop against a churn of identities from many networks.
MAX_PENDING = 10_000


class ProbeQueue:
    """The nodes whose addresses await a dial-back, in the order they asked; fed by
    registrations (:meth:`wanted`), drained by :func:`run_reachability` (:meth:`due`). Work per
    poll is proportional to the nodes waiting, never to every node ever registered. Raises
    nothing."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        worked: Callable[[str], bool] | None = None,
        stranger_burst: int | None = None,
        stranger_every_s: float | None = None,
    ) -> None:
        self._clock = clock
        # Whether a node has accepted work (None: every node is probed). One without is
        # probed from the strangers' budget, else when it :meth:`earned` it.
        self._worked = worked
        self._pending: dict[str, float] = {}  # node -> when it (last) asked, oldest first
        self._burst = STRANGER_BURST if stranger_burst is None else stranger_burst
        self._every_s = STRANGER_EVERY_S if stranger_every_s is None else stranger_every_s
        self._tokens, self._filled_at = float(self._burst), clock()
        # Whether work for this stranger waits now (set by the service from its shedder: the
        # loop lags or a hold's readmission is under way, and the node is on a capped network).
        # Then it is not probed and the budget does not refill: it refilled during each hold,
        # and every churned identity the readmission let in was dialled back on a loop that
        # had just saturated (benchmarks/attack.py; docs/results/2026-12-07-attack-goals.md).
        self.held_back: Callable[[str], bool] = lambda node_id: False

    def __len__(self) -> int:
        return len(self._pending)

    def wanted(self, node_id: str) -> None:
        """The node registered addresses no dial-back has judged: probe it (again) if it has
        accepted work or the strangers' budget has a probe left; else once it earns one."""
        if self._worked is None or self._worked(node_id) or self._take_stranger(node_id):
            self._enqueue(node_id)

    def _take_stranger(self, node_id: str) -> bool:
        now = self._clock()
        if self.held_back(node_id):
            self._filled_at = now  # no refill for the time spent shedding
            return False
        if self._every_s > 0:
            self._tokens = min(self._burst, self._tokens + (now - self._filled_at) / self._every_s)
        self._filled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def earned(self, node_id: str) -> None:
        """The node's first group was accepted: probe its addresses if no dial-back judged
        them yet (:meth:`due` drops it otherwise)."""
        self._enqueue(node_id)

    def _enqueue(self, node_id: str) -> None:
        self._pending.pop(node_id, None)  # re-inserted last: the newest
        self._pending[node_id] = self._clock()
        while len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]

    def due(
        self, dissemination: Dissemination, ready: Callable[[str], bool]
    ) -> list[tuple[str, list[str]]]:
        """(node, addresses) to probe now, taken off the queue: those still unjudged and
        ``ready`` (connected, and no probe of theirs running). Nodes judged meanwhile, without
        addresses or gone are dropped; the others stay until :data:`PENDING_S` after they
        asked."""
        now, out = self._clock(), []
        for node, at in list(self._pending.items()):
            link = dissemination.relays.links.get(node)
            if link is None or link.reachable is not None or not link.addrs:
                del self._pending[node]
            elif ready(node):
                del self._pending[node]
                out.append((node, list(link.addrs)))
            elif now - at > PENDING_S:
                del self._pending[node]
        return out


async def _probe(
    host: EchoHost, dialback: DialBack, dissemination: Dissemination, node: str, addrs: list[str]
) -> None:
    reply = await dialback.probe(node, addrs, observed_ip(host, node))
    link = dissemination.relays.links.get(node)
    if link is None or link.addrs != addrs:  # re-registered meanwhile: judge the new ones
        return
    dissemination.relays.set_reachable(
        node,
        reply.reachable,
        verdict=reply.verdict,
        observed_ip=reply.observed_ip,
        dialed=reply.dialed,  # plans then carry exactly the address that answered
    )
    log.info(
        "node %s %s (%s%s)",
        node[-8:],
        "can be dialled" if reply.reachable else "cannot be dialled: relays to dialable peers",
        reply.verdict,
        f", seen from {reply.observed_ip}" if reply.observed_ip else "",
    )


async def run_reachability(
    host: EchoHost, dissemination: Dissemination, probes: ProbeQueue | None = None
) -> None:
    """Serve dial-backs on ``host``, judge the nodes :class:`Dissemination` learns of that
    ``probes`` lets through (default: every one) and punch between the nodes judged "nat";
    runs until cancelled."""
    probes = probes if probes is not None else ProbeQueue()
    # Registrations feed the queue through Dissemination's hook.
    dissemination.relays.on_new_addrs = probes.wanted
    for node, _ in dissemination.relays.unprobed():  # registered before the hook was set
        probes.wanted(node)

    async with open_dialback() as dialback, trio.open_nursery() as nursery:
        serve_dialback(host, dialback)
        nursery.start_soon(run_punching, host, dissemination)
        limiter = trio.CapacityLimiter(PARALLEL)
        busy: set[str] = set()

        def ready(node: str) -> bool:
            # A node re-registered during its probe waits for it: that probe's verdict is
            # about its old addresses and is dropped (_probe).
            return node not in busy and observed_ip(host, node) is not None

        async def one(node: str, addrs: list[str]) -> None:
            try:
                async with limiter:
                    await _probe(host, dialback, dissemination, node, addrs)
            except Exception:  # a probe must not take the coordinator down
                log.exception("dial-back of %s failed", node[-8:])
            finally:
                busy.discard(node)

        while True:
            for node, addrs in probes.due(dissemination, ready):
                busy.add(node)
                nursery.start_soon(one, node, addrs)
            await trio.sleep(POLL_S)


__all__ = ["PENDING_S", "ProbeQueue", "run_reachability"]
