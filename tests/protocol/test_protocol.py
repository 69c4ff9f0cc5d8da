"""echo.protocol: codec limits, zstd caps, the signing envelope and message schemas."""

from __future__ import annotations

import math

import msgpack
import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo.protocol import broadcast as b
from echo.protocol import codec, limits, signing
from echo.protocol import messages as m
from echo.protocol.errors import DecodeError, SchemaError, SignatureError, VersionError
from echo.protocol.ids import PROTOCOL_VERSION


def _submission(**over) -> m.Submission:
    base = dict(
        lease_id="lease-1",
        job_id="job",
        version=3,
        engine="torch",
        state_digest="d" * 64,
        completions=[
            m.CompletionRecord(
                token_ids=m.pack_tokens([5, 6, 2]),
                logprobs=m.pack_logprobs([-0.5, -0.1, -0.2]),
                finish_reason="stop",
            )
        ],
        gen_seconds=0.5,
    )
    base.update(over)
    return m.Submission(**base)


def test_round_trip_keeps_types() -> None:
    sub = _submission()
    back = m.decode(m.Submission, m.encode(sub))
    assert back == sub
    assert m.unpack_tokens(back.completions[0].token_ids, vocab_size=259, max_len=8).tolist() == [
        5,
        6,
        2,
    ]


def test_msgpack_array_bomb_is_refused_before_allocation() -> None:
    # An array header claiming 2^32-1 elements in a 5-byte message.
    bomb = b"\xdd\xff\xff\xff\xff"
    with pytest.raises(DecodeError, match="max_array_len|incomplete|invalid"):
        codec.unpackb(bomb)


def test_msgpack_bin_bomb_and_oversize() -> None:
    bomb = b"\xc6\x7f\xff\xff\xff" + b"x" * 10  # bin32 claiming 2 GiB
    with pytest.raises(DecodeError):
        codec.unpackb(bomb)
    with pytest.raises(DecodeError, match="exceeds the limit"):
        codec.unpackb(b"\x00" * (limits.MAX_MESSAGE_BYTES + 1))


def test_msgpack_depth_and_trailing_bytes() -> None:
    deep = b"\x91" * 100 + b"\x00"  # 100 nested one-element arrays
    with pytest.raises(DecodeError, match="nesting"):
        codec.unpackb(deep)
    with pytest.raises(DecodeError, match="trailing"):
        codec.unpackb(msgpack.packb(1) + b"\x00")
    with pytest.raises(DecodeError):
        codec.unpackb(msgpack.packb({1: 2}))  # non-string keys


def test_zstd_bomb_declared_and_streamed() -> None:
    big = bytes(50 * 1024 * 1024)
    declared = zstandard.ZstdCompressor(write_content_size=True).compress(big)
    assert len(declared) < 10_000
    with pytest.raises(DecodeError, match="declares"):
        codec.decompress(declared, max_output=1 << 20)
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    streamed = cobj.compress(big) + cobj.flush()
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decompress(streamed, max_output=1 << 20)
    assert codec.decompress(codec.compress(b"hello")) == b"hello"
    with pytest.raises(DecodeError):
        codec.decompress(b"not zstd at all")
    with pytest.raises(DecodeError):
        codec.decompress(declared[:20])


