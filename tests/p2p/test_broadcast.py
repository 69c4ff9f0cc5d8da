"""Push relay over real libp2p on loopback: delivery, a lying relay, relays killed mid-broadcast.

Every node is an in-process EchoHost + Relay with its own ChunkStore; relays cap their push upload
with the in-process token bucket so that a few MB take long enough to interfere with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from echo.coordinator.dissemination.planner.best import plan_record, route_for
from echo.coordinator.dissemination.planner.equal import plan_tree
from echo.p2p.chunkstore import ChunkStore, split_chunks
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.relay import BroadcastTimeout, ManifestError, Relay, RelayConfig, open_relay
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.errors import ProtocolError
from echo.protocol.framing import encode_frame

JOB = "job-bcast"
TEST_DEADLINE = 45.0
CHUNK = 64 * 1024


class FlippingStore(ChunkStore):
    """A relay's store that flips one bit of one chunk whenever it is read (to push or serve)."""

    def __init__(self, root: Path, bad_sha: bytes) -> None:
        super().__init__(root)
        self.bad_sha = bad_sha

    def get(self, sha: bytes) -> bytes | None:
        data = super().get(sha)
        if data is not None and sha == self.bad_sha:
            data = bytes([data[0] ^ 0x01]) + data[1:]
        return data


