"""Pulling around stalls: fetching the chunks a transfer wants from peers that hold them.

The watchdog (:mod:`.watchdog`) decides which missing chunks are wanted (``Transfer.want``) and
starts the :class:`Puller`'s tasks for a transfer on first need. Then, until the transfer is
complete, a poller keeps the have-maps (``/echo/have/1.0.0``) of the route's sources and the
transfer's parents fresh, a few requests at a time, and ``pull_parallel`` workers fetch wanted
chunks with :func:`~echo.p2p.chunkstore.fetch_chunk`: the lowest wanted chunk from its least
busy holder, and from the route's origin (the publisher) when nobody else has shown a chunk for
``origin_grace_s``. A holder that sends a chunk failing its hash is reported as ``bad_chunk``
and excluded; one that does not answer is skipped for a while.

The puller also answers other relays' have-map requests (:meth:`Puller.on_have`). It owns the
tasks it starts (in the transfer's nursery) and no stream: requests go through the host.
Nothing raises into the caller.
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.peer.id import ID

from echo.p2p.chunkstore import ChunkHashMismatch, fetch_chunk
from echo.p2p.host import EchoHost
from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.intake import Intake, StoreError
from echo.p2p.relay.peers import Peers
from echo.p2p.relay.transfer import PeerHave, Transfer
from echo.p2p.rpc import RemoteError, RpcConnectionError, RpcError
from echo.protocol import broadcast as b
from echo.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

# Have-maps: refreshed this often while chunks are wanted, a few requests at a time.
_HAVE_REFRESH_S = 1.0
_HAVE_PARALLEL = 8
_HAVE_TIMEOUT_S = 5.0
# Concurrent pulls from one peer, and how often an idle pull worker looks again.
_PULLS_PER_PEER = 2
_PULL_IDLE_S = 0.2


class Puller:
    """Pulls the wanted chunks of one relay's transfers (see the module docstring)."""

    def __init__(self, host: EchoHost, config: RelayConfig, peers: Peers, intake: Intake,
                 transfers: dict[tuple[str, int], Transfer]) -> None:
        self.host = host
        self.config = config
        self.peers = peers
        self.intake = intake
        self.transfers = transfers

    def start(self, t: Transfer) -> None:
        """Start the have-map poller and the pull workers of ``t`` (once, when it first wants
        chunks; they end when it completes)."""
        if t.pullers_started or t.nursery is None:
            return
        t.pullers_started = True
        t.nursery.start_soon(self._have_poller, t)
        for w in range(max(1, self.config.pull_parallel)):
            t.nursery.start_soon(self._pull_worker, t, w)

    async def on_have(self, peer_id: ID, data: bytes) -> bytes:
        """Answer a have-map request: which chunks of that version are here (none if unknown).

        :raises ProtocolError: a malformed request (the RPC server answers with an error).
        """
        req = b.decode(b.HaveRequest, data)
        t = self.transfers.get((req.job_id, req.version))
        if t is None:
            return b.encode(b.HaveReply(chunks=0, bitmap=b""))
        return b.encode(b.HaveReply(chunks=t.n, bitmap=bytes(t.bitmap), complete=t.complete))

    def _poll_targets(self, t: Transfer) -> list[str]:
        """Peers whose have-maps are worth asking for: route sources and parents, alive."""
        now = time.monotonic()
        peers = [p.peer_id for p in t.route.sources] if t.route else []
        peers += [f.peer for f in t.feeds]
        origin = t.route.origin.peer_id if t.route and t.route.origin else None
        out: list[str] = []
        for p in peers:
            if (p in out or p == self.peers.me or p == origin or p in self.peers.excluded
                    or not self.peers.reachable(p, now)):
                continue
            known = t.peer_have.get(p)
            if known is not None and (known.complete or now - known.stamp < _HAVE_REFRESH_S):
                continue
            out.append(p)
        return out

    async def _have_poller(self, t: Transfer) -> None:
        """While chunks are wanted, keep other peers' have-maps fresh (a few requests at once)."""
        while not t.complete:
            targets = self._poll_targets(t) if t.want else []
            if targets:
                limiter = trio.Semaphore(_HAVE_PARALLEL)
                async with trio.open_nursery() as nursery:
                    for p in targets:
                        nursery.start_soon(self._poll_have, t, p, limiter)
            with trio.move_on_after(_HAVE_REFRESH_S if targets else self.config.pull_retry_s):
                await t.done.wait()

    async def _poll_have(self, t: Transfer, peer: str, limiter: trio.Semaphore) -> None:
        async with limiter:
            req = b.encode(b.HaveRequest(job_id=t.job_id, version=t.version))
            try:
                await self.peers.connect(peer)
                raw = await self.host.request(peer, b.PROTO_HAVE, req, timeout=_HAVE_TIMEOUT_S,
                                              max_response=b.MAX_HAVE_REPLY_BYTES)
                reply = b.decode(b.HaveReply, raw)
            except (RpcError, ProtocolError, OSError, ValueError) as exc:
                self.peers.unreachable(peer)
                log.debug("have-map of %s: %r", peer[-8:], exc)
                return
            if reply.chunks not in (0, t.n) or len(reply.bitmap) != (reply.chunks + 7) // 8:
                reply = b.HaveReply(chunks=0, bitmap=b"")  # malformed: as if it held nothing
            t.peer_have[peer] = PeerHave(time.monotonic(), reply.bitmap, reply.complete)

    def _pick_pull(self, t: Transfer) -> tuple[int, str] | None:
        """The lowest wanted chunk someone is known to hold, from its least busy holder; the
        origin only for chunks nobody else showed for ``origin_grace_s``."""
        now = time.monotonic()
        route = t.route
        origin = route.origin.peer_id if route and route.origin else None
        if origin in self.peers.excluded or origin == self.peers.me:
            origin = None
        holders_all = [
            (p, h) for p, h in t.peer_have.items()
            if p not in self.peers.excluded and self.peers.reachable(p, now)
        ]
        # Nobody but the origin to ask: no point waiting for have-maps.
        others = bool(route and route.sources) or bool(holders_all)
        for i in sorted(t.want):
            if i in t.pulling or t.have[i] or t.retry_at.get(i, 0.0) > now:
                continue
            holders = [p for p, h in holders_all
                       if h.has(i) and t.inflight[p] < _PULLS_PER_PEER]
            if holders:
                return i, min(holders, key=lambda p: (p in self.peers.stalled, t.inflight[p],
                                                      hash((p, i))))
            if (origin is not None and t.inflight[origin] < self.config.pull_parallel
                    and self.peers.reachable(origin, now)
                    and (now - t.wanted_since.get(i, now) >= self.config.origin_grace_s
                         or not others)):
                return i, origin
        return None

    async def _pull_worker(self, t: Transfer, worker: int) -> None:
        while not t.complete:
            pick = self._pick_pull(t)
            if pick is None:
                with trio.move_on_after(_PULL_IDLE_S):
                    await t.want_changed.wait()
                continue
            index, peer = pick
            t.pulling.add(index)
            t.inflight[peer] += 1
            try:
                if not await self._pull_from(t, index, peer):
                    t.retry_at[index] = time.monotonic() + self.config.pull_retry_s
            finally:
                t.pulling.discard(index)
                t.inflight[peer] -= 1

    async def _pull_from(self, t: Transfer, index: int, peer: str) -> bool:
        ref = t.manifest.chunks[index]
        try:
            await self.peers.connect(peer, direct=True)  # chunks never cross a relay
            data = await fetch_chunk(self.host, peer, ref, timeout=self.config.pull_timeout_s)
        except ChunkHashMismatch as exc:
            t.stats.bad_chunks += 1
            self.peers.report(t, peer, "bad_chunk", index, str(exc))
            return False
        except RemoteError:
            t.peer_have.pop(peer, None)  # its map was stale (or a lie): ask again later
            return False
        except (RpcError, ProtocolError, OSError, ValueError) as exc:
            self.peers.unreachable(peer)
            log.info("pull of chunk %d from %s failed: %r", index, peer[-8:], exc)
            if isinstance(exc, RpcConnectionError):
                await self.peers.drop_connection(peer)
            return False
        try:
            await self.intake.accept(t, index, data, via="pull")
        except ChunkHashMismatch:  # fetch_chunk checked it; only a store fault gets here
            log.exception("chunk %d failed its hash after fetch_chunk accepted it", index)
            return False
        except StoreError as exc:
            log.error("%s", exc)
            return False
        return True
