"""Tests for the weight patch codec (the package ``echo.protocol.patch``):
exact round trips, compression, and a decoder that fails closed (only ProtocolError subclasses,
before allocating) on truncated, forged and fuzzed input."""

from __future__ import annotations

import contextlib
import resource
import struct
import time

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo.protocol.errors import DecodeError, ProtocolError
from echo.protocol.patch import (
    MAX_PATCH_TENSORS,
    MAX_TENSOR_ELEMENTS,
    apply_patch,
    apply_patch_inplace,
    encode_patch,
    patch_stats,
)
from echo.protocol.patch import format as P

BIG = 1 << 30  # max_output_bytes for tests that are not about the limit


def _bf16_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """bf16 bit patterns of N(0, 0.02) weights."""
    f = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)


def _nudge(rng: np.random.Generator, a: np.ndarray, frac: float) -> np.ndarray:
    """Copy of ``a`` with about ``frac`` of its elements moved by +-1..2 in their bit pattern."""
    out = a.copy()
    if a.size == 0:
        return out
    idx = np.flatnonzero(rng.random(a.size) < frac)
    step = rng.choice(np.array([-2, -1, 1, 2]), idx.size).astype(a.dtype)
    out[idx] = a[idx] + step
    return out


def _mutate(rng: np.random.Generator, a: np.ndarray, mode: str) -> np.ndarray:
    if mode == "same" or a.size == 0:
        return a.copy()
    if mode == "all":
        return (a + a.dtype.type(1)).astype(a.dtype)
    if mode == "random":
        info = np.iinfo(a.dtype)
        return rng.integers(info.min, info.max, a.size, dtype=a.dtype, endpoint=True)
    frac = {"rare": 1e-4, "sparse": 0.01, "medium": 0.08, "dense": 0.4, "most": 0.9}[mode]
    return _nudge(rng, a, frac)


MODES = ("same", "all", "random", "rare", "sparse", "medium", "dense", "most")


def _initial_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "embed": _bf16_like(rng, 120_000),
        "layers.0.w": _bf16_like(rng, 40_000),
        "layers.0.fp32": rng.integers(0, 2**32 - 1, 9_000, dtype=np.uint32),
        "layers.0.signed16": _bf16_like(rng, 3_000).view(np.int16),
        "layers.0.signed32": rng.integers(-(2**31), 2**31 - 1, 2_000, dtype=np.int32),
        "norm": np.full(64, 0x3F80, np.uint16),
        "empty": np.zeros(0, np.uint16),
        "one": np.array([0x3F80], np.uint16),
        "one32": np.array([7], np.uint32),
        "unicode.ß.名": _bf16_like(rng, 17),
    }


