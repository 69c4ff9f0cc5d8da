"""The signing envelope: an Ed25519 signature over a record's canonical bytes.

An envelope is ``{"v", "kind", "body", "signer", "sig"}``. The signature covers a domain prefix,
the protocol version and the kind as well as the body, so a signature made for one kind of
message can never be replayed as another. Verification happens on the received body bytes,
before they are decoded into a record.

Every record that is ever signed carries its kind as the class constant ``KIND`` (see
:mod:`echo.protocol.messages` and :mod:`echo.protocol.broadcast`): :func:`seal_record` signs a
record as its own kind and :func:`open_record` opens an envelope of the kind of the record class
it is given and decodes the body into that class, so no caller spells a kind. The kind strings
are the ones the envelopes always carried ("lease", "submission", "broadcast_plan", ...): the
bytes on the wire are unchanged and so is ``PROTOCOL_VERSION``. :func:`seal` and
:func:`open_envelope` are the kind-agnostic primitives beneath them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from echo.protocol import codec
from echo.protocol.errors import DecodeError, SchemaError, SignatureError, VersionError
from echo.protocol.ids import PROTOCOL_VERSION
from echo.protocol.messages import Record, from_obj

_DOMAIN = b"echo-swarm/envelope\x00"
_KINDS_MAX_LEN = 32

RecordT = TypeVar("RecordT", bound=Record)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified envelope: ``signer`` is the raw 32-byte Ed25519 public key."""

    kind: str
    body: bytes
    signer: bytes
    sig: bytes

    def decode_body(self) -> Any:
        return codec.unpackb(self.body)


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte public key of a private or public Ed25519 key."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _signed_bytes(kind: str, body: bytes) -> bytes:
    return _DOMAIN + PROTOCOL_VERSION.to_bytes(2, "big") + kind.encode() + b"\x00" + body


def seal(key: Ed25519PrivateKey, kind: str, body_obj: Any) -> bytes:
    """Encode ``body_obj`` canonically, sign it as ``kind`` and return the envelope bytes."""
    body = codec.packb(body_obj)
    sig = key.sign(_signed_bytes(kind, body))
    return codec.packb(
        {
            "v": PROTOCOL_VERSION,
            "kind": kind,
            "body": body,
            "signer": public_key_bytes(key),
            "sig": sig,
        }
    )


def open_envelope(
    data: bytes, *, kind: str, expected_signer: bytes | None = None, max_bytes: int | None = None
) -> Envelope:
    """Decode and verify an envelope of ``kind``.

    Raises :class:`DecodeError` for bytes that are not an envelope, :class:`VersionError` for
    another protocol version, :class:`SchemaError` for a wrong kind or malformed fields and
    :class:`SignatureError` when the signature fails or the signer is not ``expected_signer``.
    """
    raw = codec.unpackb(data, **({"max_bytes": max_bytes} if max_bytes else {}))
    if not isinstance(raw, dict) or set(raw) != {"v", "kind", "body", "signer", "sig"}:
        raise DecodeError("not a signed envelope")
    if raw["v"] != PROTOCOL_VERSION:
        raise VersionError(
            f"peer speaks protocol version {raw['v']!r}, this build speaks {PROTOCOL_VERSION}"
        )
    got_kind, body, signer, sig = raw["kind"], raw["body"], raw["signer"], raw["sig"]
    if not isinstance(got_kind, str) or len(got_kind) > _KINDS_MAX_LEN:
        raise SchemaError("envelope kind must be a short string")
    if got_kind != kind:
        raise SchemaError(f"expected a {kind!r} envelope, got {got_kind!r}")
    if not isinstance(body, bytes) or not isinstance(signer, bytes) or not isinstance(sig, bytes):
        raise SchemaError("envelope body, signer and sig must be binary")
    if len(signer) != 32 or len(sig) != 64:
        raise SchemaError("envelope signer must be 32 bytes and sig 64 bytes")
    if expected_signer is not None and signer != expected_signer:
        raise SignatureError("envelope signed by an unexpected key")
    try:
        Ed25519PublicKey.from_public_bytes(signer).verify(sig, _signed_bytes(kind, body))
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("bad signature") from exc
    return Envelope(kind=kind, body=body, signer=signer, sig=sig)


def record_kind(cls: type[Record]) -> str:
    """The envelope kind of the record class ``cls``; TypeError for a record never signed."""
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} is not a signed record (it has no KIND)")
    return kind


def seal_record(key: Ed25519PrivateKey, record: Record) -> bytes:
    """Seal ``record`` in an envelope of its own kind (``type(record).KIND``), signed by ``key``."""
    return seal(key, record_kind(type(record)), record.to_obj())


def open_record(
    data: bytes,
    cls: type[RecordT],
    *,
    expected_signer: bytes | None = None,
    max_bytes: int | None = None,
) -> tuple[Envelope, RecordT]:
    """Open and verify an envelope of the kind of ``cls`` and decode its body as a ``cls``.

    Raises what :func:`open_envelope` raises (a :class:`SchemaError` for an envelope of another
    kind), and :class:`SchemaError` for a verified body that is not a valid ``cls``.
    """
    env = open_envelope(
        data, kind=record_kind(cls), expected_signer=expected_signer, max_bytes=max_bytes
    )
    try:
        obj = env.decode_body()
    except DecodeError as exc:
        raise SchemaError(f"{cls.__name__}: body is not a record: {exc}") from None
    return env, from_obj(cls, obj)