class SlowStore(ChunkStore):
    """A node whose disk is slow: every put takes ``delay`` seconds (it runs in a worker thread)."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def put(self, version: int, data: bytes, sha: bytes | None = None) -> bytes:
        time.sleep(self.delay)
        return super().put(version, data, sha)


@dataclass
class Node:
    name: str
    ident: Identity
    store: ChunkStore
    host: EchoHost | None = None
    relay: Relay | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    reports: list[b.BadPeerReport] = field(default_factory=list)


def make_version(tmp: Path, learner: Identity, size: int, version: int = 1):
    payload = os.urandom(size)
    store = ChunkStore(tmp / "src")
    refs = []
    for chunk in split_chunks(payload, CHUNK):
        refs.append(m.ChunkRef(sha256=store.put(version, chunk), size=len(chunk)))
    man = m.Manifest(job_id=JOB, version=version, base_version=-1, kind="anchor",
                     total_size=size, chunks=refs, tensor_digests={}, state_digest="d",
                     anchor_version=version, created_at=0.0)
    return payload, man, signing.seal_record(learner.private_key, man), store


async def run_node(node: Node, keys, cfg: RelayConfig, *, task_status=trio.TASK_STATUS_IGNORED):
    if isinstance(node.store, FlippingStore):
        # Forward from the (lying) store, not from the relay's cache of what arrived intact.
        cfg = dataclasses.replace(cfg, forward_cache_bytes=0)
    with node.scope:
        async with open_host(node.ident, pubsub=False) as host, open_relay(
            host, node.store, learner_keys=keys, on_bad_peer=node.reports.append, config=cfg
        ) as relay:
            node.host, node.relay = host, relay
            task_status.started()
            await trio.sleep_forever()


async def start_swarm(nursery, nodes: list[Node], keys, cfg: RelayConfig) -> dict[str, list[str]]:
    for node in nodes:
        await nursery.start(run_node, node, keys, cfg)
    return {n.name: n.host.listen_multiaddrs for n in nodes}


def run(body) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            await body()

    trio.run(main)


def nodes_for(tmp: Path, count: int) -> list[Node]:
    out = []
    for i in range(count):
        ident = Identity.generate()
        out.append(Node(ident.peer_id_str, ident, ChunkStore(tmp / f"n{i}")))
    return out


@pytest.mark.parametrize("weights", [(), (5, 1, 2)], ids=["equal-stripes", "weighted-stripes"])
def test_tree_delivers_every_chunk(tmp_path: Path, weights: tuple[int, ...]) -> None:
    learner = Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 1_000_000)
    keys = {JOB: learner.public_key_bytes}
    # Generous: on a loaded 2-core machine a healthy parent must never look stalled here.
    cfg = RelayConfig(stall_timeout_s=20.0)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 6)
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes], keys, cfg)
            ups = {n.name: float(1 + i) for i, n in enumerate(nodes)}
            plan = plan_tree(src.name, 4.0, ups, stripes=3 if weights else 2)
            plan = dataclasses.replace(plan, weights=weights)
            # Nodes learn their routes first (as from the coordinator), then the source starts.
            for n in nodes:
                await n.relay.start(env, route_for(plan, n.name, addrs, JOB, 1))
            await src.relay.start(env, route_for(plan, src.name, addrs, JOB, 1))
            for n in nodes:
                t = await n.relay.wait(JOB, 1, timeout=20)
                assert t.payload(n.store) == payload
                # Every chunk came down its own stripe: none had to be pulled.
                assert t.stats.chunks_pulled == 0 and not n.reports, (
                    t.stats, n.reports, [(f.peer[-8:], f.stripe, f.state) for f in t.feeds])
                assert [t.stripe_size(s) for s in range(t.stripes)] == (
                    [10, 2, 4] if weights else [8, 8])
            # Every relay's pushes end once its children hold the version (what a node leaving
            # after the last version waits for).
            for n in [src, *nodes]:
                assert await n.relay.wait_forwarded(JOB, 1, timeout=10)
                states = set(n.relay.transfer(JOB, 1).child_state.values())
                assert not states & {"connecting", "pushing"}, states
            nursery.cancel_scope.cancel()

    run(body)


def test_bit_flipping_relay_is_caught_and_routed_around(tmp_path: Path) -> None:
    learner = Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 800_000)
    keys = {JOB: learner.public_key_bytes}
    # A bad chunk is routed around at once, whatever the stall timeout; keep it out of the way.
    cfg = RelayConfig(stall_timeout_s=20.0, upload_limit_bps=4e6)
    bad_index = 5
    bad_sha = man.chunks[bad_index].sha256

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 5)
        # Single chain source -> liar -> rest: every other node's copy passes the liar.
        liar_ident = Identity.generate()
        liar = Node(liar_ident.peer_id_str, liar_ident, FlippingStore(tmp_path / "liar", bad_sha))
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, liar, *nodes], keys, cfg)
            ups = {liar.name: 100.0, **{n.name: 1.0 for n in nodes}}
            plan = plan_tree(src.name, 1.0, ups, stripes=1)
            assert plan.stripes[0].children[src.name] == (liar.name,)
            victims = set(plan.stripes[0].children[liar.name])
            for n in [liar, *nodes]:
                await n.relay.start(env, route_for(plan, n.name, addrs, JOB, 1))
            await src.relay.start(env, route_for(plan, src.name, addrs, JOB, 1))
            for n in nodes:
                t = await n.relay.wait(JOB, 1, timeout=25)
                got = t.payload(n.store)
                assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
                assert [hashlib.sha256(c).digest() for c in split_chunks(got, CHUNK)] == [
                    c.sha256 for c in man.chunks
                ]
                if n.name in victims:
                    # Caught at exactly that chunk, reported, excluded, fetched elsewhere.
                    assert [(r.peer_id, r.reason, r.chunk_index) for r in n.reports] == [
                        (liar.name, "bad_chunk", bad_index)
                    ]
                    assert liar.name in n.relay.excluded
                    assert t.stats.bad_chunks >= 1 and t.stats.chunks_pulled >= 1
                else:
                    assert all(r.peer_id == liar.name for r in n.reports)
            assert victims
            nursery.cancel_scope.cancel()

    run(body)


def test_killing_30_percent_of_relays_mid_broadcast(tmp_path: Path) -> None:
    learner = Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 3_000_000)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=3.0, idle_interval_s=1.0, upload_limit_bps=2.5e6)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 10)
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes], keys, cfg)
            ups = {n.name: float(10 - i) for i, n in enumerate(nodes)}
            plan = plan_tree(src.name, 3.0, ups, stripes=2)
            for n in nodes:
                await n.relay.start(env, route_for(plan, n.name, addrs, JOB, 1))
            await src.relay.start(env, route_for(plan, src.name, addrs, JOB, 1))
            # Kill the three relays with the most children once data is flowing.
            doomed = sorted(nodes, key=lambda n: -plan.fanout(n.name))[:3]
            assert all(plan.fanout(n.name) > 0 for n in doomed)
            while max(n.relay.transfer(JOB, 1).n_have for n in doomed) < len(man.chunks) // 4:
                await trio.sleep(0.05)
            for n in doomed:
                n.scope.cancel()
            survivors = [n for n in nodes if n not in doomed]
            assert any(not n.relay.transfer(JOB, 1).complete for n in survivors)
            for n in survivors:
                t = await n.relay.wait(JOB, 1, timeout=30)
                assert t.payload(n.store) == payload
            nursery.cancel_scope.cancel()

    run(body)


def test_lagging_child_does_not_hold_up_its_siblings(tmp_path: Path) -> None:
    """A child that drains slowly falls behind its siblings, is told end(lagging) and pulls the
    rest; its siblings finish at their own pace."""
    learner = Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 40 * CHUNK)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=20.0, max_lag_chunks=6)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        fast = nodes_for(tmp_path, 2)
        ident = Identity.generate()
        slow = Node(ident.peer_id_str, ident, SlowStore(tmp_path / "slow", delay=0.1))
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, slow, *fast], keys, cfg)
            plan = plan_tree(src.name, 3.0, {n.name: 0.0 for n in [slow, *fast]})
            assert plan.fanout(src.name) == 3  # a star: the three are siblings
            for n in [slow, *fast]:
                await n.relay.start(env, route_for(plan, n.name, addrs, JOB, 1))
            t0 = trio.current_time()
            pushing = await src.relay.start(env, route_for(plan, src.name, addrs, JOB, 1))
            for n in fast:
                t = await n.relay.wait(JOB, 1, timeout=20)
                assert t.payload(n.store) == payload and t.stats.chunks_pulled == 0
            fast_done = trio.current_time() - t0
            # 40 chunks at 0.1 s each would take the slow child 4 s on its own.
            assert fast_done < 2.0
            t = await slow.relay.wait(JOB, 1, timeout=30)
            assert t.payload(slow.store) == payload
            assert pushing.child_state[(0, slow.name)] == "lagging"
            assert t.stats.chunks_pulled > 0 and not slow.reports
            nursery.cancel_scope.cancel()

    run(body)


def test_silent_parent_is_reported_and_pulled_around(tmp_path: Path) -> None:
    """A parent that sends two chunks and then nothing (no keep-alives) is reported as stalled
    after stall_timeout_s and the rest is pulled from the origin."""
    learner = Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 600_000)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=1.5)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        child = nodes_for(tmp_path, 1)[0]
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, child], keys, cfg)
            plan = plan_tree(src.name, 1.0, {child.name: 1.0})
            await src.relay.start(env, b.Route(job_id=JOB, version=1, stripes=1, children=[[]]))
            await child.relay.start(env, route_for(plan, child.name, addrs, JOB, 1))
            async with open_host(Identity.generate(), pubsub=False) as liar:
                await liar.connect(addrs[child.name][0])
                stream = await liar.libp2p.new_stream(child.host.peer_id, [b.PROTO_PUSH])
                hello = b.PushHello(job_id=JOB, version=1, stripe=0, stripes=1, manifest=env)
                await stream.write(encode_frame(b.encode(hello), b.MAX_HELLO_BYTES))
                for i in range(2):
                    hdr = b.PushHeader(op="chunk", job_id=JOB, version=1, index=i)
                    data = src_store.get(man.chunks[i].sha256)
                    await stream.write(encode_frame(b.encode(hdr), b.MAX_HEADER_BYTES)
                                       + encode_frame(data, len(data)))
                t0 = trio.current_time()
                t = await child.relay.wait(JOB, 1, timeout=20)
                assert trio.current_time() - t0 >= cfg.stall_timeout_s
            assert t.payload(child.store) == payload
            assert t.stats.pushed_in_bytes == man.chunks[0].size + man.chunks[1].size
            assert t.stats.chunks_pulled == len(man.chunks) - 2
            assert [(r.peer_id, r.reason) for r in child.reports] == [
                (liar.peer_id.to_base58(), "stalled")
            ]
            nursery.cancel_scope.cancel()

    run(body)


def test_forged_manifest_and_unknown_job_are_refused(tmp_path: Path) -> None:
    learner, other = Identity.generate(), Identity.generate()
    _, man, env, src_store = make_version(tmp_path, learner, 100_000)
    forged = signing.seal_record(other.private_key, man)
    keys = {JOB: learner.public_key_bytes}

    async def body() -> None:
        node = nodes_for(tmp_path, 1)[0]
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [node], keys, RelayConfig())
            plan = plan_tree(learner.peer_id_str, 1.0, {node.name: 1.0})
            route = route_for(plan, node.name, addrs, JOB, 1)
            with pytest.raises(ManifestError):
                await node.relay.start(forged, route)
            with pytest.raises(ManifestError):
                await node.relay.start(env, route.model_copy(update={"job_id": "other-job"}))
            with pytest.raises(ManifestError):
                await node.relay.start(env, route.model_copy(update={"version": 2}))
            with pytest.raises(BroadcastTimeout):
                await node.relay.wait(JOB, 1, timeout=0.2)
            nursery.cancel_scope.cancel()

    run(body)


def test_join_plan_takes_this_hosts_place_in_a_sealed_plan(tmp_path: Path) -> None:
    """join_plan opens the coordinator's sealed plan and starts the transfer where the plan
    reaches this host; it ignores another job's plan and refuses one the coordinator did not
    sign."""
    learner, coord, other = Identity.generate(), Identity.generate(), Identity.generate()
    payload, man, env, src_store = make_version(tmp_path, learner, 300_000)
    keys = {JOB: learner.public_key_bytes}

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 2)
        outsider = nodes_for(tmp_path / "outsider", 1)[0]
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes, outsider], keys, RelayConfig())
            plan = plan_tree(src.name, 1.0, {n.name: 1.0 for n in nodes})
            peers = [b.PeerAddr(peer_id=n.name, addrs=addrs[n.name]) for n in [src, *nodes]]
            ann = b.PlanAnnouncement(job_id=JOB, version=1, manifest=env,
                                     plan=plan_record(plan, JOB, 1), peers=peers)
            sealed = signing.seal_record(coord.private_key, ann)
            key = coord.public_key_bytes
            assert await nodes[0].relay.join_plan(sealed, key, job_id="other-job") is None
            assert nodes[0].relay.transfer(JOB, 1) is None
            forged = signing.seal_record(other.private_key, ann)
            with pytest.raises(ProtocolError):
                await nodes[0].relay.join_plan(forged, key, JOB)
            # A host the plan does not reach learns of the version and starts nothing.
            assert await outsider.relay.join_plan(sealed, key, JOB) == ann
            assert outsider.relay.transfer(JOB, 1) is None
            for n in [*nodes, src]:
                assert await n.relay.join_plan(sealed, key) == ann
            for n in nodes:
                t = await n.relay.wait(JOB, 1, timeout=20)
                assert t.payload(n.store) == payload and t.route is not None
            nursery.cancel_scope.cancel()

    run(body)
