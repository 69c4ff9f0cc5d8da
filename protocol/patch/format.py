"""The wire format of weight patches, version 1: the specification both sides code against.

This module owns the layout (the header, the tensor table, the stream directory and the order and
meaning of the streams), its limits, the table entry that encoder and decoder share
(:class:`TensorEntry`), and the bit-level primitives of the format (element widths, low-bit
packing and its padding rule). It parses nothing and does no I/O; reading a patch with its checks
is :mod:`echo.protocol.patch.parse`.

Layout (all integers little-endian)::

    header     magic b"ECHP" | u16 format version | u16 flags (0) | u32 tensor count
    table      per tensor: u16 name length | UTF-8 name | u8 width (2 or 4 bytes per element)
               | u8 position coding | u8 value coding | u8 parameter | u64 elements | u64 changed
    directory  per stream (10, in the order below; ids in :class:`Stream`): u8 method
               (0 stored, 1 zstd) | u64 raw length | u64 stored length
    payload    the stored bytes of each stream, in order, and nothing after them

A zstd stream is one frame that declares its content size. Each stream concatenates one kind of
data over all tensors (in table order), so zstd sees homogeneous bytes and tiny tensors cost no
frame overhead:

    bitmap     BITMAP tensors: the change mask, 1 bit per element, LSB first, padded to a byte
    gap_q      GAPS tensors: per change ``min(s >> L, 255)`` where ``s`` is the number of
               unchanged elements skipped before it and ``L`` the tensor's parameter
    gap_r      GAPS tensors: the low ``L`` bits of every ``s``, bit-packed LSB first
               (:func:`pack_low_bits`), padded to a byte per tensor
    gap_x      GAPS tensors: ``s`` as u64 for every change whose ``gap_q`` byte is 255 (escape)
    sign       DIFF tensors: 1 bit per change, set when the new bits are below the old ones
    big        DIFF tensors: 1 bit per change, set when the bits moved by more than 1
    plane0-3   byte k of each value: the new bits of every change (NEW), or ``|new - old| - 2``
               of every ``big`` change (DIFF; differences are taken modulo 2**bits as signed
               integers); 16-bit tensors use planes 0-1, 32-bit tensors planes 0-3

Every bit field is padded with zero bits; a decoder refuses non-zero padding.

Position codings: NONE (nothing changed: no changes, value coding NEW), ALL (every element
changed, at least one: values only), BITMAP (some but not all changed) and GAPS (some but not
all changed; a Rice-like split of the gaps into a byte-sized quotient and uniform low bits, with
``L`` at most the bit length of the element count). Only GAPS has a non-zero parameter. Value
codings: NEW (the new bits) and DIFF (a sign bit, a "moved further" bit and the rare larger
distances). Every listed change must change the bits.

Errors: :class:`~echo.protocol.errors.DecodeError` from the decoding primitives on bad input,
``ValueError`` from :func:`bits_view` on arrays the codec does not take.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from echo.protocol.errors import DecodeError

MAGIC = b"ECHP"
# Bump when the layout changes; decoders reject versions they do not know.
FORMAT_VERSION = 1

# A model has at most a few thousand tensors; 65536 bounds the table parse long before memory.
MAX_PATCH_TENSORS = 1 << 16
# Parameter names are short dotted paths; 1 KiB is far above any real one.
MAX_NAME_BYTES = 1024
# 2**36 elements (128 GiB of bf16) is larger than any single tensor of a real model and keeps
# every position, gap and running sum far from int64 overflow.
MAX_TENSOR_ELEMENTS = 1 << 36

# Element width in bytes -> the unsigned little-endian dtype the codec works on.
WIDTHS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
# Bit views a caller may pass, and their width; a byte-swapped dtype compares unequal to these.
_ACCEPTED = {np.dtype(t): w for t, w in (("u2", 2), ("i2", 2), ("u4", 4), ("i4", 4))}

POS_NONE, POS_ALL, POS_BITMAP, POS_GAPS = 0, 1, 2, 3
VAL_NEW, VAL_DIFF = 0, 1
POS_NAMES = {POS_NONE: "none", POS_ALL: "all", POS_BITMAP: "bitmap", POS_GAPS: "gaps"}
VAL_NAMES = {VAL_NEW: "new", VAL_DIFF: "diff"}


class Stream:
    """Stream ids: each stream's index in the directory and in the payload.

    Plain ints rather than an enum: the decoder indexes its streams with these for every tensor,
    and an enum member lookup costs several times as much.
    """

    BITMAP = 0
    GAP_Q = 1
    GAP_R = 2
    GAP_X = 3
    SIGN = 4
    BIG = 5
    PLANE0 = 6
    PLANE1 = 7
    PLANE2 = 8
    PLANE3 = 9


STREAM_NAMES = (
    "bitmap",
    "gap_q",
    "gap_r",
    "gap_x",
    "sign",
    "big",
    "plane0",
    "plane1",
    "plane2",
    "plane3",
)
N_STREAMS = len(STREAM_NAMES)
# The most value planes a tensor uses (one per byte of its widest elements).
N_PLANES = N_STREAMS - Stream.PLANE0

METHOD_STORED, METHOD_ZSTD = 0, 1
METHOD_NAMES = {METHOD_STORED: "stored", METHOD_ZSTD: "zstd"}

# gap_q byte meaning "the whole gap is in gap_x".
ESCAPE = 255

HEADER = struct.Struct("<4sHHI")  # magic, version, flags, tensor count
NAME_LENGTH = struct.Struct("<H")
TENSOR_FIELDS = struct.Struct("<BBBBQQ")  # width, pos, val, param, numel, changed
STREAM_ENTRY = struct.Struct("<BQQ")  # method, raw length, stored length

# Elements per step when bit-packing remainders (a multiple of 8 keeps every step byte-aligned).
_PACK_CHUNK = 1 << 20


@dataclass
class TensorEntry:
    """One tensor's row of the table: its name, element width and codings, and its counts."""

    name: str
    width: int
    pos: int
    val: int
    param: int
    numel: int
    changed: int

    def to_bytes(self) -> bytes:
        """The entry as the table stores it (name length, name, fixed fields)."""
        name = self.name.encode()
        return (
            NAME_LENGTH.pack(len(name))
            + name
            + TENSOR_FIELDS.pack(
                self.width, self.pos, self.val, self.param, self.numel, self.changed
            )
        )


