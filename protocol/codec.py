"""msgpack and zstd codecs with limits checked before allocation.

``packb`` is the one canonical encoding of the protocol: records are dumped as maps in declared
field order with binary types kept binary, so a signer and a verifier agree on the bytes.
``unpackb`` and ``decompress`` are the only ways peer bytes become Python objects; both raise
:class:`~echo.protocol.errors.DecodeError` and nothing else on bad input.
"""

from __future__ import annotations

from typing import Any

import msgpack
import zstandard

from echo.protocol import limits
from echo.protocol.errors import DecodeError

_CONTAINERS = frozenset({list, dict})
# zstd frame magic, little-endian 0xFD2FB528.
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def packb(obj: Any) -> bytes:
    """Encode ``obj`` canonically (maps keep insertion order; bytes stay binary)."""
    return msgpack.packb(obj, use_bin_type=True)


def packb_fields(fields: list[tuple[str, Any]], *, encoded: str, items: list[bytes]) -> bytes:
    """What :func:`packb` makes of the map ``fields`` (in order) with the field ``encoded``'s
    value an array of ``items``, each already a :func:`packb` encoding: a reply made of stored
    records is assembled without decoding them again."""
    packer = msgpack.Packer(use_bin_type=True)
    out = [packer.pack_map_header(len(fields))]
    for name, value in fields:
        out.append(packer.pack(name))
        if name == encoded:
            out.append(packer.pack_array_header(len(items)))
            out.extend(items)
        else:
            out.append(packer.pack(value))
    return b"".join(out)


def unpackb(
    data: bytes,
    *,
    max_bytes: int = limits.MAX_MESSAGE_BYTES,
    max_depth: int = limits.MAX_DEPTH,
) -> Any:
    """Decode one msgpack object from ``data`` within the protocol's limits.

    Container and string lengths are limited inside the C unpacker, before it allocates; the
    nesting depth is checked right after (the input size already bounds the work). Trailing bytes,
    non-string map keys and extension types are refused.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.MAX_STR_LEN,
            max_bin_len=min(limits.MAX_BIN_LEN, max_bytes),
            max_array_len=limits.MAX_ARRAY_LEN,
            max_map_len=limits.MAX_MAP_LEN,
            max_ext_len=0,
        )
    except msgpack.ExtraData as exc:
        raise DecodeError("trailing bytes after the message") from exc
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ValueError covers msgpack's own limit errors ("... exceeds max_array_len") and
        # truncation ("Unpack failed: incomplete input"); UnicodeDecodeError is a ValueError.
        raise DecodeError(f"invalid msgpack: {exc}") from exc
    _check_depth(obj, max_depth)
    return obj


def _check_depth(obj: Any, max_depth: int) -> None:
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise DecodeError(f"msgpack nesting deeper than {max_depth}")
        # msgpack makes exact lists and dicts. A list of scalars (token ids, log-probs: a batch
        # reply holds millions) is told by a C-level pass over its element types, not a loop.
        values = item if isinstance(item, list) else item.values() if isinstance(item, dict) else ()
        if values and not _CONTAINERS.isdisjoint(map(type, values)):
            stack.extend((x, depth + 1) for x in values if isinstance(x, list | dict))


def is_zstd(data: bytes) -> bool:
    """Whether ``data`` starts like a zstd frame (compressed messages are sent as one frame)."""
    return bytes(data[:4]) == _ZSTD_MAGIC


def compress(data: bytes, level: int = 3) -> bytes:
    """zstd-compress ``data``, recording the content size so the decoder can check it first."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def decompress(data: bytes, *, max_output: int = limits.MAX_DECOMPRESSED_BYTES) -> bytes:
    """Decompress one zstd frame, refusing output larger than ``max_output``.

    The declared content size is checked before any buffer is allocated; frames that do not
    declare it are streamed with a hard cap, so a zstd bomb costs at most ``max_output`` bytes.
    """
    if len(data) < 4 or bytes(data[:4]) != _ZSTD_MAGIC:
        raise DecodeError("not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"invalid zstd frame header: {exc}") from exc
    declared = params.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > max_output:
        raise DecodeError(f"zstd frame declares {declared} bytes, limit is {max_output}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if declared != zstandard.CONTENTSIZE_UNKNOWN:
            out = dctx.decompress(data, max_output_size=max_output)
        else:
            out = _stream_capped(dctx, data, max_output)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"invalid zstd data: {exc}") from exc
    if declared != zstandard.CONTENTSIZE_UNKNOWN and len(out) != declared:
        raise DecodeError("zstd frame content size mismatch")
    return out


def _stream_capped(dctx: zstandard.ZstdDecompressor, data: bytes, max_output: int) -> bytes:
    reader = dctx.stream_reader(data)
    parts: list[bytes] = []
    total = 0
    while True:
        block = reader.read(min(1 << 20, max_output + 1 - total))
        if not block:
            return b"".join(parts)
        total += len(block)
        if total > max_output:
            raise DecodeError(f"zstd output exceeds the limit of {max_output} bytes")
        parts.append(block)
