"""The signing envelope: an Ed25519 signature over a record's canonical bytes.

An envelope is ``{"v", "kind", "body", "signer", "sig"}``. The signature covers a domain prefix,
the protocol version and the kind as well as the body, so a signature made for one kind of
message can never be replayed as another. Verification happens on the received body bytes,
before they are decoded into a record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from echo.protocol import codec
from echo.protocol.errors import DecodeError, SchemaError, SignatureError, VersionError
from echo.protocol.ids import PROTOCOL_VERSION

_DOMAIN = b"echo-swarm/envelope\x00"
_KINDS_MAX_LEN = 32


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
