"""Push-based, pipelined broadcast of signed, chunked versions down planned trees: the relay.

A :class:`Relay` runs on every node and on the publisher, bound to an :class:`EchoHost` and a
:class:`ChunkStore`. For each version it takes part in it keeps a :class:`Transfer`:

- **push in** (``/echo/push/1.1.0``, see :mod:`echo.protocol.broadcast`): a parent opens one
  stream per stripe and sends chunks, each behind a small header (job, version, index). Every
  chunk is checked against the learner-signed manifest (exact size, then SHA-256) *before* it is
  stored; the manifest itself is verified against the job's pinned learner key. Hashing and the
  disk write run in a worker thread so a slow disk never stops the event loop. The child
  acknowledges every chunk on the same stream.
- **push out**: every chunk that arrives (pushed, pulled, or already in the store) is forwarded at
  once to this node's children in that chunk's stripe. Each child has its own task with its own
  cursor into the arrival order and at most ``push_window_bytes`` unacknowledged (the bounded
  per-child queue), so a slow child never holds up its siblings; a child more than
  ``max_lag_chunks`` acknowledged chunks behind its fastest sibling is told ``end(lagging)`` and
  dropped -- its share of the parent's uplink goes to the others -- and pulls the rest.
- **pull fallback**: if a stripe has no healthy feed -- its parent never connected, went silent
  for ``stall_timeout_s`` (keep-alives from a parent waiting on its own upstream double that),
  ended early, or sent a chunk that failed its hash -- the missing chunks of that stripe are
  fetched with :func:`~echo.p2p.chunkstore.fetch_chunk` from peers whose have-maps
  (``/echo/have/1.0.0``) show them, least busy first, and from the route's origin (the publisher)
  when nobody else has shown a chunk for ``origin_grace_s``. Liars are excluded for good and
  reported as ``bad_chunk``; silent or vanished parents are reported as ``stalled``, through
  ``on_bad_peer``. A pause of our own process (CPU starvation, a blocked disk) is not blamed on
  the parents.
- **completion**: when every chunk is present, ``Transfer.done`` is set; the node keeps pushing
  to its children and serving pulls (``PROTO_CHUNK``) and have-maps from the store.

Ownership: the relay owns its push and have handlers on the host (removed when it stops) and,
unless ``serve_pulls=False``, registers ``serve_chunks`` for its store (left in place: a node's
worker may serve the same store); the streams it opens (half-closed after ``end``, then closed;
reset on error); the inbound push streams (closed after ``end``, reset when it no longer wants
them); and every task it starts, all inside the nursery of :meth:`Relay.run` /
:func:`open_relay` (cancelled on exit). It does not own the host or the store; it never deletes
chunks itself (:meth:`Relay.prune_store` asks ``ChunkStore.prune``, keeping versions in flight).

Connections: py-libp2p 0.8.1's yamux made reads wait behind bulk writes on the same connection
(window updates, pongs, stream ACKs), which stalled, and with pushes both ways deadlocked,
connections that striped trees load in both directions; :mod:`echo.p2p.yamux` removes that. A
stall that remains (a TCP flow that stops) is seen by the watchdog and pulled around.

Errors: :meth:`Relay.start` raises :class:`ManifestError` (a ``ProtocolError``) for a manifest that
is not signed by the job's learner key or breaks limits; :meth:`Relay.wait` raises
:class:`BroadcastTimeout`. Peer misbehaviour never raises into the caller: it is logged, reported
and routed around. A failing store (:class:`StoreError`) is logged; the chunk is fetched again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from echo.p2p.chunkstore import ChunkHashMismatch, ChunkStore, fetch_chunk, serve_chunks
from echo.p2p.host import EchoHost
from echo.p2p.rpc import RemoteError, RpcConnectionError, RpcError, transfer_timeout
from echo.p2p.streams import read_exactly, read_frame
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.errors import FrameError, ProtocolError
from echo.protocol.framing import HEADER_LEN, decode_length, encode_frame
from echo.protocol.limits import MAX_CHUNK_BYTES

log = logging.getLogger(__name__)

KeyLookup = Callable[[str], bytes | None]
BadPeerCallback = Callable[[b.BadPeerReport], None]

# Per read() call while receiving a chunk body; progress (for stall detection) is noted per read.
_READ_SLICE = 1 << 20
# Bound on resetting / closing a stream we are done with (shielded from cancellation).
_STREAM_CLOSE_TIMEOUT = 1.0
# Have-maps: refreshed this often while chunks are wanted, a few requests at a time.
_HAVE_REFRESH_S = 1.0
_HAVE_PARALLEL = 8
_HAVE_TIMEOUT_S = 5.0
# The final acknowledgement of a push, if the parent does not take it within this, is dropped.
_ACK_TIMEOUT_S = 5.0
# Per-child push window: the child's acknowledged rate over the last few seconds, times this,
# between two chunks and RelayConfig.push_window_bytes (see _Acks.window).
_WINDOW_S = 0.5
_RATE_SPAN_S = 3.0
_RATE_MIN_SPAN_S = 0.3
# What ends one child's push stream (logged; the child pulls what it misses).
_PUSH_ERRORS = (trio.TooSlowError, RpcError, BaseLibp2pError, OSError, ValueError)
# After "end", how long a parent waits for the child to acknowledge and close its side.
_CLOSE_TIMEOUT_S = 10.0
# Worker threads hashing and writing chunks (the disk is one device; two overlap hash and I/O).
_STORE_THREADS = 2
# The watchdog counts a tick this much later than planned as a pause of our own process (CPU
# starvation, a stalled disk): parents are not blamed for it.
_PAUSE_SLACK_S = 1.0
# Concurrent pulls from one peer, and how often an idle pull worker looks again.
_PULLS_PER_PEER = 2
_PULL_IDLE_S = 0.2
# wait_forwarded checks the pushes this often (it runs once, when a node leaves).
_FORWARD_POLL_S = 0.1
# A peer that failed to answer at all is skipped by pulls for this long.
_UNREACHABLE_S = 5.0


class ManifestError(ProtocolError):
    """A manifest envelope that does not verify against the job's learner key or breaks limits."""

    code = "manifest"


