"""Taking a chunk in: checked against its hash and written to the store off the event loop,
recorded on its transfer (which completes with the last one), and kept in memory for a while so
that forwarding it to children costs no disk read.

:class:`Intake` is shared by the receiver (pushed chunks) and the pullers (pulled chunks); the
pushers read recent chunks back through :meth:`Intake.chunk`. It owns the forward cache and the
worker threads that hash and write; it does not own the store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import trio

from echo.p2p.chunkstore import ChunkStore
from echo.p2p.relay.transfer import Transfer

log = logging.getLogger(__name__)

# Worker threads hashing and writing chunks (the disk is one device; two overlap hash and I/O).
_STORE_THREADS = 2


class StoreError(RuntimeError):
    """Our own chunk store failed (disk full, permissions): not the peer's fault."""


class Intake:
    """Stores verified chunks for every transfer of one relay (see the module docstring)."""

    def __init__(self, store: ChunkStore, forward_cache_bytes: int) -> None:
        self.store = store
        self._cache_limit = forward_cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cache_bytes = 0
        self._store_limiter = trio.CapacityLimiter(_STORE_THREADS)

    def adopt_stored(self, t: Transfer) -> None:
        """Count at once the chunks already held: this version's, or the same bytes stored for
        an older one (copied under this version)."""
        for i, ref in enumerate(t.manifest.chunks):
            if (self.store.root / str(t.version) / ref.sha256.hex()).exists():
                t.arrived(i)
            elif self.store.has(ref.sha256):
                data = self.store.get(ref.sha256)
                if data is not None:
                    self.store.put(t.version, data, ref.sha256)
                    t.arrived(i)

    async def accept(self, t: Transfer, index: int, data: bytes, via: str) -> bool:
        """Check a chunk's hash, store it, forward it. False if already held (or being stored).

        Hashing and the disk write run in a worker thread (at most ``_STORE_THREADS`` at once):
        under writeback pressure a write can block for seconds, and the event loop must keep
        reading streams meanwhile. ``store.put`` hashes first and raises ChunkHashMismatch
        before anything touches the disk.

        :raises ChunkHashMismatch: ``data`` is not the chunk the manifest names.
        :raises StoreError: the store could not write it.
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
        t.arrived(index)
        if t.complete:
            self.completed(t)
        return True

    def completed(self, t: Transfer) -> None:
        """Every chunk of ``t`` is here: set ``done``, stop pulling and close the feeds."""
        t.done_at = time.monotonic()
        t.done.set()
        t.set_want(set())
        for f in t.feeds:
            if f.state == "open":
                f.state = "complete"
                f.scope.cancel()
        log.info("%s v%d complete: %d chunks, %.2f s, pulled %d", t.job_id, t.version, t.n,
                 t.done_at - t.created, t.stats.chunks_pulled)

    def chunk(self, sha: bytes) -> bytes | None:
        """A chunk to forward: from the in-memory cache of recent arrivals, else the store."""
        data = self._cache.get(sha)
        return data if data is not None else self.store.get(sha)

    def _cache_put(self, sha: bytes, data: bytes) -> None:
        limit = self._cache_limit
        if len(data) > limit or sha in self._cache:
            return
        self._cache[sha] = data
        self._cache_bytes += len(data)
        while self._cache_bytes > limit:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old)
