"""One version moving through a relay: :class:`Transfer`, the state every job of the relay reads
and updates (which chunks are here and in what order, who feeds which stripe, what is wanted,
which children are pushed to), and :class:`TransferStats`, what it cost.

A transfer does no I/O and starts no task; the relay's jobs act on it (:mod:`.receive`,
:mod:`.push`, :mod:`.pull`, :mod:`.watchdog`) inside the nursery it is given
(:attr:`Transfer.nursery`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from echo.p2p.chunkstore import ChunkStore
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol.manifest import ManifestError


@dataclass
class TransferStats:
    """Bytes and chunks of one transfer, by the way they came and went."""

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
class PeerHave:
    """Another peer's have-map as last seen."""

    stamp: float
    bitmap: bytes
    complete: bool

    def has(self, index: int) -> bool:
        return self.complete or (
            index >> 3 < len(self.bitmap) and bool(self.bitmap[index >> 3] & (1 << (index & 7)))
        )


@dataclass
class Feed:
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
        self.feeds: list[Feed] = []
        self.cursors: dict[tuple[int, str], int] = {}
        self.child_state: dict[tuple[int, str], str] = {}
        self.bitmap = bytearray((self.n + 7) // 8)
        self.pulling: set[int] = set()
        self.storing: set[int] = set()
        self.retry_at: dict[int, float] = {}
        self.want: set[int] = set()
        self.wanted_since: dict[int, float] = {}
        self.peer_have: dict[str, PeerHave] = {}
        self.inflight: Counter[str] = Counter()
        self.reported: set[tuple[str, str]] = set()
        self.nursery: trio.Nursery | None = None
        self.started = trio.Event()  # set once ``nursery`` is open (tasks can be started)
        self.pullers_started = False
        self.changed = trio.Event()
        self.want_changed = trio.Event()

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

    def arrived(self, index: int) -> None:
        """Chunk ``index`` is in the store: pushes to children and have-maps may offer it."""
        self.have[index] = True
        self.bitmap[index >> 3] |= 1 << (index & 7)
        self.n_have += 1
        self.order.append(index)
        self.arrived_at.append(time.monotonic())
        self.want.discard(index)
        self.changed.set()
        self.changed = trio.Event()

    def set_want(self, want: set[int]) -> None:
        """The chunks to pull now (the watchdog's decision); wakes the pull workers on a change."""
        if want != self.want:
            now = time.monotonic()
            self.wanted_since = {i: self.wanted_since.get(i, now) for i in want}
            self.want = want
            self.want_changed.set()
            self.want_changed = trio.Event()

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
