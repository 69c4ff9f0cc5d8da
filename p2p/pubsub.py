"""Gossipsub for small control messages (version announcements, notices), configured on purpose.

py-libp2p 0.8.1 defaults that bite (see shared/REFERENCES.md, Networking):

- a forwarding peer that sends more than 10 messages/s on one topic has the excess dropped and is
  penalized (``max_messages_per_topic_per_second``); this check also applies to our *own*
  publishes. We raise the limit to :data:`RATE_LIMIT_PER_PEER_TOPIC` and pace our own publishes at
  :data:`PUBLISH_RATE_PER_TOPIC`, well under it, so a burst is delayed rather than silently lost;
- each peer's outbound queue holds 32 RPCs and drops the rest, and a burst of publishes never
  yields to the sender tasks; publish yields after each message and waits while a queue is
  half full (bounded by :data:`BACKPRESSURE_TIMEOUT`);
- each subscription is a 32-slot channel that drops on overflow; a pump task drains it at once
  into a channel of :data:`SUBSCRIPTION_BUFFER` slots and counts what still overflows;
- the heartbeat interval defaults to 120 s; we use 1 s like go-libp2p, so the mesh heals quickly;
- a whole pubsub RPC is capped at 1 MiB; application data is capped lower
  (:data:`MAX_PUBSUB_MESSAGE_BYTES`), checked on publish and by a topic validator on receive.

Bulk bytes never travel here (see ``echo.p2p.rpc`` / the broadcast tree).

Owns: the ``Pubsub`` and ``GossipSub`` services (run by :class:`~echo.p2p.host.EchoHost` inside its
nursery) and one pump task per :class:`Subscription`, started in the nursery it is given.
Errors: ``ValueError`` for an oversized publish or a second subscription to one topic;
``trio.TooSlowError`` from :meth:`PubsubService.wait_for_subscribers`; reading a closed
:class:`Subscription` ends iteration (``trio.EndOfChannel`` from :meth:`Subscription.receive`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, ISubscriptionAPI
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

from echo.p2p.budget import LruMap

logger = logging.getLogger(__name__)

# go-libp2p caps a pubsub RPC at 1 MiB; we keep that so py, go and js peers agree.
MAX_PUBSUB_RPC_BYTES = 1024 * 1024
# Application payload cap: announcements and manifests of large anchors (thousands of chunk
# hashes) fit, and there is ample room under the RPC cap for signature, key, topic and framing.
MAX_PUBSUB_MESSAGE_BYTES = 512 * 1024
# Messages per second, per topic, that we accept from one forwarding peer before dropping
# (py-libp2p default 10 lost 78% of a 50 msg/s stream here). Control traffic is far below this.
RATE_LIMIT_PER_PEER_TOPIC = 100.0
# Our own publishes per topic per second: half the receivers' limit, so network jitter that
# bunches our messages up on arrival still stays under it.
PUBLISH_RATE_PER_TOPIC = 50.0
# Slots between the library's 32-slot subscription queue and the application.
SUBSCRIPTION_BUFFER = 1024
# py-libp2p's per-peer outbound queue is fixed at 32 RPCs (overflow dropped); a publish waits
# while any queue holds this many, for at most BACKPRESSURE_TIMEOUT seconds.
OUTBOUND_QUEUE_HIGH_WATER = 16
BACKPRESSURE_TIMEOUT = 1.0
_BACKPRESSURE_POLL = 0.002
# Mesh degree (target, low, high): gossipsub spec / go-libp2p defaults.
MESH_DEGREE = (6, 4, 12)
# Seconds between heartbeats (mesh maintenance, gossip); py-libp2p defaults to 120.
HEARTBEAT_INTERVAL = 1
# Poll period of wait_for_subscribers (bounded by its timeout).
_POLL_INTERVAL = 0.02
# A forwarder whose messages our validators refused this many times is shut out of pubsub for
# BLACKLIST_S. Honest peers validate before they forward (py-libp2p does) with the same checks,
# so they never pass such a message on; a junk publisher otherwise costs each receiver a
# signature check and a task per message (benchmarks/attack.py: honest throughput 0.57 of
# unattacked beside one gossip spammer).
INVALID_BEFORE_BLACKLIST = 20
BLACKLIST_S = 600.0
# Forwarders whose refusals are counted at once (least recently refused forgotten first).
MAX_COUNTED_FORWARDERS = 10_000

# Validates one received message on a topic: (originator peer id, data) -> accept?
Validator = Callable[[ID, bytes], bool]


@dataclass(frozen=True)
class PubsubConfig:
    """Gossipsub settings; the defaults are the module constants above."""

    max_message_bytes: int = MAX_PUBSUB_MESSAGE_BYTES
    max_rpc_bytes: int = MAX_PUBSUB_RPC_BYTES
    rate_limit_per_peer_topic: float = RATE_LIMIT_PER_PEER_TOPIC
    publish_rate_per_topic: float = PUBLISH_RATE_PER_TOPIC
    subscription_buffer: int = SUBSCRIPTION_BUFFER


class Subscription:
    """Messages ``(from_peer_id, data)`` on one topic; ``from_peer_id`` is the signed originator.

    Our own publishes on a topic we subscribe to are delivered too (compare with our peer id to
    skip them). Use ``async for`` or :meth:`receive`; :meth:`aclose` unsubscribes.
    """

    def __init__(
        self,
        topic: str,
        receive_channel: trio.MemoryReceiveChannel[tuple[ID, bytes]],
        close: Callable[[], object],
    ) -> None:
        self.topic = topic
        self._receive = receive_channel
        self._close = close
        # Messages lost because the application did not keep up (buffer full).
        self.dropped = 0

    async def receive(self) -> tuple[ID, bytes]:
        """Next message; ``trio.EndOfChannel`` once unsubscribed or the host closed."""
        return await self._receive.receive()

    def __aiter__(self) -> AsyncIterator[tuple[ID, bytes]]:
        return self._receive.__aiter__()

    async def aclose(self) -> None:
        await self._close()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class PubsubService:
    """Owns a py-libp2p ``Pubsub`` + ``GossipSub`` pair bound to one host."""

    def __init__(self, host: IHost, config: PubsubConfig | None = None) -> None:
        self.config = config or PubsubConfig()
        degree, low, high = MESH_DEGREE
        self.router = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
            degree=degree,
            degree_low=low,
            degree_high=high,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            spam_protection_enabled=True,
            max_messages_per_topic_per_second=self.config.rate_limit_per_peer_topic,
        )
        self.pubsub = Pubsub(
            host,
            self.router,
            strict_signing=True,
            max_inbound_rpc_size=self.config.max_rpc_bytes,
        )
        self._recent_publishes: dict[str, deque[float]] = {}
        self._nursery: trio.Nursery | None = None
        # Topics with a live Subscription (one per topic).
        self._topics: set[str] = set()
        self._refused: LruMap[ID, list[int]] = LruMap(MAX_COUNTED_FORWARDERS)
        self.blacklisted = 0  # forwarders shut out so far (for tests and logs)
        # py-libp2p refuses blacklisted peers only on streams it opens; inbound ones it would
        # read, parse and spawn a task per message for. Reset those before a byte is read.
        for proto in self.router.get_protocols():
            host.set_stream_handler(proto, self._guarded_stream_handler)
        self._inbound: dict[ID, Any] = {}  # each peer's inbound pubsub stream, while read

    async def _guarded_stream_handler(self, stream: Any) -> None:
        peer = stream.muxed_conn.peer_id
        if self.pubsub.is_peer_blacklisted(peer):
            await stream.reset()
            return
        self._inbound[peer] = stream
        try:
            await self.pubsub.stream_handler(stream)
        finally:
            if self._inbound.get(peer) is stream:
                del self._inbound[peer]

    def _refused_from(self, forwarder: ID) -> None:
        """Count a refused message against ``forwarder``; shut it out at the limit."""
        count = self._refused.setdefault(forwarder, lambda: [0])
        count[0] += 1
        n = count[0]
        if n < INVALID_BEFORE_BLACKLIST or self.pubsub.is_peer_blacklisted(forwarder):
            return
        self._refused.pop(forwarder)
        self.blacklisted += 1
        logger.warning(
            "pubsub: %s forwarded %d invalid messages: shut out for %.0f s",
            forwarder,
            n,
            BLACKLIST_S,
        )
        # Not Pubsub.add_to_blacklist: its teardown task raises KeyError when the peer's
        # stream died meanwhile (py-libp2p 0.8.1), and that error ends the whole pubsub service
        # (seen: an honest node stopped under benchmarks/attack.py's gossip spammer). The set
        # alone makes push_msg drop the peer's messages before any signature check; resetting
        # its inbound stream stops the reading.
        self.pubsub.blacklisted_peers.add(forwarder)
        stream = self._inbound.pop(forwarder, None)
        if self._nursery is not None:
            self._nursery.start_soon(self._shut_out, forwarder, stream)

    async def _shut_out(self, peer: ID, stream: Any) -> None:
        """Reset ``peer``'s inbound stream, then let it back in after :data:`BLACKLIST_S`."""
        if stream is not None:
            with trio.move_on_after(5.0), contextlib.suppress(Exception):
                await stream.reset()
        await trio.sleep(BLACKLIST_S)
        self.pubsub.blacklisted_peers.discard(peer)

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        """Where subscription pump tasks run (the host's nursery)."""
        self._nursery = nursery

    async def publish(self, topic: str, data: bytes) -> None:
        """Sign and publish ``data``; waits if we publish faster than the configured rate.

        :raises ValueError: ``data`` is over ``config.max_message_bytes``.
        """
        if len(data) > self.config.max_message_bytes:
            raise ValueError(
                f"pubsub message of {len(data)} bytes exceeds {self.config.max_message_bytes}; "
                "send bulk data over a stream"
            )
        await self._pace(topic)
        await self._wait_for_queue_room()
        await self.pubsub.publish(topic, bytes(data))
        # py-libp2p's publish path has no checkpoint: without one, a burst of publishes never
        # lets the per-peer sender tasks and subscription pumps run.
        await trio.sleep(0)

    async def _wait_for_queue_room(self) -> None:
        """Back-pressure: py-libp2p's per-peer outbound queues hold 32 RPCs and drop the rest.

        Wait (briefly) until every queue is under the high-water mark; a peer whose queue stays
        full past the timeout is too slow to hold everyone else up, and drops as before.
        """
        queues = getattr(self.pubsub, "peer_queues", {})
        with trio.move_on_after(BACKPRESSURE_TIMEOUT):
            while any(len(q) >= OUTBOUND_QUEUE_HIGH_WATER for q in list(queues.values())):
                await trio.sleep(_BACKPRESSURE_POLL)

    async def _pace(self, topic: str) -> None:
        # Sliding one-second window over our own publishes on this topic.
        recent = self._recent_publishes.setdefault(topic, deque())
        limit = max(1, int(self.config.publish_rate_per_topic))
        while True:
            now = trio.current_time()
            while recent and recent[0] <= now - 1.0:
                recent.popleft()
            if len(recent) < limit:
                break
            await trio.sleep(recent[0] + 1.0 - now)
        recent.append(now)

    async def subscribe(self, topic: str, validator: Validator | None = None) -> Subscription:
        """Subscribe to ``topic``; ``validator`` (optional) rejects received messages.

        Messages over the size limit are rejected before ``validator`` runs; a rejection lowers
        the forwarding peer's gossipsub score.
        """
        if self._nursery is None:
            raise RuntimeError("pubsub is not running (use it inside open_host)")
        if topic in self._topics:
            # py-libp2p hands back the same queue for a second subscribe; two readers would
            # each see only part of the messages.
            raise ValueError(f"already subscribed to {topic!r}; share that Subscription")
        max_bytes = self.config.max_message_bytes

        def _check(msg: rpc_pb2.Message) -> bool:
            if len(msg.data) > max_bytes:
                return False
            if validator is None:
                return True
            try:
                return bool(validator(ID(msg.from_id), msg.data))
            except Exception:
                logger.exception("pubsub validator for %s failed", topic)
                return False

        def _validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            ok = _check(msg)
            if not ok:
                self._refused_from(forwarder)
            return ok

        self._topics.add(topic)
        self.pubsub.set_topic_validator(topic, _validate, False)
        try:
            inner = await self.pubsub.subscribe(topic)
        except BaseException:
            self._topics.discard(topic)
            self.pubsub.remove_topic_validator(topic)
            raise
        send, receive = trio.open_memory_channel[tuple[ID, bytes]](self.config.subscription_buffer)
        sub: Subscription

        async def _close() -> None:
            if topic not in self._topics:
                return
            self._topics.discard(topic)
            self.pubsub.remove_topic_validator(topic)
            await self.pubsub.unsubscribe(topic)
            await send.aclose()

        sub = Subscription(topic, receive, _close)
        self._nursery.start_soon(self._pump, topic, inner, send, sub)
        return sub

    @staticmethod
    async def _pump(
        topic: str,
        inner: ISubscriptionAPI,
        send: trio.MemorySendChannel[tuple[ID, bytes]],
        sub: Subscription,
    ) -> None:
        """Move messages from the library's small queue to ours, draining it fully each wakeup."""
        receive_inner = getattr(inner, "receive_channel", None)

        def forward(msg: rpc_pb2.Message) -> None:
            try:
                send.send_nowait((ID(msg.from_id), bytes(msg.data)))
            except trio.WouldBlock:
                sub.dropped += 1
                if sub.dropped == 1 or sub.dropped % 100 == 0:
                    logger.warning("subscription %s is full: %d dropped", topic, sub.dropped)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass

        try:
            while True:
                try:
                    msg = await inner.get()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                forward(msg)
                if receive_inner is None:
                    continue
                while True:
                    try:
                        forward(receive_inner.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break
        finally:
            await send.aclose()

    def subscribers(self, topic: str) -> set[ID]:
        """Peers known (from their announcements) to subscribe to ``topic``."""
        return set(self.pubsub.peer_topics.get(topic, ()))

    async def wait_for_subscribers(self, topic: str, count: int = 1, timeout: float = 10.0) -> None:
        """Wait until at least ``count`` connected peers announced ``topic``.

        :raises trio.TooSlowError: not within ``timeout`` seconds.
        """
        with trio.fail_after(timeout):
            while len(self.subscribers(topic)) < count:
                await trio.sleep(_POLL_INTERVAL)
