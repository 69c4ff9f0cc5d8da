"""Content-addressed chunks of policy versions: storing, serving and fetching them.

A :class:`ChunkStore` keeps chunks by SHA-256 in a folder, grouped by the version that needs
them, and forgets versions beyond the newest ``keep_versions`` (a node keeps a few to serve peers
that lag). :func:`serve_chunks` answers ``PROTO_CHUNK`` requests from it; :func:`fetch_chunk`
asks a peer for one chunk and checks its hash before returning it, so a relay can never make us
store a byte the signed manifest did not name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from echo.p2p.budget import CHUNK_PREFIX_FACTOR, Audience, Limit
from echo.p2p.host import EchoHost
from echo.protocol import ids
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.limits import MAX_CHUNK_BYTES

CHUNK_REQUEST_MAX = 256


class ChunkHashMismatch(ProtocolError):
    """A peer sent bytes whose hash is not the one we asked for."""

    code = "bad_chunk"


# chunk_size_for: a version is cut into about this many chunks, so that a broadcast tree's
# pipeline fills in a small fraction of the transfer (each hop waits for one whole chunk)...
TARGET_CHUNKS = 512
# ...but no chunk is smaller than this: every chunk costs a header, an ack and a hash per hop,
# which on a Python relay is a fixed CPU cost worth amortising over at least 128 KiB.
MIN_CHUNK_BYTES = 128 * 1024


def chunk_size_for(total_bytes: int) -> int:
    """The chunk size to publish a version of ``total_bytes`` with: a power of two near
    ``total_bytes / TARGET_CHUNKS``, within [``MIN_CHUNK_BYTES``, ``MAX_CHUNK_BYTES``]. Large
    versions (a 14 GB anchor) get 4 MiB chunks and stay far below the manifest's chunk limit."""
    want = max(1, total_bytes // TARGET_CHUNKS)
    size = 1 << (want - 1).bit_length()
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, size))


def split_chunks(data: bytes, chunk_size: int = MAX_CHUNK_BYTES) -> list[bytes]:
    if chunk_size <= 0 or chunk_size > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_BYTES}]")
    return [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)] or [b""]


class ChunkStore:
    """Chunks on disk under ``root/<version>/<sha256 hex>``; one writer (this process)."""

    def __init__(self, root: Path, keep_versions: int = 4) -> None:
        self.root = root
        self.keep_versions = keep_versions
        # Versions never pruned: a LoRA job's version 0 holds the base model every late joiner
        # fetches once (echo.learner.lora).
        self.pinned: set[int] = set()
        root.mkdir(parents=True, exist_ok=True)
        self._index: dict[bytes, Path] = {}
        self._version_bytes: dict[int, int] = {}  # bytes held per version (sizes the budget)
        # put() runs in worker threads too (weight sync, relay intake): one rename at a time.
        self._lock = threading.Lock()
        # When a chunk was last handed out (time.monotonic()); a finished learner serves its
        # final version until nobody has asked for a while.
        self.last_read = 0.0
        for vdir in root.iterdir():
            if vdir.is_dir() and vdir.name.isdigit():
                for f in vdir.iterdir():
                    if len(f.name) == 64:
                        self._index[bytes.fromhex(f.name)] = f
                        v = int(vdir.name)
                        self._version_bytes[v] = self._version_bytes.get(v, 0) + f.stat().st_size

    def has(self, sha: bytes) -> bool:
        return sha in self._index

    def get(self, sha: bytes) -> bytes | None:
        path = self._index.get(sha)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._index.pop(sha, None)
            return None
        self.last_read = time.monotonic()
        return data

    def put(self, version: int, data: bytes, sha: bytes | None = None) -> bytes:
        """Store ``data`` for ``version`` (checked against ``sha`` when given); return its hash."""
        digest = hashlib.sha256(data).digest()
        if sha is not None and digest != sha:
            raise ChunkHashMismatch("chunk does not match its hash")
        vdir = self.root / str(version)
        vdir.mkdir(exist_ok=True)
        path = vdir / digest.hex()
        if not path.exists():
            # A temporary name of this writer's own: two threads storing the same chunk at once
            # (a pull and a push of one version) shared "<hash>.tmp", and the second rename
            # found it gone (FileNotFoundError; a node died of it in test_real_model_swarm).
            tmp = vdir / f"{digest.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(data)
            with self._lock:
                if path.exists():  # the other writer finished first: same bytes
                    tmp.unlink(missing_ok=True)
                else:
                    os.replace(tmp, path)
                    self._version_bytes[version] = self._version_bytes.get(version, 0) + len(data)
        self._index[digest] = path
        return digest

    def largest_version_bytes(self) -> int:
        """The bytes of the largest version held (0 when none)."""
        return max(self._version_bytes.values(), default=0)

    def versions(self) -> list[int]:
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def prune(self, keep: set[int] | None = None) -> None:
        """Forget all but the newest ``keep_versions`` versions (and any in ``keep`` or
        ``pinned``)."""
        vs = self.versions()
        keep = set(keep or ()) | set(vs[-self.keep_versions :]) | self.pinned
        dropped = {str(v) for v in vs if v not in keep}
        for v in dropped:
            shutil.rmtree(self.root / v, ignore_errors=True)
            self._version_bytes.pop(int(v), None)
        # Entry by entry: a relay's worker thread may be adding chunks meanwhile.
        for sha, path in list(self._index.items()):
            if path.parent.name in dropped:
                self._index.pop(sha, None)