def _int32_baseline(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> int:
    pos = [np.flatnonzero(old[k] != new[k]).astype("<i4") for k in old]
    vals = [new[k][old[k] != new[k]] for k in old]
    raw = np.concatenate(pos).tobytes() + np.concatenate(vals).tobytes()
    return len(zstandard.ZstdCompressor(level=3).compress(raw))


# ----------------------------------------------------------------------------- round trips


def test_chain_of_versions_round_trips_bit_exact() -> None:
    rng = np.random.default_rng(0)
    state = _initial_state(rng)
    seen_pos: set[str] = set()
    seen_val: set[str] = set()
    for version in range(24):
        new = {
            k: _mutate(rng, a, MODES[(version + i) % len(MODES)])
            for i, (k, a) in enumerate(state.items())
        }
        snapshot = {k: a.copy() for k, a in state.items()}
        patch = encode_patch(state, new)
        out = apply_patch(state, patch, max_output_bytes=BIG)
        assert list(out) == list(state)
        for k, a in new.items():
            assert out[k].dtype == a.dtype and out[k].shape == a.shape, k
            assert np.array_equal(out[k], a), (version, k)
            assert np.array_equal(state[k], snapshot[k]), "apply_patch mutated its input"
            assert not np.shares_memory(out[k], state[k])
        stats = patch_stats(patch)
        assert stats["bytes"] == len(patch)
        assert stats["changed"] == sum(int((state[k] != new[k]).sum()) for k in state)
        seen_pos |= {k for k, v in stats["positions"].items() if v}
        seen_val |= {k for k, v in stats["values"].items() if v}
        state = out
    assert seen_pos == {"none", "all", "bitmap", "gaps"}
    assert seen_val == {"new", "diff"}


def test_identical_states_make_a_tiny_patch() -> None:
    rng = np.random.default_rng(1)
    state = _initial_state(rng)
    patch = encode_patch(state, state)
    assert patch_stats(patch)["changed"] == 0
    assert len(patch) < 600
    out = apply_patch(state, patch, max_output_bytes=BIG)
    assert all(np.array_equal(out[k], state[k]) for k in state)


def test_strided_inputs_round_trip() -> None:
    rng = np.random.default_rng(6)
    base = _bf16_like(rng, 20_000)
    other = rng.integers(0, 2**16, 40_000, dtype=np.uint16)
    old = {"sparse": base[::2], "diff": base[1::2], "new": base[::-1][::2]}
    new = {"sparse": _nudge(rng, base, 0.05)[::2], "diff": (base + 1)[1::2], "new": other[::4]}
    patch = encode_patch(old, new)
    out = apply_patch(old, patch, max_output_bytes=BIG)
    assert all(np.array_equal(out[k], new[k]) for k in old)


def test_inplace_apply_matches_copying_apply() -> None:
    rng = np.random.default_rng(8)
    state = _initial_state(rng)
    live = {k: a.copy() for k, a in state.items()}
    for version in range(10):
        new = {
            k: _mutate(rng, a, MODES[(version + i) % len(MODES)])
            for i, (k, a) in enumerate(state.items())
        }
        patch = encode_patch(state, new)
        apply_patch_inplace(live, patch, max_output_bytes=BIG)
        for k, a in new.items():
            assert live[k].dtype == a.dtype and np.array_equal(live[k], a), (version, k)
        state = new


def test_inplace_apply_is_all_or_nothing() -> None:
    rng = np.random.default_rng(9)
    old = {"a": _bf16_like(rng, 5000), "b": _bf16_like(rng, 5000)}
    new = {"a": _nudge(rng, old["a"], 0.05), "b": rng.integers(0, 2**16, 5000, dtype=np.uint16)}
    patch = encode_patch(old, new)
    assert patch_stats(patch)["values"] == {"new": 1, "diff": 1}
    live = {"a": old["a"].copy(), "b": new["b"].copy()}  # "b" is already at the new version
    with pytest.raises(DecodeError, match="unchanged"):
        apply_patch_inplace(live, patch, max_output_bytes=BIG)
    assert np.array_equal(live["a"], old["a"]), "tensor a was written before b failed"
    frozen = {k: a.copy() for k, a in old.items()}
    frozen["a"].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        apply_patch_inplace(frozen, patch, max_output_bytes=BIG)


def test_encoding_is_deterministic() -> None:
    rng = np.random.default_rng(7)
    old = _initial_state(rng)
    new = {k: _mutate(rng, a, "sparse") for k, a in old.items()}
    assert encode_patch(old, new) == encode_patch(dict(old), dict(new))


def test_empty_state_round_trips() -> None:
    patch = encode_patch({}, {})
    assert apply_patch({}, patch, max_output_bytes=0) == {}


@pytest.mark.parametrize("frac", [1e-6, 1e-5, 1e-3])
def test_very_sparse_changes_use_escapes_and_wide_remainders(frac: float) -> None:
    rng = np.random.default_rng(2)
    old = {"w": _bf16_like(rng, 2_000_000)}
    new = {"w": _nudge(rng, old["w"], frac)}
    new["w"][[0, -1]] += np.uint16(1)  # changes at both ends: first gap 0, a long last gap
    patch = encode_patch(old, new)
    assert np.array_equal(apply_patch(old, patch, max_output_bytes=BIG)["w"], new["w"])


def test_extreme_values_round_trip_in_both_value_codings() -> None:
    for dt in (np.uint16, np.uint32):
        top = np.iinfo(dt).max
        old = {"w": np.array([0, top, 0, top, 1 << 15, 5, 9], dt)}
        new = {"w": np.array([top, 0, 1 << 15, (1 << 15) - 1, 0, 5, 9], dt)}
        patch = encode_patch(old, new)
        assert np.array_equal(apply_patch(old, patch, max_output_bytes=BIG)["w"], new["w"])


@pytest.mark.parametrize("nbits", [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 36, 37])
def test_low_bit_packing_round_trips(nbits: int) -> None:
    rng = np.random.default_rng(nbits)
    for count in (1, 7, 8, 9, 1000, (1 << 20) + 3):
        s = rng.integers(0, 1 << 40, count, dtype=np.uint64)
        packed = P.pack_low_bits(s, nbits)
        assert packed.size == (count * nbits + 7) // 8
        got = P.unpack_low_bits(packed, count, nbits)
        assert np.array_equal(got, s & np.uint64((1 << nbits) - 1))


def test_sparse_bf16_update_beats_int32_baseline_and_full_copy() -> None:
    rng = np.random.default_rng(3)
    old = {f"t{i}": _bf16_like(rng, 250_000) for i in range(4)}
    new = {k: _nudge(rng, a, 0.01) for k, a in old.items()}
    patch = encode_patch(old, new)
    full = sum(a.nbytes for a in old.values())
    assert len(patch) * 100 < full  # > 100x smaller than the bf16 state
    assert len(patch) * 2.5 < _int32_baseline(old, new)


# ----------------------------------------------------------------------------- encoder errors


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ({"a": np.zeros(3, np.uint16)}, {"b": np.zeros(3, np.uint16)}, "same tensor names"),
        ({"a": np.zeros(3, np.uint16)}, {"a": np.zeros(4, np.uint16)}, "old is"),
        ({"a": np.zeros(3, np.uint16)}, {"a": np.zeros(3, np.int16)}, "old is"),
        ({"a": np.zeros(3, np.uint16)}, {"a": np.zeros(3, np.uint32)}, "old is"),
        ({"a": np.zeros(3, np.float32)}, {"a": np.zeros(3, np.float32)}, "bit view"),
        ({"a": np.zeros(3, ">u2")}, {"a": np.zeros(3, ">u2")}, "bit view"),
        ({"a": np.zeros((2, 2), np.uint16)}, {"a": np.zeros((2, 2), np.uint16)}, "1-D"),
        ({"a": [1, 2]}, {"a": [1, 2]}, "numpy array"),
        ({"": np.zeros(1, np.uint16)}, {"": np.zeros(1, np.uint16)}, "name"),
        ({"x" * 1025: np.zeros(1, np.uint16)}, {"x" * 1025: np.zeros(1, np.uint16)}, "name"),
    ],
)
def test_encode_rejects_mismatched_or_unsupported_input(old, new, match) -> None:
    with pytest.raises(ValueError, match=match):
        encode_patch(old, new)


