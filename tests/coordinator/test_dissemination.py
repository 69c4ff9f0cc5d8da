"""The coordinator's side of the relay broadcast: plans from registered nodes' addresses and
uplinks, bad-relay reports demoting a peer to a leaf, and the signed plan the learner gets back."""

from __future__ import annotations

import time

import pytest
import trio

from echo.coordinator.dissemination.planner import best as tree
from echo.coordinator.dissemination.planning import Dissemination
from echo.p2p.identity import Identity
from echo.p2p.relay import routes
from echo.p2p.rpc import RemoteError
from echo.protocol import broadcast as b
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.limits import MAX_CHUNK_BYTES
from tests.conftest import learner_publish_v0, run_with_coordinator, submit_job

MB = 1_000_000


def _diss(**ups: float) -> Dissemination:
    """Nodes registered and dial-back verified, each on a /24 of its own."""
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for i, (name, up) in enumerate(ups.items()):
        ip = f"10.{i // 250}.{i % 250}.1"
        d.relays.registered(name, [f"/ip4/{ip}/tcp/1/p2p/{name}"], up)
        d.relays.set_reachable(name, True, verdict="public", observed_ip=ip)
    return d


def _measured(d: Dissemination, node: str, bps: float) -> None:
    """An uplink measured by the node and confirmed by its receivers (Receipts.delivered)."""
    d.relays.measured(node, bps)
    d.relays.confirm(node, ("job", -1), bps)


def _plan(d: Dissemination, nodes, total=64 * MB) -> b.PlanAnnouncement:
    ann = d.plan("job", 3, b"manifest", total, source="L", source_addrs=["/ip4/1/tcp/1/p2p/L"],
                 nodes=nodes)
    assert ann is not None
    return ann


def _edges(ann: b.PlanAnnouncement) -> list[dict[str, list[str]]]:
    return [{e.parent: list(e.children) for e in s} for s in ann.plan.stripes]


def _reaches_everyone_once(ann: b.PlanAnnouncement, nodes) -> None:
    for stripe in _edges(ann):
        reached = [c for kids in stripe.values() for c in kids]
        assert sorted(reached) == sorted(nodes)  # everyone exactly once per stripe


def test_plan_reaches_every_node_once_per_stripe_fast_uploaders_inside() -> None:
    ups = {f"n{i}": (10 if i < 3 else 1) * MB for i in range(12)}
    d = _diss(**ups)
    for n in ("n0", "n1", "n2"):
        _measured(d, n, 10 * MB)
    first = _plan(d, list(ups))  # the quick plan: one equal-rate tree
    assert d.refresh("job") and not d.refresh("job")  # a full re-plan was due, once
    full = _plan(d, list(ups))  # patched from the full plan, nothing changed
    assert not d.refresh("job")
    want = tree.best_plan("L", 2 * MB, ups, total_bytes=64 * MB, chunk_bytes=MAX_CHUNK_BYTES)
    assert _edges(full) == [{p: list(c) for p, c in s.children.items()} for s in want.stripes]
    for ann in (first, full):
        assert ann.plan.source == "L" and ann.version == 3
        assert {p.peer_id for p in ann.peers} == {"L", *ups}
        _reaches_everyone_once(ann, ups)
        parents = {p for stripe in _edges(ann) for p, kids in stripe.items() if kids} - {"L"}
        assert parents and parents <= {"n0", "n1", "n2"}  # only fast uploaders forward


def test_measured_rate_replaces_the_declared_one_and_unknown_nodes_are_left_out() -> None:
    d = _diss(a=5 * MB, b=5 * MB)
    # Nothing measured yet: declared counts up to the default.
    assert d.relays.upload_of("b") == 1 * MB
    _measured(d, "a", 3 * MB)
    # A node's own receivers ...
    assert d.relays.upload_of("a") == 3 * MB and d.relays.upload_of("b") == 1 * MB
    d.relays.measured("a", 4 * MB)  # smoothed
    assert d.relays.upload_of("a") == 3 * MB  # ... and its own word only up to what they confirmed
    d.relays.confirm("a", ("job", 0), 4 * MB)
    assert 3 * MB < d.relays.upload_of("a") < 4 * MB
    ann = _plan(d, ["a", "b", "stranger"])  # no registration, no address: not planned
    assert {p.peer_id for p in ann.peers} == {"L", "a", "b"}
    assert d.plan("job", 1, b"", 1, source="L", source_addrs=[], nodes=["stranger"]) is None


