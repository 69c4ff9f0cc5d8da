"""Gossipsub validators: what a node checks before it takes, and forwards, a gossiped message.

A message a validator refuses is neither delivered to the application nor forwarded to the
node's mesh peers (py-libp2p validates before it forwards), and the peer that sent it loses
gossipsub score. So every topic a node subscribes to gets one: :func:`signed_by` accepts only
messages first published by one known peer (the coordinator), under a size cap, wrapped in an
envelope of one kind that the peer's key signed. The checks run cheapest first: size, then the
originator's peer id (a comparison), then one Ed25519 verification; the body is parsed later by
whoever takes the message.

Validators never raise (a refusal is ``False``).
"""

from __future__ import annotations

from libp2p.peer.id import ID

from echo.p2p.identity import public_key_from_peer_id
from echo.p2p.pubsub import Validator
from echo.protocol import signing
from echo.protocol.errors import ProtocolError


def signed_by(
    publisher: ID | str, kind: str, max_bytes: int, key: bytes | None = None
) -> Validator:
    """A validator that accepts only ``kind`` envelopes of at most ``max_bytes`` published by
    ``publisher`` and signed with its key (``key``, or the one its peer id embeds).

    :raises ProtocolError: ``publisher`` is not a peer id that embeds an Ed25519 key (and no
        ``key`` is given).
    """
    publisher_id = str(publisher)
    signer = key if key is not None else public_key_from_peer_id(publisher_id)

    def validate(origin: ID, data: bytes) -> bool:
        if len(data) > max_bytes or str(origin) != publisher_id:
            return False
        try:
            signing.open_envelope(data, kind=kind, expected_signer=signer, max_bytes=max_bytes)
        except ProtocolError:
            return False
        return True

    return validate
