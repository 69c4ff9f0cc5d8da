"""Nodes do no work for strangers (issue 13, item 5): gossip validated before it is forwarded,
a push hello's version and sender checked before its manifest, chunk serving under a per-peer
budget and the host's upload cap. Real hosts over loopback."""

from __future__ import annotations

import hashlib
import time

import pytest
import trio
from libp2p.custom_types import TProtocol

import echo.p2p.relay.relay as relay_mod
from echo.p2p.budget import Limit, UploadLimiter
from echo.p2p.chunkstore import ChunkStore, fetch_chunk, serve_chunks
from echo.p2p.gossip_validate import signed_by
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.relay import open_relay
from echo.p2p.rpc import RemoteError, RpcConnectionError
from echo.protocol import broadcast as b
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.framing import encode_frame

KIND = b.PlanAnnouncement.KIND
TOPIC = ids.TOPIC_VERSIONS


def test_gossip_junk_is_neither_delivered_nor_forwarded() -> None:
    """coord -> node <- stranger, node -> far: the node validates, so far sees only coord's."""

    async def main() -> None:
        ids_ = [Identity.generate() for _ in range(4)]
        with trio.fail_after(40):
            async with (
                open_host(ids_[0]) as coord,
                open_host(ids_[1]) as node,
                open_host(ids_[2]) as stranger,
                open_host(ids_[3]) as far,
            ):
                for h in (coord, stranger, far):
                    await h.connect(node.listen_multiaddrs[0], timeout=5)
                sub = await node.subscribe(TOPIC, signed_by(coord.peer_id, KIND, 1 << 20))
                far_sub = await far.subscribe(TOPIC)  # no validator: sees what node forwards
                for h in (coord, stranger):
                    await h.subscribe(TOPIC)
                    await h.wait_for_subscribers(TOPIC, 1, timeout=10)
                await node.wait_for_subscribers(TOPIC, 3, timeout=10)
                await trio.sleep(2.5)  # a heartbeat or two: meshes formed
                junk = [
                    b"junk",
                    signing.seal(stranger.identity.private_key, KIND, {"x": 1}),  # its own key
                    signing.seal(coord.identity.private_key, KIND, {"x": 1}),  # replayed by it
                ]
                for data in junk:
                    await stranger.publish(TOPIC, data)
                good = signing.seal(coord.identity.private_key, KIND, {"plan": 1})
                await coord.publish(TOPIC, good)
                got, far_got = [], []
                with trio.move_on_after(5):
                    async for _origin, data in sub:
                        got.append(data)
                        break
                with trio.move_on_after(3):
                    async for _origin, data in far_sub:
                        far_got.append(data)
                assert got == [good]
                assert far_got == [good]

    trio.run(main)


def test_push_hello_version_and_sender_are_checked_before_the_manifest(tmp_path, monkeypatch):
    calls = []
    real = relay_mod.verify_manifest

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(relay_mod, "verify_manifest", spy)
    learner = Identity.generate()

    async def push(host, peer, version: int) -> None:
        hello = b.PushHello(
            job_id="j",
            version=version,
            stripe=0,
            stripes=1,
            manifest=b"\x00" * (1 << 20),
            weights=[],
        )
        try:
            stream = await host.libp2p.new_stream(peer, [TProtocol(b.PROTO_PUSH)])
            await stream.write(encode_frame(b.encode(hello), b.MAX_HELLO_BYTES))
            with trio.move_on_after(2):
                await stream.read(10)
            await stream.reset()
        except Exception:  # refused: reset before or after negotiation
            pass

    async def main() -> None:
        with trio.fail_after(40):
            async with (
                open_host(Identity.generate(), pubsub=False) as node,
                open_host(Identity.generate(), pubsub=False) as stranger,
            ):
                store = ChunkStore(tmp_path / "chunks")
                keys = {"j": learner.public_key_bytes}
                async with open_relay(node, store, learner_keys=keys) as relay:
                    peer = await stranger.connect(node.listen_multiaddrs[0])
                    relay._floor["j"] = 5  # versions up to 5 were dropped here
                    await push(stranger, peer, 3)  # stale: refused unverified
                    assert calls == []
                    node.gate.set_limit(b.PROTO_PUSH, Limit(0.01, 2, 1e9, 1e9))
                    for _ in range(6):  # fresh versions, junk manifests, from one sender
                        await push(stranger, peer, 9)
                    assert len(calls) <= 2  # only what the sender's budget admitted
                    relay.exclude(stranger.peer_id)
                    n = len(calls)
                    await push(stranger, peer, 10)
                    assert len(calls) == n

    trio.run(main)