# ----------------------------------------------------------------------------- decoder errors


def _sample() -> tuple[dict[str, np.ndarray], bytes]:
    rng = np.random.default_rng(4)
    old = {"a": _bf16_like(rng, 5000), "b": rng.integers(0, 2**32 - 1, 300, dtype=np.uint32)}
    new = {"a": _nudge(rng, old["a"], 0.02), "b": old["b"] ^ np.uint32(1)}
    return old, encode_patch(old, new)


def _first_entry_offset(patch: bytes) -> int:
    """Offset of the first tensor's fixed-size entry (after its name)."""
    (name_len,) = struct.unpack_from("<H", patch, 12)
    return 14 + name_len


def _with(patch: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(patch)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def test_every_truncation_is_a_decode_error() -> None:
    old, patch = _sample()
    for cut in range(len(patch)):
        with pytest.raises(DecodeError):
            apply_patch(old, patch[:cut], max_output_bytes=BIG)
    with pytest.raises(DecodeError, match="payload"):
        apply_patch(old, patch + b"\0", max_output_bytes=BIG)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (0, "<I", 0x12345678, "magic"),
        (4, "<H", 2, "format version"),
        (4, "<H", 0, "format version"),
        (6, "<H", 1, "flags"),
        (8, "<I", MAX_PATCH_TENSORS + 1, "limit"),
        (8, "<I", 0xFFFFFFFF, "limit"),
        (8, "<I", 3, "tensor 2"),
        (12, "<H", 0, "name length"),
        (12, "<H", 2000, "name length"),
    ],
)
def test_forged_header_fields_are_decode_errors(offset, fmt, value, match) -> None:
    old, patch = _sample()
    with pytest.raises(DecodeError, match=match):
        apply_patch(old, _with(patch, offset, fmt, value), max_output_bytes=BIG)


def test_unknown_version_has_its_own_code() -> None:
    old, patch = _sample()
    with pytest.raises(DecodeError) as info:
        apply_patch(old, _with(patch, 4, "<H", 99), max_output_bytes=BIG)
    assert info.value.code == "patch_version"