class StreamEntry(NamedTuple):
    """One stream's row of the directory."""

    method: int
    raw: int
    stored: int


def bits_view(name: str, a: np.ndarray) -> tuple[np.ndarray, int]:
    """Return ``a`` viewed as little-endian unsigned bits and its element width in bytes.

    :raises ValueError: if ``a`` is not a 1-D numpy array of uint16/int16/uint32/int32.
    """
    if not isinstance(a, np.ndarray):
        raise ValueError(f"tensor {name!r}: expected a numpy array, got {type(a).__name__}")
    if a.ndim != 1:
        raise ValueError(f"tensor {name!r}: expected a 1-D bit view, got shape {a.shape}")
    width = _ACCEPTED.get(a.dtype)
    if width is None:
        raise ValueError(
            f"tensor {name!r}: dtype {a.dtype} is not a little-endian uint16/int16/uint32/int32 "
            "bit view"
        )
    return a.view(WIDTHS[width]), width


def pack_low_bits(s: np.ndarray, nbits: int) -> np.ndarray:
    """Pack the low ``nbits`` bits of each uint64 in ``s``, LSB first, into bytes."""
    if nbits == 0 or s.size == 0:
        return np.zeros(0, np.uint8)
    nbytes = (nbits + 7) // 8
    out = []
    for i in range(0, s.size, _PACK_CHUNK):
        b = s[i : i + _PACK_CHUNK].view(np.uint8).reshape(-1, 8)[:, :nbytes]
        bits = np.unpackbits(b, axis=1, bitorder="little")[:, :nbits]
        out.append(np.packbits(bits.ravel(), bitorder="little"))
    return np.concatenate(out)


def unpack_low_bits(buf: np.ndarray, count: int, nbits: int) -> np.ndarray:
    """Inverse of :func:`pack_low_bits`: ``count`` values of ``nbits`` bits as uint64.

    The caller guarantees ``len(buf) == ceil(count * nbits / 8)``; padding bits are checked.

    :raises DecodeError: if the padding bits of the last byte are not zero.
    """
    if nbits == 0:
        return np.zeros(count, np.uint64)
    check_bit_padding(buf, count * nbits, "packed gap remainders")
    out = np.zeros((count, 8), np.uint8)
    step = _PACK_CHUNK
    for i in range(0, count, step):
        k = min(step, count - i)
        chunk = buf[i * nbits // 8 : (i * nbits + k * nbits + 7) // 8]
        bits = np.unpackbits(chunk, count=k * nbits, bitorder="little").reshape(k, nbits)
        packed = np.packbits(bits, axis=1, bitorder="little")
        out[i : i + k, : packed.shape[1]] = packed
    return out.view("<u8").ravel()


def check_bit_padding(buf: np.ndarray, nbits: int, what: str) -> None:
    """Raise DecodeError if the bits after the first ``nbits`` of ``buf`` are not zero."""
    if nbits % 8 and int(buf[-1]) >> (nbits % 8):
        raise DecodeError(f"patch: non-zero padding bits after {what}")