def test_a_claimed_uplink_does_not_buy_a_place_near_the_root() -> None:
    ups = {f"n{i}": 10 * MB for i in range(6)}
    d = _diss(**ups, liar=1000 * MB)
    for n in ups:
        _measured(d, n, 10 * MB)
    d.relays.measured("liar", 1e15)  # its own status report: never confirmed by a receiver
    d.plan("job", 1, b"m", 64 * MB, source="L", source_addrs=[], nodes=[*ups, "liar"])
    d.refresh("job")
    ann = _plan(d, [*ups, "liar"])
    assert d.relays.upload_of("liar") == 1 * MB  # the default, as for anyone unconfirmed
    parents = {p for s in _edges(ann) for p, kids in s.items() if kids} - {"L"}
    assert "liar" not in parents or len(parents) > 1  # one of equals, never the only relay


def test_a_relay_reported_for_bad_chunks_by_three_nodes_becomes_a_leaf() -> None:
    ups = {f"n{i}": 10 * MB for i in range(8)}
    d = _diss(**ups)
    for n in ups:
        _measured(d, n, 10 * MB)
    before = {p for s in _edges(_plan(d, list(ups))) for p, kids in s.items() if kids}
    victim = sorted(before - {"L"})[0]
    report = b.BadPeerReport(job_id="job", version=3, peer_id=victim, reason="bad_chunk",
                             chunk_index=0)
    for _ in range(5):  # one identity, however often it reports, cannot demote a relay
        d.reported("n7", report)
    d.reported("n6", report)
    assert d.relays.upload_of(victim) == 10 * MB
    d.reported("n5", report)  # the third distinct reporter
    assert d.relays.upload_of(victim) == 0.0
    after = _plan(d, list(ups))
    for stripe in _edges(after):
        assert not stripe.get(victim)  # receives, never forwards
        assert victim in [c for kids in stripe.values() for c in kids]
    # A stall is not proof of anything: it does not count.
    for r in ("n5", "n6", "n7"):
        d.reported(r, b.BadPeerReport(job_id="job", version=3, peer_id="n1", reason="stalled"))
    assert d.relays.upload_of("n1") == 10 * MB


def test_versions_patch_the_last_plan_for_joins_and_leaves_and_refresh_replans() -> None:
    ups = {f"n{i:04d}": (5 + i % 7) * MB for i in range(1000)}
    d = _diss(**ups)
    for n, up in ups.items():
        _measured(d, n, up)
    names = list(ups)
    _plan(d, names)
    assert d.refresh("job")  # the background task's work: a full best_plan
    full = _edges(_plan(d, names))
    # 30 nodes leave (relays among them, surely) and 20 new ones join.
    left = set(names[::33][:30])
    new = {f"new{i}": 3 * MB for i in range(20)}
    for n, up in new.items():
        d.relays.registered(n, [f"/ip4/10.0.0.2/tcp/1/p2p/{n}"], up)
        d.relays.set_reachable(n, True, verdict="public", observed_ip="10.0.0.2")
    members = [n for n in names if n not in left] + list(new)
    patched = _plan(d, members)
    _reaches_everyone_once(patched, members)
    # A patch moves only the orphans of the nodes that left: everyone else keeps their parent.
    for before, after in zip(full, _edges(patched), strict=True):
        parent_before = {c: p for p, kids in before.items() for c in kids}
        parent_after = {c: p for p, kids in after.items() for c in kids}
        kept = [c for c in members if c in parent_before and parent_before[c] not in left]
        assert kept and all(parent_after[c] == parent_before[c] for c in kept)
        assert all(parent_after[c] not in left for c in members)
    assert {p.peer_id for p in patched.peers} == {"L", *members}
    assert d.refresh("job")  # the change made a full re-plan due
    again = _plan(d, members)
    _reaches_everyone_once(again, members)
    assert not d.refresh("job")  # nothing changed since the full plan


