"""echo.protocol.framing: header encoding and limits."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo.protocol.errors import FrameError, ProtocolError
from echo.protocol.framing import HEADER_LEN, decode_length, encode_frame, encode_header


def test_roundtrip_and_layout() -> None:
    frame = encode_frame(b"abc", max_len=10)
    assert frame == b"\x00\x00\x00\x03abc"
    assert decode_length(frame[:HEADER_LEN], max_len=10) == 3
    assert encode_frame(b"", max_len=0) == b"\x00\x00\x00\x00"
    assert encode_header(3, max_len=3) == b"\x00\x00\x00\x03"


@given(st.binary(max_size=2048))
def test_roundtrip_property(payload: bytes) -> None:
    frame = encode_frame(payload, max_len=2048)
    n = decode_length(frame[:HEADER_LEN], max_len=2048)
    assert frame[HEADER_LEN:] == payload and n == len(payload)


def test_encode_over_limit() -> None:
    with pytest.raises(FrameError):
        encode_frame(b"x" * 11, max_len=10)
    with pytest.raises(FrameError):
        encode_header(11, max_len=10)
    with pytest.raises(FrameError):
        encode_header(-1, max_len=10)


def test_decode_over_limit_is_frame_error() -> None:
    with pytest.raises(FrameError) as info:
        decode_length(b"\xff\xff\xff\xff", max_len=1 << 20)
    assert isinstance(info.value, ProtocolError)
    assert info.value.code == "frame_too_large"
    # Exactly at the limit is fine.
    assert decode_length((1 << 20).to_bytes(4, "big"), max_len=1 << 20) == 1 << 20


@pytest.mark.parametrize("header", [b"", b"\x00", b"\x00\x00\x00", b"\x00\x00\x00\x00\x00"])
def test_decode_bad_header_length(header: bytes) -> None:
    with pytest.raises(FrameError):
        decode_length(header, max_len=100)
