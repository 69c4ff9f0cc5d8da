"""Push-based, pipelined broadcast of signed, chunked versions down planned trees: the relay.

A :class:`Relay` (:mod:`.relay`) runs on every node and on the publisher, bound to an
:class:`~echo.p2p.host.EchoHost` and a :class:`~echo.p2p.chunkstore.ChunkStore`. For each version
it takes part in it keeps a :class:`Transfer` (:mod:`.transfer`), on which five jobs act:

- **push in** (:mod:`.receive`; ``/echo/push/1.1.0``, see :mod:`echo.protocol.broadcast`): a
  parent opens one stream per stripe and sends chunks, each behind a small header (job, version,
  index). Every chunk is checked against the learner-signed manifest (exact size, then SHA-256)
  *before* it is stored; the manifest itself is verified against the job's pinned learner key
  (:func:`~echo.protocol.manifest.verify_manifest`). Hashing and the disk write run in a worker
  thread (:mod:`.intake`) so a slow disk never stops the event loop. The child acknowledges
  every chunk on the same stream.
- **push out** (:mod:`.push`): every chunk that arrives (pushed, pulled, or already in the store)
  is forwarded at once to this node's children in that chunk's stripe. Each child has its own
  task with its own cursor into the arrival order and at most ``push_window_bytes``
  unacknowledged (the bounded per-child queue), so a slow child never holds up its siblings; a
  child more than ``max_lag_chunks`` acknowledged chunks behind its fastest sibling is told
  ``end(lagging)`` and dropped -- its share of the parent's uplink goes to the others -- and
  pulls the rest.
- **watchdog** (:mod:`.watchdog`): a stripe has no healthy feed if its parent never connected,
  went silent for ``stall_timeout_s`` (keep-alives from a parent waiting on its own upstream
  double that), ended early, or sent a chunk that failed its hash; then the missing chunks of
  that stripe are wanted. A pause of our own process (CPU starvation, a blocked disk) is not
  blamed on the parents.
- **pull fallback** (:mod:`.pull`): wanted chunks are fetched with
  :func:`~echo.p2p.chunkstore.fetch_chunk` from peers whose have-maps (``/echo/have/1.0.0``)
  show them, least busy first, and from the route's origin (the publisher) when nobody else has
  shown a chunk for ``origin_grace_s``. Liars are excluded for good and reported as
  ``bad_chunk``; silent or vanished parents are reported as ``stalled``, through
  ``on_bad_peer`` (:mod:`.peers`).
- **completion**: when every chunk is present, ``Transfer.done`` is set; the node keeps pushing
  to its children and serving pulls (``PROTO_CHUNK``) and have-maps from the store.

Ownership: the relay owns its push and have handlers on the host (removed when it stops) and,
unless ``serve_pulls=False``, registers ``serve_chunks`` for its store (left in place: a node's
worker may serve the same store); the streams it opens (half-closed after ``end``, then closed;
reset on error); the inbound push streams (closed after ``end``, reset when it no longer wants
them); and every task it starts, all inside the nursery of :meth:`Relay.run` /
:func:`open_relay` (cancelled on exit). It does not own the host or the store; it never deletes
chunks itself (:meth:`Relay.prune_store` asks ``ChunkStore.prune``, keeping versions in flight).

Connections: py-libp2p 0.8.1's yamux made reads wait behind bulk writes on the same connection
(window updates, pongs, stream ACKs), which stalled, and with pushes both ways deadlocked,
connections that striped trees load in both directions; :mod:`echo.p2p.yamux` removes that. A
stall that remains (a TCP flow that stops) is seen by the watchdog and pulled around.

Errors: :meth:`Relay.start` raises :class:`ManifestError` (a ``ProtocolError``) for a manifest that
is not signed by the job's learner key or breaks limits, and :meth:`Relay.join_plan` a
``ProtocolError`` for a plan the coordinator did not sign; :meth:`Relay.wait` raises
:class:`BroadcastTimeout`. Peer misbehaviour never raises into the caller: it is logged, reported
and routed around. A failing store (:class:`StoreError`) is logged; the chunk is fetched again.
"""

from echo.p2p.relay.config import RelayConfig
from echo.p2p.relay.intake import StoreError
from echo.p2p.relay.relay import BroadcastTimeout, Relay, open_relay
from echo.p2p.relay.transfer import Transfer, TransferStats
from echo.protocol.manifest import ManifestError, verify_manifest

__all__ = [
    "BroadcastTimeout",
    "ManifestError",
    "Relay",
    "RelayConfig",
    "StoreError",
    "Transfer",
    "TransferStats",
    "open_relay",
    "verify_manifest",
]
