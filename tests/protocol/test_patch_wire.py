"""Pins the wire bytes of the weight patch codec: a fixed small patch that exercises every
position and value coding, both element widths and the escape path, encoded to known bytes.

Two digests: one of the patch as zstd left it (exact bytes; only comparable with the libzstd it
was recorded with, since another zstd release may compress differently), and one of its
zstd-independent content (header, table, stream directory with methods dropped, and every stream
decompressed), read here from the documented layout with ``struct`` alone, so a change to the
layout or to the encoder's choices fails this test whatever zstd does.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import zstandard

from echo.protocol.patch import apply_patch, encode_patch, patch_stats

# Recorded with zstandard 0.25.0 on libzstd 1.5.7, numpy 2.4.6, before the codec was split into
# format/encode/decode/apply modules.
RECORDED_ZSTD = (1, 5, 7)
PATCH_SHA256 = "1efc40caee98b79291834f562e5222e4286e150ec683214e055f9eb6eb0cda3c"
CONTENT_SHA256 = "177e0a26519159f25102783b7bb335c41b5d575574d2d187bb0f8003c4a3f30d"
PATCH_BYTES = 2121

_STREAMS = 10


def _lcg(n: int, seed: int) -> np.ndarray:
    """``n`` pseudo-random uint64 from a fixed LCG (numpy's generators may change streams)."""
    x = np.empty(n, np.uint64)
    s = seed
    for i in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        x[i] = s
    return x


def _states() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    r = _lcg(6000, 29)
    bf16 = (0x3C00 + (r[:4096] >> np.uint64(56))).astype(np.uint16)  # bf16-like small weights
    old = {
        "unchanged": bf16[:300].copy(),
        "all.diff": bf16[:512].copy(),
        "all.new": bf16[1000:1256].copy(),
        "bitmap": bf16[:4096].copy(),
        "gaps": np.tile(bf16, 16),  # 65536 elements
        "fp32": (r[4096:5096] >> np.uint64(32)).astype(np.uint32),
        "signed16": bf16[2000:2600].view(np.int16).copy(),
        "empty": np.zeros(0, np.uint16),
    }
    new = {k: v.copy() for k, v in old.items()}
    new["all.diff"] += np.uint16(1)
    new["all.new"] = (r[5000:5256] >> np.uint64(48)).astype(np.uint16) | np.uint16(1)
    new["all.new"][new["all.new"] == old["all.new"]] ^= np.uint16(2)
    dense = np.flatnonzero((r[:4096] >> np.uint64(20)) % np.uint64(5) < np.uint64(2))
    new["bitmap"][dense] += np.uint16(1)
    # Sparse changes with a few long gaps, so GAPS codes some of them as escapes.
    sparse = np.concatenate([np.arange(3, 4096, 61), [4097, 20100, 65000, 65535]])
    new["gaps"][sparse] -= np.uint16(1)
    new["gaps"][20100] += np.uint16(40)  # one DIFF distance over 1 ("big")
    new["fp32"][::7] = (r[5300:5443] >> np.uint64(33)).astype(np.uint32)
    new["signed16"][::3] += np.int16(1)
    return old, new


def _content(patch: bytes) -> bytes:
    """The patch with every stream decompressed and the compression methods dropped."""
    head = struct.Struct("<4sHHI")
    magic, version, flags, count = head.unpack_from(patch, 0)
    assert (magic, version, flags) == (b"ECHP", 1, 0)
    off = head.size
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", patch, off)
        off += 2 + name_len + struct.calcsize("<BBBBQQ")
    table = patch[:off]
    directory = [struct.unpack_from("<BQQ", patch, off + 17 * i) for i in range(_STREAMS)]
    off += 17 * _STREAMS
    out = [table]
    for method, raw, stored in directory:
        body = patch[off : off + stored]
        off += stored
        data = body if method == 0 else zstandard.ZstdDecompressor().decompress(body)
        assert len(data) == raw
        out.append(struct.pack("<Q", raw) + data)
    assert off == len(patch)
    return b"".join(out)


def test_the_pinned_patch_covers_every_coding() -> None:
    old, new = _states()
    patch = encode_patch(old, new)
    stats = patch_stats(patch)
    assert stats["positions"] == {"none": 2, "all": 2, "bitmap": 1, "gaps": 3}
    assert stats["values"] == {"new": 2, "diff": 4}
    assert stats["streams"]["gap_x"]["raw"] == 16  # two escaped gaps
    assert {s["method"] for s in stats["streams"].values()} == {"stored", "zstd"}
    assert stats["streams"]["plane0"]["raw"] > 0 and stats["streams"]["plane3"]["raw"] > 0
    out = apply_patch(old, patch, max_output_bytes=1 << 20)
    for k, v in new.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v), k


def test_patch_content_is_pinned() -> None:
    old, new = _states()
    content = _content(encode_patch(old, new))
    assert hashlib.sha256(content).hexdigest() == CONTENT_SHA256


@pytest.mark.skipif(
    zstandard.ZSTD_VERSION != RECORDED_ZSTD,
    reason=f"exact bytes were recorded with libzstd {RECORDED_ZSTD}",
)
def test_patch_bytes_are_pinned() -> None:
    old, new = _states()
    patch = encode_patch(old, new)
    assert len(patch) == PATCH_BYTES
    assert hashlib.sha256(patch).hexdigest() == PATCH_SHA256