def test_route_from_the_wire_record_matches_the_planner_route() -> None:
    ups = {f"n{i}": (i + 1) * MB for i in range(10)}
    plan = tree.best_plan("L", 4 * MB, ups, total_bytes=64 * MB, chunk_bytes=4 * MB)
    rec = tree.plan_record(plan, "job", 7)
    addrs = {n: [f"/ip4/10.0.0.{i}/tcp/1/p2p/{n}"] for i, n in enumerate(["L", *ups])}
    for node in ["L", *ups]:
        want = tree.route_for(plan, node, addrs, "job", 7)
        got = routes.route_from_record(rec, addrs, node)
        assert got is not None
        assert got.children == want.children and got.origin == want.origin
        assert got.stripes == want.stripes
        assert {p.peer_id for p in got.sources} == {p.peer_id for p in want.sources}
    assert routes.route_from_record(rec, addrs, "outsider") is None


def test_learner_gets_a_signed_plan_and_bad_peer_reports_are_heard(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = submit_job(coord)
        nodes = [await client() for _ in range(4)]
        for i, n in enumerate(nodes):
            await n.register(upload_bps=(4 - i) * MB)
            # Its first accepted group (not what this test is about) queues its dial-back.
            coord.node_rpc.probes.earned(str(n.host.peer_id))
        with trio.fail_after(20):  # plans carry only what the dial-backs verified
            while coord.dissemination.relays.unprobed():
                await trio.sleep(0.1)
        ident, _, report = learner_publish_v0(coord, job_id)
        learner = await client(ident)
        hello = m.LearnerHello(job_id=job_id, peer_id=str(learner.host.peer_id),
                               addrs=learner.host.listen_multiaddrs, timestamp=time.time())
        await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello))
        ack = m.decode(m.StepAck, await learner.call(
            ids.PROTO_LEARNER_REPORT, learner.seal(report)), max_bytes=8 << 20)
        assert ack.ok and ack.plan
        _, ann = signing.open_record(ack.plan, b.PlanAnnouncement, max_bytes=8 << 20,
                                     expected_signer=coord.identity.public_key_bytes)
        node_ids = {str(n.host.peer_id) for n in nodes}
        assert ann.plan.source == str(learner.host.peer_id)
        assert {p.peer_id for p in ann.peers} == node_ids | {ann.plan.source}
        assert all(p.addrs for p in ann.peers)
        route = routes.route_from_announcement(ann, ann.plan.source)
        assert route is not None and any(route.children)
        # Three nodes report the fastest node for a bad chunk: heard, but they have no accepted
        # work and share one network, so it is not demoted
        # (tests/coordinator/hardening/test_hardening_relays.py has the reporters that do demote).
        fastest = str(nodes[0].host.peer_id)
        rep = b.BadPeerReport(job_id=job_id, version=0, peer_id=fastest, reason="bad_chunk")
        for reporter in nodes[1:]:
            reply = m.decode(m.StepAck, await reporter.call(
                ids.PROTO_BAD_PEER, reporter.seal(rep)))
            assert reply.ok
        assert coord.dissemination.relays.upload_of(fastest) > 0.0
        # Reports must come from a registered node, about someone else, signed by the sender.
        stranger = await client(Identity.generate())
        with pytest.raises(RemoteError, match="register first"):
            await stranger.call(ids.PROTO_BAD_PEER, stranger.seal(rep))
        assert coord.dissemination.relays.upload_of(str(nodes[1].host.peer_id)) > 0.0

    run_with_coordinator(tmp_path, body)


def test_leaves_receive_and_relay_to_nobody() -> None:
    """Nodes the coordinator passes as ``leaves`` (no accepted group yet) are reached once per
    stripe like everyone else and are nobody's parent, however fast they say they are."""
    ups = {f"n{i}": 1 * MB for i in range(6)} | {f"fresh{i}": 100 * MB for i in range(4)}
    d = _diss(**ups)
    fresh = [n for n in ups if n.startswith("fresh")]
    ann = d.plan("job", 3, b"m", 64 * MB, source="L", source_addrs=[], nodes=list(ups),
                 leaves=fresh)
    assert ann is not None
    _reaches_everyone_once(ann, list(ups))
    for stripe in _edges(ann):
        assert not set(stripe) & set(fresh), stripe