def test_envelope_signature_checks() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    sealed = signing.seal_record(key, _submission())
    env, _ = signing.open_record(
        sealed, m.Submission, expected_signer=signing.public_key_bytes(key)
    )
    assert env.signer == signing.public_key_bytes(key)
    with pytest.raises(SignatureError, match="unexpected key"):
        signing.open_record(
            sealed, m.Submission, expected_signer=signing.public_key_bytes(other)
        )
    with pytest.raises(SchemaError, match="expected a 'lease'"):
        signing.open_record(sealed, m.Lease)
    raw = msgpack.unpackb(sealed)
    raw["body"] = raw["body"][:-1] + bytes([raw["body"][-1] ^ 1])
    with pytest.raises(SignatureError, match="bad signature"):
        signing.open_record(msgpack.packb(raw), m.Submission)
    raw = msgpack.unpackb(sealed)
    raw["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(VersionError):
        signing.open_record(msgpack.packb(raw), m.Submission)
    # A signature made for one kind does not verify as another, even with the kind rewritten.
    raw = msgpack.unpackb(sealed)
    raw["kind"] = m.Lease.KIND
    with pytest.raises(SignatureError):
        signing.open_record(msgpack.packb(raw), m.Lease)



def test_record_kinds_are_the_wire_kinds() -> None:
    # The kinds signed records carry are the strings envelopes always carried (protocol 4).
    signed = (m.Register, m.LeaseRequest, m.Lease, m.Submission, m.NodeStatus, m.Manifest,
              m.LearnerHello, m.BatchRequest, m.StepReport, b.PlanAnnouncement, b.BadPeerReport)
    assert [cls.KIND for cls in signed] == [
        "register", "lease_request", "lease", "submission", "node_status", "manifest",
        "learner_hello", "batch_request", "step_report", "broadcast_plan", "bad_peer",
    ]
    assert "KIND" not in m.Submission.model_fields  # a class constant, not a body field
    key = Ed25519PrivateKey.generate()
    sub = _submission()
    sealed = signing.seal_record(key, sub)
    assert msgpack.unpackb(sealed)["kind"] == "submission"
    assert sealed == signing.seal(key, "submission", sub.to_obj())
    assert signing.open_record(sealed, m.Submission)[1] == sub
    with pytest.raises(TypeError):
        signing.seal_record(key, m.StepAck(ok=True))  # never signed: it has no kind
    with pytest.raises(SchemaError):
        signing.open_record(signing.seal(key, "lease", {"lease_id": 1}), m.Lease)
    # A signed body that is not msgpack at all is a bad record too, not a bad envelope.
    body = b"\xc1"
    forged = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "lease", "body": body,
                            "signer": signing.public_key_bytes(key),
                            "sig": key.sign(signing._signed_bytes("lease", body))})
    with pytest.raises(SchemaError):
        signing.open_record(forged, m.Lease)


def test_schema_is_strict() -> None:
    obj = _submission().to_obj()
    with pytest.raises(SchemaError, match="version"):
        m.from_obj(m.Submission, {**obj, "version": "3"})
    with pytest.raises(SchemaError, match="reward: Extra inputs"):
        m.from_obj(m.Submission, {**obj, "reward": 1.0})
    with pytest.raises(SchemaError, match="completions"):
        m.from_obj(m.Submission, {**obj, "completions": []})
    with pytest.raises(SchemaError, match="gen_seconds"):
        m.from_obj(m.Submission, {**obj, "gen_seconds": math.nan})
    with pytest.raises(SchemaError):
        m.from_obj(m.Submission, [1, 2])


def test_packed_arrays_are_checked() -> None:
    with pytest.raises(SchemaError, match="vocabulary"):
        m.unpack_tokens(m.pack_tokens([1, 300]), vocab_size=259, max_len=8)
    with pytest.raises(SchemaError, match="vocabulary"):
        m.unpack_tokens(m.pack_tokens([-1]), vocab_size=259, max_len=8)
    with pytest.raises(SchemaError, match="limit"):
        m.unpack_tokens(m.pack_tokens(range(9)), vocab_size=259, max_len=8)
    with pytest.raises(SchemaError, match="multiple of 4"):
        m.unpack_tokens(b"\x00" * 5, vocab_size=259, max_len=8)
    with pytest.raises(SchemaError, match="finite"):
        m.unpack_logprobs(m.pack_logprobs([-1.0, math.nan]), max_len=8)
    with pytest.raises(SchemaError, match="finite"):
        m.unpack_logprobs(m.pack_logprobs([0.5]), max_len=8)


def test_punch_messages_round_trip_and_bounds() -> None:
    from echo.protocol import nat as r

    req = r.PunchRequest(
        peer_id="12D3KooWpeer",
        method="punch",
        peer_addrs=["/ip4/198.51.100.7/tcp/4001/p2p/12D3KooWpeer"],
        start_in_s=2.0,
        timeout_s=10.0,
    )
    assert m.decode(r.PunchRequest, m.encode(req)) == req
    reply = r.PunchReply(ok=True, via="dial", elapsed_s=0.05)
    assert m.decode(r.PunchReply, m.encode(reply)) == reply
    good = req.to_obj()
    for field, bad in [
        ("method", "relay"),
        ("peer_addrs", []),
        ("peer_addrs", ["/ip4/1.2.3.4/tcp/1"] * (r.MAX_PUNCH_ADDRS + 1)),
        ("start_in_s", -1.0),
        ("start_in_s", r.MAX_PUNCH_DELAY_S + 1),
        ("start_in_s", math.nan),
        ("timeout_s", 0.0),
        ("timeout_s", r.MAX_PUNCH_TIMEOUT_S + 1),
        ("peer_id", ""),
    ]:
        with pytest.raises(SchemaError):
            m.from_obj(r.PunchRequest, {**good, field: bad})
    with pytest.raises(SchemaError):
        m.from_obj(r.PunchReply, {"ok": True, "elapsed_s": -1.0})
