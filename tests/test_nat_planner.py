"""Planning with reachability: a node no dial-back reached is a leaf, announced without addresses,
and still receives by push -- over the connection it opens to its parents."""

from __future__ import annotations

from pathlib import Path

import trio

from echo.coordinator.dissemination import Dissemination
from echo.p2p.identity import Identity
from echo.p2p.relay import RelayConfig
from echo.p2p.tree import parents_in
from echo.protocol import signing
from tests.test_broadcast import JOB, Node, make_version, nodes_for, run, start_swarm

MB = 1_000_000


def _diss(nodes: dict[str, float], addrs: dict[str, list[str]] | None = None) -> Dissemination:
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for name, up in nodes.items():
        d.registered(name, (addrs or {}).get(name, [f"/ip4/10.0.0.1/tcp/1/p2p/{name}"]), up)
        d.measured(name, up)
    return d


def _parents(ann) -> set[str]:
    return {e.parent for s in ann.plan.stripes for e in s if e.children}


def test_unreachable_nodes_are_leaves_without_addresses() -> None:
    # The unreachable ones are the fastest: without reachability they would be the relays.
    ups = {f"n{i}": (20 if i < 3 else 1) * MB for i in range(10)}
    d = _diss(ups)
    assert sorted(n for n, _ in d.unprobed()) == sorted(ups)
    for i in range(10):
        d.set_reachable(f"n{i}", i >= 3)
    assert d.unprobed() == []
    for _ in range(2):  # the quick plan, then the full re-plan patched
        ann = d.plan("job", 1, b"m", 64 * MB, source="L", source_addrs=[], nodes=list(ups))
        assert ann is not None
        assert not _parents(ann) & {"n0", "n1", "n2"}
        for s in ann.plan.stripes:  # everyone still reached once per stripe
            assert sorted(c for e in s for c in e.children) == sorted(ups)
        by_peer = {p.peer_id: p.addrs for p in ann.peers}
        assert by_peer["n0"] == [] and by_peer["n5"] != []
        d.refresh("job")
    # New addresses (it moved, or forwarded a port): judged afresh, planned as dialable meanwhile.
    d.registered("n0", ["/ip4/10.0.0.9/tcp/4001/p2p/n0"], 20 * MB)
    assert [n for n, _ in d.unprobed()] == ["n0"]
    assert d.upload_of("n0") == 20 * MB


def test_a_leaf_without_addresses_receives_by_push(tmp_path: Path) -> None:
    """Parents cannot dial the two "behind NAT" nodes (no address in the plan); the nodes dial
    their parents when they join the plan and the pushes go over those connections. Pulls start
    only after stall_timeout_s (60 s here), so arriving in time means arriving by push."""
    learner, coord = Identity.generate(), Identity.generate()
    payload, _, env, src_store = make_version(tmp_path, learner, 1_000_000)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=60.0)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 5)
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes], keys, cfg)
            d = _diss({n.name: 1 * MB for n in nodes}, addrs)
            hidden = {nodes[0].name, nodes[1].name}
            for n in nodes:
                d.set_reachable(n.name, n.name not in hidden)
            ann = d.plan(
                JOB,
                1,
                env,
                len(payload),
                chunk_bytes=64 * 1024,
                source=src.name,
                source_addrs=addrs[src.name],
                nodes=[n.name for n in nodes],
            )
            assert ann is not None and not _parents(ann) & hidden
            sealed = signing.seal_record(coord.private_key, ann)
            for n in [src, *nodes]:
                await n.relay.join_plan(sealed, coord.public_key_bytes, JOB)
            with trio.fail_after(30):
                for n in nodes:
                    t = await n.relay.wait(JOB, 1, timeout=30)
                    assert t.payload(n.store) == payload
            for h in hidden:
                for p in parents_in(ann.plan, h):
                    parent = next(x for x in [src, *nodes] if x.name == p)
                    t = parent.relay.transfer(JOB, 1)
                    assert t is not None
                    states = {st for (_, c), st in t.child_state.items() if c == h}
                    assert states and states <= {"pushing", "done"}  # a push stream opened
            nursery.cancel_scope.cancel()

    run(body)