@pytest.mark.parametrize(
    ("field", "fmt", "value", "match"),
    [
        (0, "<B", 3, "width"),
        (1, "<B", 9, "position coding"),
        (2, "<B", 7, "value coding"),
        (3, "<B", 200, "inconsistent"),
        (4, "<Q", MAX_TENSOR_ELEMENTS + 1, "exceed"),
        (4, "<Q", 2**64 - 1, "exceed"),
        (12, "<Q", 2**64 - 1, "changes in"),
        (12, "<Q", 0, "inconsistent"),
    ],
)
def test_forged_table_fields_are_decode_errors(field, fmt, value, match) -> None:
    old, patch = _sample()
    off = _first_entry_offset(patch) + field
    with pytest.raises(DecodeError, match=match):
        apply_patch(old, _with(patch, off, fmt, value), max_output_bytes=BIG)


def test_patch_must_match_the_base_state() -> None:
    old, patch = _sample()
    renamed = {("z" if k == "a" else k): v for k, v in old.items()}
    with pytest.raises(DecodeError, match="do not match the base state"):
        apply_patch(renamed, patch, max_output_bytes=BIG)
    with pytest.raises(DecodeError, match="do not match"):
        apply_patch({"a": old["a"]}, patch, max_output_bytes=BIG)
    with pytest.raises(DecodeError, match="base has"):
        apply_patch({**old, "a": old["a"][:-1]}, patch, max_output_bytes=BIG)
    with pytest.raises(DecodeError, match="base has"):
        apply_patch({**old, "b": old["b"].view(np.uint16)}, patch, max_output_bytes=BIG)
    with pytest.raises(ValueError, match="bit view"):
        apply_patch({**old, "a": old["a"].astype(np.float32)}, patch, max_output_bytes=BIG)


def test_output_limit_is_checked_before_allocation() -> None:
    old, patch = _sample()
    need = sum(a.nbytes for a in old.values())
    assert apply_patch(old, patch, max_output_bytes=need)
    with pytest.raises(DecodeError, match="exceeds"):
        apply_patch(old, patch, max_output_bytes=need - 1)


def test_non_patch_input_types_are_decode_errors() -> None:
    for bad in (None, 3, "ECHP", [1, 2]):
        with pytest.raises(DecodeError):
            apply_patch({}, bad, max_output_bytes=BIG)  # type: ignore[arg-type]
        with pytest.raises(DecodeError):
            patch_stats(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- zstd bombs


def _rle_frame(total: int, content_size: int | None) -> bytes:
    """A hand-made zstd frame of ``total`` zero bytes in 128 KiB RLE blocks (4 bytes each)."""
    block = 1 << 17
    if content_size is None:
        head = struct.pack("<IBB", 0xFD2FB528, 0x00, 0x38)  # no size, 128 KiB window
    else:
        head = struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 0x38, content_size)
    blocks = []
    left = total
    while left > 0:
        size = min(block, left)
        left -= size
        blocks.append(struct.pack("<I", (size << 3) | (1 << 1) | int(left == 0))[:3] + b"\0")
    return head + b"".join(blocks)


def _patch_with_plane0(frame: bytes, raw_len: int) -> tuple[dict[str, np.ndarray], bytes]:
    """A patch for one all-changed uint16 tensor whose plane0 stream is ``frame``."""
    n = raw_len
    old = {"w": np.zeros(n, np.uint16)}
    head = struct.pack("<4sHHI", b"ECHP", 1, 0, 1) + struct.pack("<H", 1) + b"w"
    head += struct.pack("<BBBBQQ", 2, P.POS_ALL, P.VAL_NEW, 0, n, n)
    streams = [(0, 0, 0)] * P.N_STREAMS
    streams[P.Stream.PLANE0] = (1, n, len(frame))
    plane1 = b"\x01" * n
    streams[P.Stream.PLANE0 + 1] = (0, n, n)
    head += b"".join(struct.pack("<BQQ", *s) for s in streams)
    return old, head + frame + plane1


def test_rle_frame_helper_makes_valid_frames() -> None:
    frame = _rle_frame(300_000, 300_000)
    old, patch = _patch_with_plane0(frame, 300_000)
    out = apply_patch(old, patch, max_output_bytes=BIG)
    assert np.array_equal(out["w"], np.full(300_000, 0x0100, np.uint16))


