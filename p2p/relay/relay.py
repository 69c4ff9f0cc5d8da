"""The relay of one host: :class:`Relay`, which owns the nursery, the handlers and the table of
transfers, and composes the jobs that act on them (receive, push, pull, watchdog).

:meth:`Relay.start` (or :meth:`Relay.join_plan`, from a coordinator's sealed plan) makes this
host take part in a version; :meth:`Relay.wait` waits for it to be complete here. See the
package docstring (:mod:`echo.p2p.relay`) for the protocol and what each job does.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from echo.p2p.budget import UploadLimiter
from echo.p2p.chunkstore import ChunkStore, serve_chunks
from echo.p2p.host import EchoHost
from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.intake import Intake
from echo.p2p.relay.peers import BadPeerCallback, Peers, peer_str
from echo.p2p.relay.pull import Puller
from echo.p2p.relay.push import Pusher
from echo.p2p.relay.receive import Receiver
from echo.p2p.relay.routes import parents_in, route_from_announcement
from echo.p2p.relay.transfer import Transfer
from echo.p2p.relay.watchdog import Watchdog
from echo.p2p.rpc import is_relayed, remote_ip
from echo.p2p.streams import end_stream
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol import signing
from echo.protocol.errors import ProtocolError
from echo.protocol.manifest import ManifestError, verify_manifest

log = logging.getLogger(__name__)

KeyLookup = Callable[[str], bytes | None]

# wait_forwarded checks the pushes this often (it runs once, when a node leaves).
_FORWARD_POLL_S = 0.1


class BroadcastTimeout(TimeoutError):
    """:meth:`Relay.wait` ran out of time before the version was complete."""


class Relay:
    """Push relay of one host; see the package docstring. Use :func:`open_relay` or :meth:`run`."""

    def __init__(
        self,
        host: EchoHost,
        store: ChunkStore,
        *,
        learner_keys: Mapping[str, bytes] | KeyLookup,
        on_bad_peer: BadPeerCallback | None = None,
        config: RelayConfig | None = None,
        serve_pulls: bool = True,
    ) -> None:
        self.host = host
        self.store = store
        self.config = config or RelayConfig()
        self._keys: KeyLookup = (
            learner_keys.get if isinstance(learner_keys, Mapping) else learner_keys
        )
        self.serve_pulls = serve_pulls
        self.transfers: dict[tuple[str, int], Transfer] = {}
        # Per job, the newest version dropped from ``transfers``: pushes at or below it are stale.
        self._floor: dict[str, int] = {}
        self._nursery: trio.Nursery | None = None
        self._new_transfer = trio.Event()
        self.peers = Peers(host, self.config.connect_timeout_s, on_bad_peer)
        self._intake = Intake(store, self.config.forward_cache_bytes)
        self._pusher = Pusher(host, self.config, self.peers, self._intake)
        self._puller = Puller(host, self.config, self.peers, self._intake, self.transfers)
        self._watchdog = Watchdog(self.config, self.peers, self._puller)
        self._receiver = Receiver(
            self.config,
            self.peers,
            self._intake,
            self._open_transfer,
            running=lambda: self._nursery is not None,
        )

    @property
    def excluded(self) -> set[str]:
        """Peers never pushed from nor pulled from again (they lied or broke the protocol)."""
        return self.peers.excluded

    @property
    def pushed_out_total(self) -> int:
        """Chunk bytes pushed to children over the relay's life (all transfers)."""
        return self._pusher.pushed_out_total

    # ------------------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve pushes (and pulls) until cancelled; ``nursery.start(relay.run)`` returns it."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                limit = self.config.upload_limit_bps
                if limit and self.host.upload_limiter is None:
                    # Made here: trio's clock exists only inside trio.run.
                    burst = max(64 * 1024, limit / 20)
                    self.host.upload_limiter = UploadLimiter(limit, burst=burst)
                self.host.libp2p.set_stream_handler(TProtocol(b.PROTO_PUSH), self._on_push)
                self.host.set_handler(
                    b.PROTO_HAVE,
                    self._puller.on_have,
                    max_request=b.MAX_HAVE_REQUEST_BYTES,
                    max_response=b.MAX_HAVE_REPLY_BYTES,
                )
                if self.serve_pulls:
                    serve_chunks(self.host, self.store)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for proto in (b.PROTO_PUSH, b.PROTO_HAVE):
                try:
                    self.host.remove_handler(proto)
                except Exception:  # the host may already be closed
                    log.debug("removing the %s handler failed", proto, exc_info=True)

    def exclude(self, peer: ID | str) -> None:
        """Never take pushes from, nor pull from, ``peer`` again (e.g. on the coordinator's say)."""
        self.peers.excluded.add(peer_str(peer))

    # ------------------------------------------------------------------------- public API

    async def start(self, envelope: bytes, route: b.Route) -> Transfer:
        """Take part in ``route.version``: verify the manifest, mark chunks already stored, push
        to ``route.children`` (as chunks arrive) and pull from ``route.sources`` when a stripe
        stalls. The publisher calls it with all chunks in its store; a node calls it when the
        coordinator assigns it a route (pushes that arrive earlier are accepted meanwhile).

        :raises ManifestError: bad manifest for the route's job / version.
        :raises ProtocolError: (``stale_version``) the version is older than those kept.
        :raises RuntimeError: the relay is not running.
        """
        key = self._key_for(route.job_id)
        man = verify_manifest(envelope, key, route.job_id, route.version)
        t = self.transfers.get((route.job_id, route.version))
        if t is None:
            t = await self._launch(man, envelope, route.stripes, route.weights)
        # A push that arrived first may have created the transfer and still be opening its
        # nursery (inside _launch, on another task): wait for it.
        with trio.move_on_after(self.config.hello_timeout_s):
            await t.started.wait()
        if not t.started.is_set() or t.dropped.is_set():
            raise ProtocolError(
                f"{t.job_id} v{t.version} is older than the versions kept", code=R.STALE_VERSION
            )
        if t.route is None:
            t.route = route
            t.set_stripes(route.stripes, route.weights)
            self.peers.remember_addrs(route)
            assert t.nursery is not None
            for s, kids in enumerate(route.children[: route.stripes]):
                for child in kids:
                    if child.peer_id != self.peers.me:
                        t.nursery.start_soon(self._pusher.push_to, t, s, child)
        return t

    async def join_plan(
        self, sealed_plan: bytes, coordinator_key: bytes, job_id: str | None = None
    ) -> b.PlanAnnouncement | None:
        """Take this host's place in a coordinator's broadcast plan.

        Opens ``sealed_plan`` (a ``broadcast_plan`` envelope that ``coordinator_key`` must have
        signed), cuts this host's route out of the announced plan and, when the plan reaches
        this host, starts the transfer (:meth:`start`). Returns the announcement (also when the
        plan does not reach this host), or None, doing nothing, when ``job_id`` is given and
        the announcement is for another job.

        :raises ProtocolError: the envelope does not verify or holds no valid announcement;
            as :meth:`start` (:class:`~echo.protocol.manifest.ManifestError`, ``stale_version``)
            for the version it announces.
        :raises RuntimeError: the relay is not running.
        """
        _, ann = signing.open_record(
            sealed_plan,
            b.PlanAnnouncement,
            expected_signer=coordinator_key,
            max_bytes=b.MAX_PLAN_ENVELOPE_BYTES,
        )
        if job_id is not None and ann.job_id != job_id:
            return None
        route = route_from_announcement(ann, self.peers.me)
        if route is not None:
            ups = set(parents_in(ann.plan, self.peers.me))
            if ups and self._nursery is not None:  # a node behind NAT is reached this way only
                self._nursery.start_soon(
                    self.peers.reach_out, [p for p in ann.peers if p.peer_id in ups]
                )
            await self.start(ann.manifest, route)  # verifies the manifest
        return ann

    async def wait(self, job_id: str, version: int, timeout: float) -> Transfer:
        """Wait until ``version`` is complete here (it may not even have started yet).

        :raises BroadcastTimeout: not complete within ``timeout``.
        """
        try:
            with trio.fail_after(timeout):
                while (t := self.transfers.get((job_id, version))) is None:
                    await self._new_transfer.wait()
                await t.done.wait()
                return t
        except trio.TooSlowError:
            t = self.transfers.get((job_id, version))
            have = f"{t.n_have}/{t.n}" if t else "nothing"
            raise BroadcastTimeout(
                f"{job_id} v{version} not complete after {timeout} s ({have} chunks)"
            ) from None

    def transfer(self, job_id: str, version: int) -> Transfer | None:
        return self.transfers.get((job_id, version))

    async def wait_forwarded(self, job_id: str, version: int, timeout: float) -> bool:
        """Wait until no push of ``version`` to a child is still connecting or sending (so that
        a node leaving after the last version does not cut its subtree off mid-version); False
        if some still were after ``timeout``. Pushes end on their own: done, lagging, failed."""
        t = self.transfers.get((job_id, version))
        if t is None:
            return True
        with trio.move_on_after(timeout):
            while any(st in ("connecting", "pushing") for st in t.child_state.values()):
                await trio.sleep(_FORWARD_POLL_S)
            return True
        return False

    def prune_store(self) -> None:
        """Drop stored versions beyond the store's ``keep_versions``, keeping those in flight."""
        live = {t.version for t in self.transfers.values() if not t.dropped.is_set()}
        self.store.prune(keep=live)

    # ------------------------------------------------------------------------- transfers

    def _key_for(self, job_id: str) -> bytes:
        key = self._keys(job_id)
        if key is None:
            raise ManifestError(f"no learner key pinned for job {job_id!r}")
        return key

    async def _on_push(self, stream: INetStream) -> None:
        """An inbound push stream, admitted against its sender's budget (the host's gate) before
        its hello is read; a sender over budget has the stream reset and serves a backoff. A
        push that came through a circuit relay is reset at once (chunks: direct only)."""
        peer, gate = peer_str(stream.muxed_conn.peer_id), self.host.gate
        if is_relayed(stream):
            # Bulk data travels on direct connections only; a relay carries control messages.
            log.info("push from %s refused: it came through a relay", peer[-8:])
            await end_stream(stream, clean=False)
            return
        if not gate.admit(peer, remote_ip(stream), b.PROTO_PUSH):
            if not gate.in_backoff(peer):
                gate.punish(peer)
            await end_stream(stream, clean=False)
            return
        await self._receiver.on_push(stream)

    async def _open_transfer(self, hello: b.PushHello) -> Transfer:
        """The transfer a push hello names; a new one (its manifest verified) if none yet.

        Cheapest first: a version already here is taken as is, one at or below the versions
        dropped here is refused (``stale_version``) before its manifest (up to 4 MiB) is
        verified. (The sender was checked by :meth:`_on_push` and the receiver.)
        """
        t = self.transfers.get((hello.job_id, hello.version))
        if t is not None:
            return t
        if hello.version <= self._floor.get(hello.job_id, -1):
            raise ProtocolError(
                f"{hello.job_id} v{hello.version} is older than the versions kept",
                code=R.STALE_VERSION,
            )
        man = verify_manifest(
            hello.manifest, self._key_for(hello.job_id), hello.job_id, hello.version
        )
        t = self.transfers.get((hello.job_id, hello.version))  # another stream may have won
        if t is not None:
            return t
        return await self._launch(man, hello.manifest, hello.stripes, hello.weights)

    async def _launch(
        self, man: m.Manifest, envelope: bytes, stripes: int, weights: Sequence[int] = ()
    ) -> Transfer:
        if self._nursery is None:
            raise RuntimeError("the relay is not running")
        if man.version <= self._floor.get(man.job_id, -1):
            raise ProtocolError(
                f"{man.job_id} v{man.version} is older than the versions kept", code=R.STALE_VERSION
            )
        t = Transfer(man, envelope, stripes, weights)
        self.transfers[(t.job_id, t.version)] = t
        self._retire_old()
        if t.dropped.is_set():
            raise ProtocolError(
                f"{t.job_id} v{t.version} is older than the versions kept", code=R.STALE_VERSION
            )
        self._intake.adopt_stored(t)
        await self._nursery.start(self._transfer_task, t)
        self._new_transfer.set()
        self._new_transfer = trio.Event()
        if t.complete:
            self._intake.completed(t)
        return t

    def _retire_old(self) -> None:
        if len(self.transfers) <= self.config.max_transfers:
            return
        # Oldest completed first, then oldest at all.
        victims = sorted(self.transfers.values(), key=lambda t: (not t.complete, t.version))
        for t in victims[: len(self.transfers) - self.config.max_transfers]:
            t.dropped.set()
            for f in t.feeds:
                f.scope.cancel()
            del self.transfers[(t.job_id, t.version)]
            self._floor[t.job_id] = max(self._floor.get(t.job_id, -1), t.version)

    async def _transfer_task(self, t: Transfer, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            t.nursery = nursery
            t.started.set()
            if not t.complete:
                nursery.start_soon(self._watchdog.run, t)
            task_status.started()
            await t.dropped.wait()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_relay(
    host: EchoHost,
    store: ChunkStore,
    *,
    learner_keys: Mapping[str, bytes] | KeyLookup,
    on_bad_peer: BadPeerCallback | None = None,
    config: RelayConfig | None = None,
    serve_pulls: bool = True,
) -> AsyncIterator[Relay]:
    """A running :class:`Relay` for the duration of the block (cancelled on exit)."""
    relay = Relay(
        host,
        store,
        learner_keys=learner_keys,
        on_bad_peer=on_bad_peer,
        config=config,
        serve_pulls=serve_pulls,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        try:
            yield relay
        finally:
            nursery.cancel_scope.cancel()