class StoreError(RuntimeError):
    """Our own chunk store failed (disk full, permissions): not the peer's fault."""


class BroadcastTimeout(TimeoutError):
    """:meth:`Relay.wait` ran out of time before the version was complete."""


@dataclass(frozen=True)
class RelayConfig:
    """Timeouts and limits of a relay (seconds, chunks, bytes per second)."""

    # No byte from a parent for this long: report it as stalled and pull its stripes. A parent that
    # is only waiting for its own upstream sends keep-alives; then the child pulls after twice this.
    stall_timeout_s: float = 10.0
    # A parent with nothing new to push sends a keep-alive this often.
    idle_interval_s: float = 2.0
    # A child this many chunks behind its fastest sibling (by acknowledged chunks) is dropped and
    # pulls (0: never drop).
    max_lag_chunks: int = 64
    # Unacknowledged bytes per child, at most: the bounded per-child queue. Within it the window
    # follows what the child acknowledges (about half a second of its rate, at least two chunks),
    # so that little waits in send buffers ahead of control frames on the same connection.
    push_window_bytes: int = 2 * 1024 * 1024
    # Concurrent chunk pulls per transfer, and the timeout of one.
    pull_parallel: int = 4
    pull_timeout_s: float = 30.0
    # A chunk no peer could give is retried after this long.
    pull_retry_s: float = 0.5
    # A wanted chunk no other peer shows in its have-map is pulled from the origin after this.
    origin_grace_s: float = 2.0
    connect_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    # Writing one chunk may take this plus its size at rpc.MIN_TRANSFER_RATE.
    write_base_timeout_s: float = 10.0
    # Versions tracked at once; beyond it the oldest (completed first) are dropped.
    max_transfers: int = 4
    # Optional cap on this relay's push upload (a token bucket; pulls it serves are not counted).
    upload_limit_bps: float | None = None
    # Recently arrived chunks kept in memory for forwarding (saves a disk read per child).
    forward_cache_bytes: int = 32 * 1024 * 1024


@dataclass
class TransferStats:
    pushed_in_bytes: int = 0
    pulled_bytes: int = 0
    pushed_out_bytes: int = 0
    chunks_pulled: int = 0
    duplicate_chunks: int = 0
    # From the first chunk pushed to the last acknowledged (time.monotonic()): the pushing span.
    first_push_at: float | None = None
    last_ack_at: float | None = None
    bad_chunks: int = 0

    def push_rate_bps(self) -> float:
        """Bytes pushed to children per second of pushing (0 when nothing was pushed). Chunks
        wait for the upstream too, so this is a lower bound on the uplink."""
        if not self.pushed_out_bytes or self.first_push_at is None or self.last_ack_at is None:
            return 0.0
        return self.pushed_out_bytes / max(self.last_ack_at - self.first_push_at, 1e-3)


@dataclass(frozen=True)
class _PeerHave:
    """Another peer's have-map as last seen."""

    stamp: float
    bitmap: bytes
    complete: bool

    def has(self, index: int) -> bool:
        return self.complete or (
            index >> 3 < len(self.bitmap) and bool(self.bitmap[index >> 3] & (1 << (index & 7)))
        )


@dataclass
class _Feed:
    """One inbound push stream (a parent feeding one stripe)."""

    peer: str
    stripe: int
    scope: trio.CancelScope
    last_byte: float
    last_beat: float
    last_chunk: float
    state: str = "open"  # open | ended | lagging | bad | stalled | gone | complete
    received: int = 0  # chunks read on this stream (acknowledged to the parent)
    ack_changed: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Acks:
    """What a child acknowledged on one push stream (chunks received, in order sent)."""

    count: int = 0
    sent_bytes: list[int] = field(default_factory=lambda: [0])  # cumulative, per chunk sent
    changed: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)  # the child closed its side

    @property
    def sent(self) -> int:
        return len(self.sent_bytes) - 1

    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, bytes acked)

    @property
    def unacked(self) -> int:
        return self.sent_bytes[-1] - self.sent_bytes[self.count]

    def acked(self, count: int) -> None:
        self.count = count
        now = time.monotonic()
        self.history.append((now, self.sent_bytes[count]))
        while len(self.history) > 2 and now - self.history[1][0] > _RATE_SPAN_S:
            self.history.popleft()
        self.changed.set()
        self.changed = trio.Event()

    def window(self, floor: int, ceiling: int) -> int:
        """Bytes that may be unacknowledged: what the child took in the last ``_WINDOW_S``
        (its acknowledged rate), between ``floor`` and ``ceiling``. Everything beyond sits in
        send buffers, where it delays every control frame on the same connection (acks, pull
        requests, stream opens) by as long as it takes to drain."""
        if len(self.history) < 2 or self.history[-1][0] - self.history[0][0] < _RATE_MIN_SPAN_S:
            return floor  # until the child's rate shows: two chunks
        (t0, b0), (t1, b1) = self.history[0], self.history[-1]
        rate = (b1 - b0) / (t1 - t0)
        return int(min(ceiling, max(floor, rate * _WINDOW_S)))