def _folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def prune_job_stores(root: Path, keep: set[str], max_bytes: int) -> list[str]:
    """Bound the disk the chunk stores of jobs a node no longer serves may take.

    ``root`` holds one :class:`ChunkStore` folder per job (``root/<job id>``). Folders named in
    ``keep`` (the job being served) are left alone; the others are removed whole, least
    recently written first, until they take at most ``max_bytes`` together (0: remove them
    all). Returns the job ids removed. A node that comes back to a job whose chunks it kept
    serves and reuses them; one whose chunks were pruned fetches the job's anchor again.

    :raises ValueError: ``max_bytes`` is negative.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
    if not root.is_dir():
        return []
    others = []
    for d in root.iterdir():
        if d.is_dir() and d.name not in keep:
            others.append((d.stat().st_mtime, d, _folder_bytes(d)))
    total = sum(size for _, _, size in others)
    removed = []
    for _, d, size in sorted(others, key=lambda x: x[0]):  # oldest first
        if total <= max_bytes:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= size
        removed.append(d.name)
    return removed


def serve_chunks(
    host: EchoHost,
    store: ChunkStore,
    on_served: Callable[[int], None] | None = None,
    audience: Audience | None = None,
) -> None:
    """Answer ``PROTO_CHUNK`` requests from ``store`` (unknown chunk: a status-1 reply);
    ``on_served(n)`` is told the size of every chunk handed out.

    Every chunk is charged to the asking peer's byte budget in the host's gate, and to its
    network's (:data:`~echo.p2p.budget.CHUNK_PREFIX_FACTOR` peers' worth per /24 or /48, unless
    someone set the factor: identities are free, networks are not); over either, a
    ``rate_limited`` reply and a backoff, so one leecher cannot take the uplink. With an
    ``audience`` (the learner's), a peer outside it is also charged to the strangers' shared
    bucket (over it: ``rate_limited``, no backoff -- it is not that peer's doing). Then the
    chunk waits on the host's upload cap (:attr:`EchoHost.upload_limiter`), which relay pushes
    share. A request that came through a circuit relay is answered ``relayed`` (bulk data
    travels on direct connections only; see :mod:`echo.p2p.nat.circuit`).
    """
    if ids.PROTO_CHUNK not in host.gate.prefix_factors:
        host.gate.set_prefix_factor(ids.PROTO_CHUNK, CHUNK_PREFIX_FACTOR)

    fitted: list[Limit | None] = [None]  # the limit this function set, if any

    def fit_budget() -> None:
        # The default burst (64 MB) is smaller than one anchor of a real model (SmolLM2 in
        # bf16: 269 MB), so a new node pulling its first version from the learner was refused
        # and backed off, again and again. The burst covers two of the largest version held;
        # the sustained rate still holds a leecher. A limit someone else set is left alone.
        current = host.gate.limits.get(ids.PROTO_CHUNK)
        if current is not None and current is not fitted[0]:
            return
        need = 2.0 * store.largest_version_bytes()
        if need > host.gate.limit(ids.PROTO_CHUNK).burst_bytes:
            host.gate.raise_burst(ids.PROTO_CHUNK, need)
            fitted[0] = host.gate.limits[ids.PROTO_CHUNK]

    async def handler(peer_id, data: bytes) -> bytes:
        req = m.decode(m.ChunkRequest, data)
        chunk = store.get(req.sha256)
        if chunk is None:
            raise ProtocolError("chunk not held here", code="no_chunk")
        fit_budget()
        peer = str(peer_id)
        if not host.gate.admit_bytes(peer, None, ids.PROTO_CHUNK, len(chunk)):
            host.gate.punish(peer)
            raise ProtocolError("over this peer's chunk budget: back off", code="rate_limited")
        # The strangers' burst: two newcomers' first pulls (the largest version each) at once.
        if audience is not None and not audience.admit(
            peer, len(chunk), 2.0 * store.largest_version_bytes()
        ):
            raise ProtocolError(
                "not planned here: the newcomers' share is spent, retry later", code="rate_limited"
            )
        if host.upload_limiter is not None:
            await host.upload_limiter.take(len(chunk))
        if on_served is not None:
            on_served(len(chunk))
        return chunk

    # Chunks are bulk data: never over a relayed connection (a ``relayed`` error instead); the
    # handler charges each chunk itself, before it waits on the upload cap.
    host.set_handler(
        ids.PROTO_CHUNK,
        handler,
        max_request=CHUNK_REQUEST_MAX,
        direct_only=True,
        charge_response=False,
    )


async def fetch_chunk(host: EchoHost, peer_id, ref: m.ChunkRef, *, timeout: float) -> bytes:
    """One chunk from ``peer_id``, hash-checked. Raises ChunkHashMismatch or the rpc errors."""
    data = await host.request(
        peer_id,
        ids.PROTO_CHUNK,
        m.encode(m.ChunkRequest(sha256=ref.sha256)),
        timeout=timeout,
        max_response=max(ref.size, 1),
    )
    if len(data) != ref.size or hashlib.sha256(data).digest() != ref.sha256:
        raise ChunkHashMismatch(f"chunk {ref.sha256.hex()[:12]} from {peer_id} failed its hash")
    return data
