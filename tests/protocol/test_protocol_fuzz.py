"""Property tests: every decoder in echo.protocol, fed arbitrary or mutated bytes, raises only
ProtocolError subclasses (never IndexError, MemoryError, OverflowError ...)."""

from __future__ import annotations

import contextlib

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo.protocol import codec, framing, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

FUZZ = settings(
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_KEY = Ed25519PrivateKey.generate()
_VALID = signing.seal_record(
    _KEY,
    m.Submission(
        lease_id="l",
        job_id="j",
        version=1,
        engine="torch",
        state_digest="x",
        completions=[
            m.CompletionRecord(
                token_ids=m.pack_tokens([4, 2]),
                logprobs=m.pack_logprobs([-1.0, -0.5]),
                finish_reason="stop",
            )
        ],
        gen_seconds=0.1,
    ),
)

# msgpack-shaped values: what a hostile peer can build with a real encoder.
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


def _only_protocol_errors(fn, data) -> None:
    with contextlib.suppress(ProtocolError):
        fn(data)


def _mutate(data: bytes, pos: int, byte: int, cut: int) -> bytes:
    b = bytearray(data)
    b[pos % len(b)] = byte
    return bytes(b[: max(1, len(b) - cut)])


@FUZZ
@given(st.binary(max_size=2048))
def test_unpackb_random(data: bytes) -> None:
    _only_protocol_errors(codec.unpackb, data)


@FUZZ
@given(st.binary(max_size=512))
def test_decompress_random(data: bytes) -> None:
    _only_protocol_errors(lambda d: codec.decompress(d, max_output=1 << 16), data)
    _only_protocol_errors(
        lambda d: codec.decompress(b"\x28\xb5\x2f\xfd" + d, max_output=1 << 16), data
    )


@FUZZ
@given(st.integers(0, 4000), st.integers(0, 255), st.integers(0, 64))
def test_envelope_mutations(pos: int, byte: int, cut: int) -> None:
    _only_protocol_errors(
        lambda d: signing.open_record(d, m.Submission), _mutate(_VALID, pos, byte, cut)
    )


@FUZZ
@given(values)
def test_message_schemas_on_arbitrary_values(obj) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    for cls in (
        m.Submission,
        m.Register,
        m.LeaseRequest,
        m.Lease,
        m.Manifest,
        m.StepReport,
        m.BatchRequest,
        m.NodeStatus,
        m.ManifestRequest,
        m.ChunkRequest,
    ):
        _only_protocol_errors(lambda d, c=cls: m.decode(c, d), data)


@FUZZ
@given(st.binary(max_size=256), st.integers(1, 300), st.integers(0, 64))
def test_packed_arrays(data: bytes, vocab: int, max_len: int) -> None:
    _only_protocol_errors(lambda d: m.unpack_tokens(d, vocab_size=vocab, max_len=max_len), data)
    _only_protocol_errors(lambda d: m.unpack_logprobs(d, max_len=max_len), data)


@FUZZ
@given(st.binary(max_size=8), st.integers(0, 1 << 20))
def test_frame_headers(header: bytes, max_len: int) -> None:
    _only_protocol_errors(lambda h: framing.decode_length(h, max_len), header)