class _TokenBucket:
    """Upload shaping in-process: ``take(n)`` waits until ``n`` bytes of budget accrued."""

    def __init__(self, rate_bps: float, burst: float) -> None:
        self.rate, self.burst = rate_bps, burst
        self.tokens = burst
        self.stamp = trio.current_time()

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await trio.sleep(-self.tokens / self.rate)


class Transfer:
    """One version moving through this relay. Read-only for callers (``done``, ``stats``...)."""

    def __init__(self, manifest: m.Manifest, envelope: bytes, stripes: int,
                 weights: Sequence[int] = ()) -> None:
        self.manifest = manifest
        self.envelope = envelope
        self.job_id = manifest.job_id
        self.version = manifest.version
        self.n = len(manifest.chunks)
        self.set_stripes(stripes, weights)
        self.route: b.Route | None = None
        self.have = [False] * self.n
        self.n_have = 0
        self.order: list[int] = []  # indices in the order they became available here
        self.arrived_at: list[float] = []  # time.monotonic() of each entry of ``order``
        # Per push (stripe, child): when the child last acknowledged (time.monotonic()).
        self.acked_at: dict[tuple[int, str], float] = {}
        self.done = trio.Event()
        self.dropped = trio.Event()
        self.created = time.monotonic()
        self.done_at: float | None = None
        self.stats = TransferStats()
        self.feeds: list[_Feed] = []
        self.cursors: dict[tuple[int, str], int] = {}
        self.child_state: dict[tuple[int, str], str] = {}
        self.bitmap = bytearray((self.n + 7) // 8)
        self.pulling: set[int] = set()
        self.storing: set[int] = set()
        self.retry_at: dict[int, float] = {}
        self.want: set[int] = set()
        self.wanted_since: dict[int, float] = {}
        self.peer_have: dict[str, _PeerHave] = {}
        self.inflight: Counter[str] = Counter()
        self.reported: set[tuple[str, str]] = set()
        self.nursery: trio.Nursery | None = None
        self.started = trio.Event()  # set once ``nursery`` is open (tasks can be started)
        self.pullers_started = False
        self._changed = trio.Event()
        self._want_changed = trio.Event()

    @property
    def complete(self) -> bool:
        return self.n_have == self.n

    def missing(self) -> list[int]:
        return [i for i, h in enumerate(self.have) if not h]

    def set_stripes(self, stripes: int, weights: Sequence[int] = ()) -> None:
        """How the chunks are split into stripes (:func:`~echo.protocol.broadcast.stripe_table`);
        the route's word wins over a hello that came first."""
        self.stripes, self.weights = stripes, list(weights)
        self._stripe = b.stripe_table(self.n, stripes, self.weights)
        self._stripe_sizes = Counter(self._stripe)

    def stripe_of(self, index: int) -> int:
        return self._stripe[index]

    def stripe_size(self, stripe: int) -> int:
        return self._stripe_sizes[stripe]

    def elapsed(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.created

    def _arrived(self, index: int) -> None:
        self.have[index] = True
        self.bitmap[index >> 3] |= 1 << (index & 7)
        self.n_have += 1
        self.order.append(index)
        self.arrived_at.append(time.monotonic())
        self.want.discard(index)
        self._changed.set()
        self._changed = trio.Event()

    def _set_want(self, want: set[int]) -> None:
        if want != self.want:
            now = time.monotonic()
            self.wanted_since = {i: self.wanted_since.get(i, now) for i in want}
            self.want = want
            self._want_changed.set()
            self._want_changed = trio.Event()

    def payload(self, store: ChunkStore) -> bytes:
        """The reassembled bytes (call once ``done`` is set).

        :raises ManifestError: a chunk is missing from the store or fails its hash.
        """
        parts = []
        for ref in self.manifest.chunks:
            data = store.get(ref.sha256)
            if data is None:
                raise ManifestError(f"chunk {ref.sha256.hex()[:12]} is not in the store")
            parts.append(data)
        out = b"".join(parts)
        if len(out) != self.manifest.total_size:
            raise ManifestError("reassembled size differs from the manifest")
        return out


def _pid(peer: ID | str) -> str:
    return peer if isinstance(peer, str) else peer.to_base58()


async def _reset_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_STREAM_CLOSE_TIMEOUT):
        try:
            await stream.reset()
        except Exception:  # dropping the stream anyway
            log.debug("stream reset failed", exc_info=True)


async def _close_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_STREAM_CLOSE_TIMEOUT):
        try:
            await stream.close()
        except Exception:
            log.debug("stream close failed", exc_info=True)


