"""Typed errors of the wire contract.

Every decoder in ``echo.protocol`` raises a subclass of :class:`ProtocolError` and nothing else on
bad input, so a caller can catch one type, penalize the peer, and keep running.
"""


class ProtocolError(ValueError):
    """Bad input from a peer. ``code`` is a stable machine-readable reason."""

    code = "protocol"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class FrameError(ProtocolError):
    """A length-prefixed frame that is truncated or exceeds its limit."""

    code = "frame"


class DecodeError(ProtocolError):
    """Bytes that are not valid msgpack / zstd / patch data within limits."""

    code = "decode"


class SchemaError(ProtocolError):
    """Well-formed data whose fields do not match the message schema."""

    code = "schema"


class SignatureError(ProtocolError):
    """An envelope whose signature does not verify, or is signed by the wrong key."""

    code = "signature"


class VersionError(ProtocolError):
    """A peer that speaks a protocol version we do not."""

    code = "protocol_version"