def _chunks(tmp_path, n: int, size: int) -> tuple[ChunkStore, list[m.ChunkRef]]:
    store = ChunkStore(tmp_path / "serve")
    refs = []
    for i in range(n):
        data = bytes([i]) * size
        store.put(1, data)
        refs.append(m.ChunkRef(sha256=hashlib.sha256(data).digest(), size=size))
    return store, refs


def test_chunk_serving_obeys_the_upload_cap(tmp_path) -> None:
    store, refs = _chunks(tmp_path, 3, 1 << 20)

    async def main() -> None:
        with trio.fail_after(40):
            async with (
                open_host(Identity.generate(), pubsub=False) as server,
                open_host(Identity.generate(), pubsub=False) as leecher,
            ):
                serve_chunks(server, store)
                server.upload_limiter = UploadLimiter(1e6, burst=64 * 1024)
                peer = await leecher.connect(server.listen_multiaddrs[0])
                t0 = time.monotonic()
                for ref in refs:
                    await fetch_chunk(leecher, peer, ref, timeout=20)
                assert time.monotonic() - t0 >= 2.5  # 3 MiB at 1 MB/s

    trio.run(main)


def test_chunk_serving_has_a_per_peer_byte_budget(tmp_path) -> None:
    store, refs = _chunks(tmp_path, 3, 1 << 20)

    async def main() -> None:
        with trio.fail_after(40):
            async with (
                open_host(Identity.generate(), pubsub=False) as server,
                open_host(Identity.generate(), pubsub=False) as leecher,
                open_host(Identity.generate(), pubsub=False) as other,
            ):
                serve_chunks(server, store)
                server.gate.set_limit(ids.PROTO_CHUNK, Limit(100, 100, 1e5, 1.5 * (1 << 20)))
                peer = await leecher.connect(server.listen_multiaddrs[0])
                await fetch_chunk(leecher, peer, refs[0], timeout=10)
                with pytest.raises((RemoteError, RpcConnectionError)):
                    await fetch_chunk(leecher, peer, refs[1], timeout=10)
                # Another peer has its own budget.
                peer2 = await other.connect(server.listen_multiaddrs[0])
                await fetch_chunk(other, peer2, refs[2], timeout=10)

    trio.run(main)


def test_chunk_budget_covers_a_whole_version_but_not_endless_pulls(tmp_path) -> None:
    """A peer may pull the largest version held twice in a burst, however small the default
    budget (a real model's anchor outgrew the 64 MB default and a new node was refused and
    backed off); the sustained rate still stops a third pull."""
    store, refs = _chunks(tmp_path, 3, 1 << 20)

    async def main() -> None:
        with trio.fail_after(40):
            async with (
                open_host(Identity.generate(), pubsub=False) as server,
                open_host(Identity.generate(), pubsub=False) as node,
            ):
                server.gate.default = Limit(100, 100, 1e5, 1.5 * (1 << 20))
                serve_chunks(server, store)
                peer = await node.connect(server.listen_multiaddrs[0])
                for ref in refs + refs:  # the whole 3 MiB version, twice
                    await fetch_chunk(node, peer, ref, timeout=10)
                with pytest.raises((RemoteError, RpcConnectionError)):
                    await fetch_chunk(node, peer, refs[0], timeout=10)

    trio.run(main)
