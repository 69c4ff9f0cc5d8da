"""Two threads storing the same chunk at once (a pull and a push of one version) both succeed.

They used to share one temporary name, ``<hash>.tmp``: the second rename found it gone and the
node died with FileNotFoundError (seen once in test_real_model_swarm).
"""

from __future__ import annotations

import hashlib
import threading

from echo.p2p.chunkstore import ChunkStore

ROUNDS = 40
WRITERS = 4


def test_concurrent_puts_of_one_chunk(tmp_path) -> None:
    store = ChunkStore(tmp_path / "chunks")
    errors: list[BaseException] = []
    for r in range(ROUNDS):
        data = bytes([r]) * (1 << 20)
        barrier = threading.Barrier(WRITERS)

        def put(data: bytes = data, barrier: threading.Barrier = barrier, v: int = r) -> None:
            try:
                barrier.wait()
                store.put(v, data)
            except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
                errors.append(exc)

        threads = [threading.Thread(target=put) for _ in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.get(hashlib.sha256(data).digest()) == data
    assert errors == []
    assert store.largest_version_bytes() == 1 << 20  # each version counted once
    leftovers = [p for p in (tmp_path / "chunks").rglob("*") if p.suffix == ".tmp"]
    assert leftovers == []
