"""Wire records of the push broadcast (``/echo/push/1.1.0``) and of broadcast plans.

Push stream, parent -> child (one stream per version and stripe; frames per
:mod:`echo.protocol.framing`):

1. one frame holding a :class:`PushHello` (at most :data:`MAX_HELLO_BYTES`): which version and
   stripe, plus the learner-signed manifest envelope so a child that has not seen the manifest yet
   can verify it against the job's pinned learner key;
2. any number of (:class:`PushHeader` frame, then for ``op == "chunk"`` one data frame of exactly
   the manifest's size for that chunk). ``op == "idle"`` is a keep-alive from a parent that is
   waiting for its own upstream; ``op == "end"`` is the last frame (``reason`` says why: ``done``,
   ``lagging`` -- the parent stopped pushing to a slow child, which pulls the rest -- or
   ``shutdown``).

The child answers on the same stream with one :class:`PushAck` frame per chunk it received (the
running count): the parent keeps a bounded number of unacknowledged bytes per child and measures
which child lags by them. The child resets the stream when it no longer wants data (complete,
bad chunk, stall). Nothing here does I/O: it only defines and validates records.

``/echo/have/1.0.0`` is a one-frame request/response (:class:`HaveRequest` -> :class:`HaveReply`,
a bitmap of the chunks a peer holds), used to pick whom to pull a missing chunk from.

Plan records are what a coordinator hands a node: :class:`Route` (the node's own slice of a plan:
its children per stripe and fallback sources) and :class:`BroadcastPlan` (the whole plan, as
parent -> children edges per stripe; lists, not maps, so plans of any size stay within the
codec's map limit). :class:`BadPeerReport` is what a node tells the coordinator about a parent
that lied or stalled.

Decoding raises :class:`~echo.protocol.errors.SchemaError` / ``DecodeError`` only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from echo.protocol.limits import MAX_MANIFEST_ENVELOPE_BYTES
from echo.protocol.messages import Id, Record, ShortStr, Version, decode, encode, from_obj

# 1.1.0: stripes may carry unequal shares of the chunks (``weights``, see stripe_table).
PROTO_PUSH = "/echo/push/1.1.0"
PROTO_HAVE = "/echo/have/1.0.0"  # request/response: which chunks of a version a peer holds

# Stripes per plan and peers per list: far above what a plan uses (16 stripes, ~100 nodes per
# parent), small enough that a hostile hello or route costs nothing to refuse.
MAX_STRIPES = 64
MAX_CHUNKS = 65536  # as echo.protocol.messages.Manifest.chunks
MAX_PEERS = 4096
MAX_ADDRS = 8
# The hello carries a signed manifest plus a few fields.
MAX_HELLO_BYTES = MAX_MANIFEST_ENVELOPE_BYTES + 1024
# A sealed plan announcement: a manifest envelope plus up to MAX_PEERS addressed peers.
MAX_PLAN_ENVELOPE_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 512
MAX_HAVE_REQUEST_BYTES = 512
MAX_HAVE_REPLY_BYTES = MAX_CHUNKS // 8 + 64
# Stripe weights are relative shares; this resolution is far finer than bandwidth estimates.
MAX_WEIGHT = 1 << 16

PushOp = Literal["chunk", "idle", "end"]
EndReason = Literal["done", "lagging", "shutdown"]
BadReason = Literal["bad_chunk", "stalled", "protocol"]
ChunkIndex = Annotated[int, Field(ge=0, lt=MAX_CHUNKS)]
Weight = Annotated[int, Field(ge=1, le=MAX_WEIGHT)]
Weights = Annotated[list[Weight], Field(default_factory=list, max_length=MAX_STRIPES)]


def _weights_match(stripes: int, weights: Sequence[int]) -> None:
    if weights and len(weights) != stripes:
        raise ValueError(f"{len(weights)} stripe weights for {stripes} stripes")


def stripe_table(n_chunks: int, stripes: int, weights: Sequence[int] = ()) -> list[int]:
    """The stripe of every chunk of a version: ``i % stripes`` when ``weights`` is empty or
    uniform; otherwise chunks are dealt in index order, each to the stripe that is furthest
    behind its share (the smallest ``(chunks so far + 1) / weight``, ties to the lower stripe),
    so every prefix of the version is split in proportion to the weights (each stripe within
    ``stripes`` chunks of its exact share). Every relay computes the same table from the same
    plan (IEEE division is exact to the last bit everywhere).

    :raises ValueError: ``weights`` not empty and not one per stripe.
    """
    _weights_match(stripes, weights)
    if not weights or len(set(weights)) == 1:
        return [i % stripes for i in range(n_chunks)]
    heap = [(1 / w, s) for s, w in enumerate(weights)]
    heapq.heapify(heap)
    counts = [0] * stripes
    table = []
    for _ in range(n_chunks):
        _, s = heap[0]
        table.append(s)
        counts[s] += 1
        heapq.heapreplace(heap, ((counts[s] + 1) / weights[s], s))
    return table



class PushHello(Record):
    """First frame of a push stream."""

    job_id: Id
    version: Version
    stripe: int = Field(ge=0, lt=MAX_STRIPES)
    stripes: int = Field(ge=1, le=MAX_STRIPES)
    manifest: bytes = Field(max_length=MAX_MANIFEST_ENVELOPE_BYTES)  # learner-signed envelope
    weights: Weights  # the stripes' shares of the chunks (empty: equal, chunk i in i % stripes)

    @model_validator(mode="after")
    def _check(self) -> PushHello:
        _weights_match(self.stripes, self.weights)
        if self.stripe >= self.stripes:
            raise ValueError(f"stripe {self.stripe} of {self.stripes}")
        return self


class PushHeader(Record):
    """Precedes every chunk (and stands alone for idle / end)."""

    op: PushOp
    job_id: Id
    version: Version
    index: ChunkIndex = 0
    reason: EndReason | Literal[""] = ""


class HaveRequest(Record):
    job_id: Id
    version: Version


class HaveReply(Record):
    """Bit ``i`` (LSB first within each byte) set when chunk ``i`` is held; ``chunks == 0`` when
    the peer does not know the version."""

    chunks: int = Field(ge=0, le=MAX_CHUNKS)
    bitmap: bytes = Field(max_length=MAX_CHUNKS // 8)
    complete: bool = False


class PushAck(Record):
    """Child -> parent on a push stream: chunks received on this stream so far."""

    received: int = Field(ge=0, le=MAX_CHUNKS)


class PeerAddr(Record):
    peer_id: ShortStr
    addrs: list[ShortStr] = Field(default_factory=list, max_length=MAX_ADDRS)


class Route(Record):
    """One node's part of a plan for one version: whom it pushes to and whom it may pull from.

    ``children[s]`` are the node's children in stripe ``s`` (chunk ``i`` belongs to stripe
    ``stripe_table(chunks, stripes, weights)[i]``: ``i % stripes`` unless the stripes carry
    unequal shares); ``sources`` are other peers expected to hold the version (pulls rotate
    among them); ``origin`` is the publisher, asked last so it is nobody's first fallback.
    """

    job_id: Id
    version: Version
    stripes: int = Field(ge=1, le=MAX_STRIPES)
    children: list[list[PeerAddr]] = Field(max_length=MAX_STRIPES)
    sources: list[PeerAddr] = Field(default_factory=list, max_length=MAX_PEERS)
    origin: PeerAddr | None = None
    weights: Weights

    @model_validator(mode="after")
    def _check(self) -> Route:
        _weights_match(self.stripes, self.weights)
        return self


class PlanEdge(Record):
    parent: ShortStr
    children: list[ShortStr] = Field(max_length=MAX_PEERS)


class BroadcastPlan(Record):
    """A whole plan: per stripe, parent -> children edges (the source is a parent)."""

    job_id: Id
    version: Version
    source: ShortStr
    stripes: list[list[PlanEdge]] = Field(min_length=1, max_length=MAX_STRIPES)
    weights: Weights  # per stripe, as Route.weights

    @model_validator(mode="after")
    def _check(self) -> BroadcastPlan:
        _weights_match(len(self.stripes), self.weights)
        return self


class PlanAnnouncement(Record):
    """Coordinator-signed: version ``version`` is out (``manifest``, the learner-signed
    envelope) and travels down ``plan``; ``peers`` gives the addresses of everyone in it."""

    KIND: ClassVar[str] = "broadcast_plan"

    job_id: Id
    version: Version
    manifest: bytes = Field(max_length=MAX_MANIFEST_ENVELOPE_BYTES)
    plan: BroadcastPlan
    peers: list[PeerAddr] = Field(max_length=MAX_PEERS)


class BadPeerReport(Record):
    """A node's report of a parent that sent a bad chunk, stalled or broke the protocol."""

    KIND: ClassVar[str] = "bad_peer"

    job_id: Id
    version: Version
    peer_id: ShortStr
    reason: BadReason
    chunk_index: int = Field(default=-1, ge=-1, lt=MAX_CHUNKS)
    detail: ShortStr = ""


__all__ = [
    "MAX_HAVE_REPLY_BYTES",
    "MAX_WEIGHT",
    "stripe_table",
    "MAX_HAVE_REQUEST_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HELLO_BYTES",
    "MAX_PLAN_ENVELOPE_BYTES",
    "PROTO_HAVE",
    "PROTO_PUSH",
    "BadPeerReport",
    "BroadcastPlan",
    "HaveReply",
    "HaveRequest",
    "PeerAddr",
    "PlanAnnouncement",
    "PlanEdge",
    "PushAck",
    "PushHeader",
    "PushHello",
    "Route",
    "decode",
    "encode",
    "from_obj",
]