@pytest.mark.parametrize(
    ("total", "declared", "match"),
    [
        (1 << 31, 1 << 31, "declares"),  # honest 2 GiB frame where 1000 bytes are expected
        (1 << 31, None, "declares"),  # no content size: refused, never streamed
        (1 << 31, 1000, "corrupt|gave"),  # a frame that lies about its size
        (999, 1000, "corrupt|gave"),
    ],
)
def test_zstd_bombs_are_refused_quickly_with_bounded_memory(total, declared, match) -> None:
    old, patch = _patch_with_plane0(_rle_frame(total, declared), 1000)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    with pytest.raises(DecodeError, match=match):
        apply_patch(old, patch, max_output_bytes=BIG)
    assert time.perf_counter() - t0 < 1.0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown < 64 * 1024, f"peak memory grew by {grown} KiB"


def test_stream_length_claims_are_checked_against_the_table() -> None:
    frame = _rle_frame(1000, 1000)
    old, patch = _patch_with_plane0(frame, 1000)
    off = patch.index(frame) - (P.N_STREAMS - P.Stream.PLANE0) * 17  # plane0's directory entry
    forged = _with(patch, off + 1, "<Q", 1 << 40)
    with pytest.raises(DecodeError, match="the table allows"):
        apply_patch(old, forged, max_output_bytes=BIG)
    forged = _with(patch, off, "<B", 5)
    with pytest.raises(DecodeError, match="unknown method"):
        apply_patch(old, forged, max_output_bytes=BIG)


# ----------------------------------------------------------------------------- fuzzing

_FUZZ_OLD: dict[str, np.ndarray] = {}
_FUZZ_PATCHES: list[bytes] = []


def _fuzz_corpus() -> tuple[dict[str, np.ndarray], list[bytes]]:
    """Valid patches covering every coding, all against the same small base state."""
    if not _FUZZ_PATCHES:
        rng = np.random.default_rng(5)
        base = {
            "a": _bf16_like(rng, 3000),
            "b": _bf16_like(rng, 700),
            "c": rng.integers(0, 2**32 - 1, 200, dtype=np.uint32),
            "d": np.zeros(0, np.uint16),
        }
        _FUZZ_OLD.update(base)
        for modes in (
            ("sparse", "dense", "same", "same"),
            ("rare", "all", "random", "same"),
            ("most", "medium", "sparse", "same"),
            ("random", "sparse", "all", "same"),
        ):
            new = {k: _mutate(rng, a, m) for (k, a), m in zip(base.items(), modes, strict=True)}
            _FUZZ_PATCHES.append(encode_patch(base, new))
        very_sparse = {k: a.copy() for k, a in base.items()}
        very_sparse["a"][[5, 2990]] += np.uint16(1)  # escaped gap
        _FUZZ_PATCHES.append(encode_patch(base, very_sparse))
    return _FUZZ_OLD, _FUZZ_PATCHES


def _check_outcome(old: dict[str, np.ndarray], data: bytes) -> None:
    """apply_patch either succeeds with well-formed output or raises a ProtocolError."""
    try:
        out = apply_patch(old, data, max_output_bytes=1 << 20)
    except ProtocolError:
        pass
    else:
        assert set(out) == set(old)
        for k, a in out.items():
            assert a.dtype == old[k].dtype and a.shape == old[k].shape
    with contextlib.suppress(ProtocolError):
        patch_stats(data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_valid_patches_raise_only_protocol_errors(data) -> None:
    old, patches = _fuzz_corpus()
    patch = bytearray(data.draw(st.sampled_from(patches)))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(("flip", "set", "insert", "delete", "truncate", "int")))
        pos = data.draw(st.integers(0, len(patch) - 1)) if patch else 0
        if kind == "flip" and patch:
            patch[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and patch:
            patch[pos] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            patch[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and patch:
            del patch[pos : pos + data.draw(st.integers(1, 8))]
        elif kind == "truncate":
            del patch[pos:]
        elif kind == "int" and len(patch) >= pos + 8:
            # Overwrite a u8..u64 with an extreme or random value (hits counts and lengths).
            size = data.draw(st.sampled_from((1, 2, 4, 8)))
            value = data.draw(
                st.one_of(
                    st.sampled_from((0, 1, (1 << 8 * size) - 1)),
                    st.integers(0, (1 << 8 * size) - 1),
                )
            )
            patch[pos : pos + size] = value.to_bytes(size, "little")
    _check_outcome(old, bytes(patch))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    old, _ = _fuzz_corpus()
    _check_outcome(old, data)
    _check_outcome(old, P.MAGIC + data)
    _check_outcome(old, struct.pack("<4sHHI", P.MAGIC, 1, 0, 2) + data)