def verify_manifest(envelope: bytes, learner_key: bytes, job_id: str, version: int) -> m.Manifest:
    """Open a learner-signed manifest envelope and check it names ``job_id`` / ``version`` and
    respects the chunk limits.

    :raises ManifestError: on any failure (signature, schema, mismatch, limits).
    """
    try:
        env = signing.open_envelope(envelope, kind="manifest", expected_signer=learner_key,
                                    max_bytes=b.MAX_MANIFEST_ENVELOPE_BYTES)
        man = m.from_obj(m.Manifest, env.decode_body())
    except ProtocolError as exc:
        raise ManifestError(f"manifest for {job_id} v{version}: {exc}") from exc
    if man.job_id != job_id or man.version != version:
        raise ManifestError(
            f"manifest is {man.job_id} v{man.version}, expected {job_id} v{version}"
        )
    if any(c.size > MAX_CHUNK_BYTES for c in man.chunks):
        raise ManifestError(f"manifest names a chunk over {MAX_CHUNK_BYTES} bytes")
    if sum(c.size for c in man.chunks) != man.total_size:
        raise ManifestError("manifest chunk sizes do not add up to total_size")
    return man


class Relay:
    """Push relay of one host; see the module docstring. Use :func:`open_relay` or :meth:`run`."""

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
        self.on_bad_peer = on_bad_peer
        self.serve_pulls = serve_pulls
        self.transfers: dict[tuple[str, int], Transfer] = {}
        self.excluded: set[str] = set()
        self.stalled: set[str] = set()
        self._unreachable: dict[str, float] = {}
        self._addrs: dict[str, list[str]] = {}
        # Per job, the newest version dropped from ``transfers``: pushes at or below it are stale.
        self._floor: dict[str, int] = {}
        self._me = _pid(host.peer_id)
        self._nursery: trio.Nursery | None = None
        self._new_transfer = trio.Event()
        self._bucket: _TokenBucket | None = None
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cache_bytes = 0
        self._store_limiter = trio.CapacityLimiter(_STORE_THREADS)
        # Chunk bytes pushed to children over the relay's life (all transfers).
        self.pushed_out_total = 0

    # ------------------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve pushes (and pulls) until cancelled; ``nursery.start(relay.run)`` returns it."""
        if self.config.upload_limit_bps:
            rate = self.config.upload_limit_bps
            self._bucket = _TokenBucket(rate, burst=max(64 * 1024, rate / 20))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.host.libp2p.set_stream_handler(TProtocol(b.PROTO_PUSH), self._on_push)
                self.host.set_handler(b.PROTO_HAVE, self._on_have,
                                      max_request=b.MAX_HAVE_REQUEST_BYTES,
                                      max_response=b.MAX_HAVE_REPLY_BYTES)
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
        self.excluded.add(_pid(peer))

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
            raise ProtocolError(f"{t.job_id} v{t.version} is older than the versions kept",
                                code="stale_version")
        if t.route is None:
            t.route = route
            t.set_stripes(route.stripes, route.weights)
            self._remember_addrs(route)
            assert t.nursery is not None
            for s, kids in enumerate(route.children[: route.stripes]):
                for child in kids:
                    if child.peer_id != self._me:
                        t.nursery.start_soon(self._push_to, t, s, child)
        return t

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

    async def _launch(self, man: m.Manifest, envelope: bytes, stripes: int,
                      weights: Sequence[int] = ()) -> Transfer:
        if self._nursery is None:
            raise RuntimeError("the relay is not running")
        if man.version <= self._floor.get(man.job_id, -1):
            raise ProtocolError(f"{man.job_id} v{man.version} is older than the versions kept",
                                code="stale_version")
        t = Transfer(man, envelope, stripes, weights)
        self.transfers[(t.job_id, t.version)] = t
        self._retire_old()
        if t.dropped.is_set():
            raise ProtocolError(f"{t.job_id} v{t.version} is older than the versions kept",
                                code="stale_version")
        # Chunks we already hold (this version, or the same bytes in an older one) count at once.
        for i, ref in enumerate(man.chunks):
            if (self.store.root / str(t.version) / ref.sha256.hex()).exists():
                t._arrived(i)
            elif self.store.has(ref.sha256):
                data = self.store.get(ref.sha256)
                if data is not None:
                    self.store.put(t.version, data, ref.sha256)
                    t._arrived(i)
        await self._nursery.start(self._transfer_task, t)
        self._new_transfer.set()
        self._new_transfer = trio.Event()
        if t.complete:
            self._completed(t)
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
                nursery.start_soon(self._watchdog, t)
            task_status.started()
            await t.dropped.wait()
            nursery.cancel_scope.cancel()

    def _completed(self, t: Transfer) -> None:
        t.done_at = time.monotonic()
        t.done.set()
        t._set_want(set())
        for f in t.feeds:
            if f.state == "open":
                f.state = "complete"
                f.scope.cancel()
        log.info("%s v%d complete: %d chunks, %.2f s, pulled %d", t.job_id, t.version, t.n,
                 t.done_at - t.created, t.stats.chunks_pulled)

    async def _accept(self, t: Transfer, index: int, data: bytes, via: str) -> bool:
        """Check a chunk's hash, store it, forward it. False if already held (or being stored).

        Hashing and the disk write run in a worker thread (at most ``_STORE_THREADS`` at once):
        under writeback pressure a write can block for seconds, and the event loop must keep
        reading streams meanwhile. ``store.put`` hashes first and raises ChunkHashMismatch
        before anything touches the disk.
        """
        if t.have[index] or index in t.storing or t.dropped.is_set():
            t.stats.duplicate_chunks += 1
            return False
        ref = t.manifest.chunks[index]
        t.storing.add(index)
        try:
            await trio.to_thread.run_sync(self.store.put, t.version, data, ref.sha256,
                                          limiter=self._store_limiter)
        except OSError as exc:
            raise StoreError(f"cannot store chunk {index} of v{t.version}: {exc}") from exc
        finally:
            t.storing.discard(index)
        if t.have[index] or t.dropped.is_set():
            return False
        if via == "push":
            t.stats.pushed_in_bytes += len(data)
        else:
            t.stats.pulled_bytes += len(data)
            t.stats.chunks_pulled += 1
        self._cache_put(ref.sha256, data)
        t._arrived(index)
        if t.complete:
            self._completed(t)
        return True

    def _cache_put(self, sha: bytes, data: bytes) -> None:
        limit = self.config.forward_cache_bytes
        if len(data) > limit or sha in self._cache:
            return
        self._cache[sha] = data
        self._cache_bytes += len(data)
        while self._cache_bytes > limit:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old)

    def _chunk(self, sha: bytes) -> bytes | None:
        """A chunk to forward: from the in-memory cache of recent arrivals, else the store."""
        data = self._cache.get(sha)
        return data if data is not None else self.store.get(sha)

    def _report(
        self, t: Transfer, peer: str, reason: str, index: int = -1, detail: str = ""
    ) -> None:
        if reason in ("bad_chunk", "protocol"):
            self.excluded.add(peer)
        elif reason == "stalled":
            self.stalled.add(peer)
        if (peer, reason) in t.reported:
            return
        t.reported.add((peer, reason))
        log.warning("%s v%d: parent %s %s (chunk %d) %s", t.job_id, t.version, peer[-8:],
                    reason, index, detail)
        if self.on_bad_peer is not None:
            report = b.BadPeerReport(job_id=t.job_id, version=t.version, peer_id=peer,
                                     reason=reason, chunk_index=index, detail=detail[:200])
            try:
                self.on_bad_peer(report)
            except Exception:
                log.exception("on_bad_peer callback failed")

    # ------------------------------------------------------------------------- push in

    async def _transfer_for(self, hello: b.PushHello) -> Transfer:
        t = self.transfers.get((hello.job_id, hello.version))
        if t is not None:
            return t
        man = verify_manifest(hello.manifest, self._key_for(hello.job_id), hello.job_id,
                              hello.version)
        t = self.transfers.get((hello.job_id, hello.version))  # another stream may have won
        if t is not None:
            return t
        return await self._launch(man, hello.manifest, hello.stripes, hello.weights)

    async def _on_push(self, stream: INetStream) -> None:
        peer = _pid(stream.muxed_conn.peer_id)
        t: Transfer | None = None
        feed: _Feed | None = None
        try:
            if peer in self.excluded or self._nursery is None:
                return
            with trio.fail_after(self.config.hello_timeout_s):
                hello = b.decode(b.PushHello, await read_frame(stream, b.MAX_HELLO_BYTES))
            t = await self._transfer_for(hello)
            if t.complete or t.dropped.is_set():
                return
            now = time.monotonic()
            feed = _Feed(peer, hello.stripe, trio.CancelScope(), now, now, now)
            t.feeds.append(feed)
            with feed.scope:
                # Acks go out from their own task: a reader that waits on its own writes could
                # deadlock with a parent doing the same on the same connection.
                error: Exception | None = None
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ack_writer, stream, feed)
                    try:
                        await self._receive(stream, t, feed)
                        await self._ack(stream, feed.received)  # the final count
                    except Exception as exc:  # re-raised below, outside the nursery's group
                        error = exc
                    finally:
                        nursery.cancel_scope.cancel()
                if error is not None:
                    raise error
        except trio.TooSlowError:
            if t is None:
                log.info("push from %s: no hello in time", peer[-8:])
            else:
                self._lost(t, feed, peer, "push stream silent")
        except ProtocolError as exc:
            if t is None:
                log.info("push from %s refused: %s", peer[-8:], exc)
            elif isinstance(exc, FrameError) and exc.code == "frame_truncated":
                self._lost(t, feed, peer, "push stream cut")  # gone, not lying
            else:
                if feed is not None:
                    feed.state = "bad"
                self._report(t, peer, "protocol", detail=f"{exc.code}: {exc}")
        except StoreError as exc:
            log.error("%s", exc)
            if feed is not None:
                feed.state = "gone"
        except (BaseLibp2pError, OSError) as exc:
            if t is not None:
                self._lost(t, feed, peer, f"push stream failed: {type(exc).__name__}")
        finally:
            if feed is not None and feed.state == "open":
                feed.state = "gone"
            if feed is not None and feed.state in ("ended", "lagging"):
                await _close_quietly(stream)  # the parent said end: a clean close both ways
            else:
                await _reset_quietly(stream)

    def _lost(self, t: Transfer, feed: _Feed | None, peer: str, detail: str) -> None:
        """A parent's push stream broke (the parent died or gave up): pull around it."""
        if feed is not None and feed.state == "open":
            feed.state = "gone"
        self._unreachable[peer] = time.monotonic() + _UNREACHABLE_S
        if not t.complete and not t.dropped.is_set():
            self._report(t, peer, "stalled", detail=detail)

    async def _receive(self, stream: INetStream, t: Transfer, feed: _Feed) -> None:
        """Read chunks until ``end``; verify, store and forward each one."""
        # Safety net only: the watchdog cancels feed.scope long before this on a silent parent.
        silence = 3 * self.config.stall_timeout_s + self.config.idle_interval_s
        while True:
            with trio.fail_after(silence):
                hdr = b.decode(b.PushHeader, await read_frame(stream, b.MAX_HEADER_BYTES))
            now = time.monotonic()
            if hdr.job_id != t.job_id or hdr.version != t.version:
                raise ProtocolError("push header for another version", code="push_header")
            if hdr.op == "idle":
                feed.last_beat = now
                continue
            feed.last_byte = now
            if hdr.op == "end":
                feed.state = "lagging" if hdr.reason == "lagging" else "ended"
                return
            if hdr.index >= t.n:
                raise ProtocolError(f"chunk index {hdr.index} beyond {t.n}", code="push_header")
            ref = t.manifest.chunks[hdr.index]
            with trio.fail_after(transfer_timeout(ref.size, silence)):
                data = await self._read_body(stream, ref.size, feed)
            try:
                await self._accept(t, hdr.index, data, via="push")
            except ChunkHashMismatch:
                t.stats.bad_chunks += 1
                feed.state = "bad"
                self._report(t, feed.peer, "bad_chunk", hdr.index, "pushed chunk failed its hash")
                return
            feed.last_chunk = feed.last_byte = time.monotonic()
            feed.received += 1
            feed.ack_changed.set()

    async def _ack_writer(self, stream: INetStream, feed: _Feed) -> None:
        """Send the latest received count whenever it changes (coalescing: one write may cover
        several chunks).

        A write is never abandoned on a timer: it can wait seconds behind bulk data on the same
        connection (a TCP flow in retransmission backoff), and an ack given up on would stall
        the parent's window for good. The feed's scope bounds it (cancelled when the push ends
        or the watchdog cuts a silent parent); a broken stream ends it."""
        sent = 0
        while True:
            feed.ack_changed = trio.Event()
            if feed.received > sent:
                sent = feed.received
                try:
                    await stream.write(self._ack_frame(sent))
                except (BaseLibp2pError, OSError):
                    return
            else:
                await feed.ack_changed.wait()

    @staticmethod
    def _ack_frame(received: int) -> bytes:
        return encode_frame(b.encode(b.PushAck(received=received)), b.MAX_HEADER_BYTES)

    @classmethod
    async def _ack(cls, stream: INetStream, received: int) -> bool:
        """Tell the parent how many chunks arrived on this stream, once at the end (best effort:
        a parent that is gone or has closed its side just does not hear it)."""
        with trio.move_on_after(_ACK_TIMEOUT_S):
            with suppress(BaseLibp2pError, OSError):
                await stream.write(cls._ack_frame(received))
                return True
        return False

    @staticmethod
    async def _read_body(stream: INetStream, size: int, feed: _Feed) -> bytes:
        """One frame of exactly ``size`` bytes (checked before reading), noting progress."""
        n = decode_length(await read_exactly(stream, HEADER_LEN), size)
        if n != size:
            raise FrameError(f"chunk frame of {n} bytes, the manifest says {size}",
                             code="push_chunk_size")
        buf = bytearray()
        while len(buf) < n:
            try:
                part = await stream.read(min(n - len(buf), _READ_SLICE))
            except StreamEOF:
                part = b""
            if not part:
                raise FrameError(f"stream ended after {len(buf)} of {n} bytes",
                                 code="frame_truncated")
            buf += part
            feed.last_byte = time.monotonic()
        return bytes(buf)

    # ------------------------------------------------------------------------- push out

    def _remember_addrs(self, route: b.Route) -> None:
        peers = [c for kids in route.children for c in kids] + list(route.sources)
        if route.origin is not None:
            peers.append(route.origin)
        for p in peers:
            if p.addrs:
                self._addrs[p.peer_id] = list(p.addrs)

    async def _connect(self, peer: str) -> None:
        """Make sure a connection to ``peer`` exists (dialing a remembered address if needed)."""
        if any(_pid(p) == peer for p in self.host.connected_peers()):
            return
        errors = []
        for addr in self._addrs.get(peer, []):
            try:
                await self.host.connect(addr, timeout=self.config.connect_timeout_s)
                return
            except (RpcError, ValueError) as exc:
                errors.append(str(exc))
        raise RpcError(f"cannot reach {peer[-8:]}: {'; '.join(errors) or 'no address'}")

    async def _drop_connection(self, peer: str) -> None:
        """Forget a connection that no longer carries requests, so the next use dials afresh."""
        with trio.move_on_after(_STREAM_CLOSE_TIMEOUT):
            try:
                await self.host.disconnect(peer)
            except Exception:  # already gone
                log.debug("disconnecting %s failed", peer[-8:], exc_info=True)

    async def _write(self, stream: INetStream, data: bytes) -> None:
        if self._bucket is not None:
            await self._bucket.take(len(data))
        with trio.fail_after(transfer_timeout(len(data), self.config.write_base_timeout_s)):
            await stream.write(data)

    def _lagging(self, t: Transfer, stripe: int, key: tuple[int, str]) -> bool:
        lag = self.config.max_lag_chunks
        if lag <= 0:
            return False
        best = max(c for (s, _), c in t.cursors.items() if s == stripe)
        return best - t.cursors[key] > lag

    async def _push_to(self, t: Transfer, stripe: int, child: b.PeerAddr) -> None:
        """Push every chunk of ``stripe`` to ``child`` as it becomes available here."""
        key = (stripe, child.peer_id)
        t.cursors[key] = 0
        t.child_state[key] = "connecting"
        stream: INetStream | None = None
        ok = False
        cfg = self.config
        try:
            with trio.fail_after(cfg.connect_timeout_s):
                await self._connect(child.peer_id)
                stream = await self.host.libp2p.new_stream(
                    ID.from_base58(child.peer_id), [TProtocol(b.PROTO_PUSH)]
                )
            hello = b.PushHello(job_id=t.job_id, version=t.version, stripe=stripe,
                                stripes=t.stripes, manifest=t.envelope, weights=t.weights)
            await self._write(stream, encode_frame(b.encode(hello), b.MAX_HELLO_BYTES))
            t.child_state[key] = "pushing"
            acks = _Acks()
            error: BaseException | None = None
            reason = "shutdown"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_acks, stream, t, key, acks)
                try:
                    reason = await self._push_stripe(t, stripe, key, stream, acks)
                    end = b.PushHeader(op="end", job_id=t.job_id, version=t.version,
                                       reason=reason)
                    await self._write(stream, encode_frame(b.encode(end), b.MAX_HEADER_BYTES))
                    # Half-close and let the child acknowledge what is in flight and close its
                    # side: closing both ways now would make its late acks draw a reset, and a
                    # reset discards what it has not read yet.
                    with trio.move_on_after(_CLOSE_TIMEOUT_S):
                        await stream.close_write()
                        await acks.ended.wait()
                except _PUSH_ERRORS as exc:  # re-raised below, outside the nursery's group
                    error = exc
                finally:
                    nursery.cancel_scope.cancel()
            if error is not None:
                raise error
            t.child_state[key] = reason
            ok = True
            if reason == "lagging":
                log.info("%s v%d: child %s lags its siblings; it will pull", t.job_id, t.version,
                         child.peer_id[-8:])
        except _PUSH_ERRORS as exc:
            if t.child_state[key] == "pushing" and t.cursors[key] >= t.stripe_size(stripe):
                # Everything arrived; the child, complete, reset the stream before our "end".
                t.child_state[key] = "done"
            else:
                t.child_state[key] = "failed"
                log.info("%s v%d: pushing stripe %d to %s stopped: %r", t.job_id, t.version,
                         stripe, child.peer_id[-8:], exc)
        finally:
            if stream is not None:
                if ok:
                    await _close_quietly(stream)
                else:
                    await _reset_quietly(stream)

    async def _push_stripe(
        self, t: Transfer, stripe: int, key: tuple[int, str], stream: INetStream, acks: _Acks
    ) -> str:
        """The push loop: chunks in arrival order, at most ``push_window_bytes`` unacknowledged.
        Returns the end reason (``done``, ``lagging``, ``shutdown``).

        :raises trio.TooSlowError: the child acknowledged nothing for ``stall_timeout_s``.
        """
        cfg = self.config
        total, pos = t.stripe_size(stripe), 0
        while acks.sent < total:
            changed = t._changed
            while pos < len(t.order):
                i = t.order[pos]
                pos += 1
                if t.stripe_of(i) != stripe:
                    continue
                ref = t.manifest.chunks[i]
                if not await self._window_open(t, stripe, key, acks, ref.size):
                    return "lagging"
                data = self._chunk(ref.sha256)
                if data is None:  # pruned under us: the child pulls it elsewhere
                    return "shutdown"
                hdr = b.PushHeader(op="chunk", job_id=t.job_id, version=t.version, index=i)
                if t.stats.first_push_at is None:
                    t.stats.first_push_at = time.monotonic()
                # Counted as sent before the write returns: the child may acknowledge it first.
                acks.sent_bytes.append(acks.sent_bytes[-1] + len(data))
                await self._write(stream, encode_frame(b.encode(hdr), b.MAX_HEADER_BYTES)
                                  + encode_frame(data, MAX_CHUNK_BYTES))
                t.stats.pushed_out_bytes += len(data)
                self.pushed_out_total += len(data)
                if acks.sent < total and self._lagging(t, stripe, key):
                    return "lagging"
            if acks.sent >= total:
                break
            with trio.move_on_after(cfg.idle_interval_s) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                hdr = b.PushHeader(op="idle", job_id=t.job_id, version=t.version)
                await self._write(stream, encode_frame(b.encode(hdr), b.MAX_HEADER_BYTES))
        return "done"

    async def _window_open(
        self, t: Transfer, stripe: int, key: tuple[int, str], acks: _Acks, size: int
    ) -> bool:
        """Wait until ``size`` more bytes fit the child's window; False if it lags meanwhile."""
        cfg = self.config
        last_ack = time.monotonic()
        floor = 2 * max(size, 1)
        while (acks.unacked + size > acks.window(floor, cfg.push_window_bytes)
               and acks.unacked > 0):
            if self._lagging(t, stripe, key):
                return False
            changed, before = acks.changed, acks.count
            with trio.move_on_after(min(1.0, cfg.idle_interval_s)):
                await changed.wait()
            if acks.count > before:
                last_ack = time.monotonic()
            elif time.monotonic() - last_ack > cfg.stall_timeout_s:
                raise trio.TooSlowError
        return True

    @staticmethod
    async def _read_acks(stream: INetStream, t: Transfer, key: tuple[int, str],
                         acks: _Acks) -> None:
        """Read the child's acknowledgements until the stream ends (errors end it quietly)."""
        try:
            while True:
                ack = b.decode(b.PushAck, await read_frame(stream, b.MAX_HEADER_BYTES))
                if ack.received > acks.sent:
                    log.info("push ack for %d chunks, only %d sent", ack.received, acks.sent)
                    return
                if ack.received > acks.count:
                    acks.acked(ack.received)
                    t.cursors[key] = ack.received
                    t.stats.last_ack_at = t.acked_at[key] = time.monotonic()
        except (ProtocolError, BaseLibp2pError, OSError):
            return
        except Exception:  # never let the reader take the sender down with it
            log.debug("reading push acks failed", exc_info=True)
            return
        finally:
            acks.ended.set()

    # ------------------------------------------------------------------------- stalls and pulls

    async def _watchdog(self, t: Transfer) -> None:
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
                    self._report(t, f.peer, "stalled", detail="no data or keep-alive in time")
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
            t._set_want({i for i in t.missing() if t.stripe_of(i) not in fed})
            if t.want and not t.pullers_started and t.nursery is not None:
                t.pullers_started = True
                t.nursery.start_soon(self._have_poller, t)
                for w in range(max(1, cfg.pull_parallel)):
                    t.nursery.start_soon(self._pull_worker, t, w)
            with trio.move_on_after(tick):
                await t.done.wait()

    async def _on_have(self, peer_id: ID, data: bytes) -> bytes:
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
            if (p in out or p == self._me or p == origin or p in self.excluded
                    or self._unreachable.get(p, 0.0) > now):
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
                await self._connect(peer)
                raw = await self.host.request(peer, b.PROTO_HAVE, req, timeout=_HAVE_TIMEOUT_S,
                                              max_response=b.MAX_HAVE_REPLY_BYTES)
                reply = b.decode(b.HaveReply, raw)
            except (RpcError, ProtocolError, OSError, ValueError) as exc:
                self._unreachable[peer] = time.monotonic() + _UNREACHABLE_S
                log.debug("have-map of %s: %r", peer[-8:], exc)
                return
            if reply.chunks not in (0, t.n) or len(reply.bitmap) != (reply.chunks + 7) // 8:
                reply = b.HaveReply(chunks=0, bitmap=b"")  # malformed: as if it held nothing
            t.peer_have[peer] = _PeerHave(time.monotonic(), reply.bitmap, reply.complete)

    def _pick_pull(self, t: Transfer) -> tuple[int, str] | None:
        """The lowest wanted chunk someone is known to hold, from its least busy holder; the
        origin only for chunks nobody else showed for ``origin_grace_s``."""
        now = time.monotonic()
        route = t.route
        origin = route.origin.peer_id if route and route.origin else None
        if origin in self.excluded or origin == self._me:
            origin = None
        holders_all = [
            (p, h) for p, h in t.peer_have.items()
            if p not in self.excluded and self._unreachable.get(p, 0.0) <= now
        ]
        # Nobody but the origin to ask: no point waiting for have-maps.
        others = bool(route and route.sources) or bool(holders_all)
        for i in sorted(t.want):
            if i in t.pulling or t.have[i] or t.retry_at.get(i, 0.0) > now:
                continue
            holders = [p for p, h in holders_all
                       if h.has(i) and t.inflight[p] < _PULLS_PER_PEER]
            if holders:
                return i, min(holders, key=lambda p: (p in self.stalled, t.inflight[p],
                                                      hash((p, i))))
            if (origin is not None and t.inflight[origin] < self.config.pull_parallel
                    and self._unreachable.get(origin, 0.0) <= now
                    and (now - t.wanted_since.get(i, now) >= self.config.origin_grace_s
                         or not others)):
                return i, origin
        return None

    async def _pull_worker(self, t: Transfer, worker: int) -> None:
        while not t.complete:
            pick = self._pick_pull(t)
            if pick is None:
                with trio.move_on_after(_PULL_IDLE_S):
                    await t._want_changed.wait()
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
            await self._connect(peer)
            data = await fetch_chunk(self.host, peer, ref, timeout=self.config.pull_timeout_s)
        except ChunkHashMismatch as exc:
            t.stats.bad_chunks += 1
            self._report(t, peer, "bad_chunk", index, str(exc))
            return False
        except RemoteError:
            t.peer_have.pop(peer, None)  # its map was stale (or a lie): ask again later
            return False
        except (RpcError, ProtocolError, OSError, ValueError) as exc:
            self._unreachable[peer] = time.monotonic() + _UNREACHABLE_S
            log.info("pull of chunk %d from %s failed: %r", index, peer[-8:], exc)
            if isinstance(exc, RpcConnectionError):
                await self._drop_connection(peer)
            return False
        try:
            await self._accept(t, index, data, via="pull")
        except ChunkHashMismatch:  # fetch_chunk checked it; only a store fault gets here
            log.exception("chunk %d failed its hash after fetch_chunk accepted it", index)
            return False
        except StoreError as exc:
            log.error("%s", exc)
            return False
        return True


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
    relay = Relay(host, store, learner_keys=learner_keys, on_bad_peer=on_bad_peer, config=config,
                  serve_pulls=serve_pulls)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        try:
            yield relay
        finally:
            nursery.cancel_scope.cancel()


__all__ = [
    "BroadcastTimeout",
    "ManifestError",
    "Relay",
    "RelayConfig",
    "StoreError",
    "Transfer",
    "TransferStats",
    "open_relay",
    "verify_manifest",
]
