"""What the node and learner handlers share: opening a signed request, who is active, how big a
small request may be, and whether a node may be served at all.

:func:`admission` is the one place the unknown-node and excluded-node refusals are decided and
worded: the node handlers (:mod:`.node`) raise it as a status-1 reply, the submit path
(:mod:`echo.coordinator.submissions.submit`) answers it as a rejected submission.
"""

from __future__ import annotations

import time

from libp2p.peer.id import ID

from echo.coordinator.store import Store
from echo.coordinator.store.rows import NodeRow
from echo.p2p.identity import public_key_from_peer_id
from echo.protocol import reasons as R
from echo.protocol import signing
from echo.protocol.errors import ProtocolError
from echo.protocol.signing import RecordT

# A node that has not been heard from for this long no longer counts towards "all nodes hold v".
NODE_ACTIVE_S = 60.0
# Requests other than submissions and step reports are a few hundred bytes.
SMALL_REQUEST_BYTES = 64 * 1024


def active_nodes(store: Store) -> list[NodeRow]:
    """Nodes heard from within NODE_ACTIVE_S and not excluded (one range of an index, however
    many identities have come and gone)."""
    return store.active_nodes(time.time() - NODE_ACTIVE_S)


def open_signed(data: bytes, cls: type[RecordT], peer_id: ID) -> tuple[signing.Envelope, RecordT]:
    """Open a ``cls`` record that the authenticated peer ``peer_id`` must have signed.

    Raises ProtocolError (a SignatureError for another signer or a bad signature, a SchemaError
    for another kind or a bad record).
    """
    return signing.open_record(data, cls, expected_signer=public_key_from_peer_id(peer_id))


def admission(node: NodeRow | None) -> tuple[str, str] | None:
    """Why ``node`` (None: not registered) may not be served, as ``(reason code, detail)``;
    None when it is a registered node in good standing. The detail names "excluded" for an
    excluded node: the node stops on it rather than retry."""
    if node is None:
        return R.UNKNOWN_NODE, "register first"
    if node.excluded:
        return R.NODE_EXCLUDED, "this node is excluded after repeated verification failures"
    return None


def admitted(node: NodeRow | None) -> NodeRow:
    """``node``, when :func:`admission` lets it be served.

    :raises ProtocolError: with the reason code and detail of :func:`admission`.
    """
    refused = admission(node)
    if refused is not None:
        raise ProtocolError(refused[1], code=refused[0])
    assert node is not None
    return node
