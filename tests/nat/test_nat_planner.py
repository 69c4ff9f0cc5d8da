"""Planning with reachability: a node no dial-back reached is announced without addresses,
receives by push over the connection it opens to its parents, and relays to the peers it can
reach -- dialable ones, and others behind NAT over a punched path."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from echo.coordinator.dissemination.planning import Dissemination
from echo.p2p.identity import Identity
from echo.p2p.relay import RelayConfig
from echo.protocol import signing
from tests.p2p.test_broadcast import JOB, Node, make_version, nodes_for, run, start_swarm

MB = 1_000_000


def _diss(nodes: dict[str, float], addrs: dict[str, list[str]] | None = None) -> Dissemination:
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for name, up in nodes.items():
        d.relays.registered(name, (addrs or {}).get(name, [f"/ip4/10.0.0.1/tcp/1/p2p/{name}"]), up)
        d.relays.measured(name, up)
        d.relays.confirm(name, ("job", -1), up)  # as its receivers would (Receipts.delivered)
    return d


def _parents(ann) -> set[str]:
    return {e.parent for s in ann.plan.stripes for e in s if e.children}


def _edges(ann) -> set[tuple[str, str]]:
    return {(e.parent, c) for s in ann.plan.stripes for e in s for c in e.children}


def test_unreachable_nodes_relay_to_dialable_peers_and_have_no_addresses() -> None:
    # The unreachable ones are the fastest: they relay, but never to each other (no path).
    ups = {f"n{i}": (20 if i < 3 else 1) * MB for i in range(10)}
    hidden = {"n0", "n1", "n2"}
    d = _diss(ups)
    assert sorted(n for n, _ in d.relays.unprobed()) == sorted(ups)
    for i in range(10):
        d.relays.set_reachable(f"n{i}", i >= 3, verdict="public", observed_ip="10.0.0.1")
    assert d.relays.unprobed() == []
    for _ in range(2):  # the quick plan, then the full re-plan patched
        ann = d.plan("job", 1, b"m", 64 * MB, source="L", source_addrs=[], nodes=list(ups))
        assert ann is not None
        assert _parents(ann) & hidden
        assert not {(p, c) for p, c in _edges(ann) if p in hidden and c in hidden}
        for s in ann.plan.stripes:  # everyone still reached once per stripe
            assert sorted(c for e in s for c in e.children) == sorted(ups)
        by_peer = {p.peer_id: p.addrs for p in ann.peers}
        assert by_peer["n0"] == [] and by_peer["n5"] != []
        d.refresh("job")
    # New addresses (it moved, or forwarded a port): judged afresh, announced without addresses
    # meanwhile (issue 26: nodes not yet probed are not dialable).
    d.relays.registered("n0", ["/ip4/10.0.0.9/tcp/4001/p2p/n0"], 20 * MB)
    assert [n for n, _ in d.relays.unprobed()] == ["n0"]
    assert d.relays.upload_of("n0") == 20 * MB
    ann = d.plan("job", 2, b"m", 64 * MB, source="L", source_addrs=[], nodes=list(ups))
    assert ann is not None and {p.peer_id: p.addrs for p in ann.peers}["n0"] == []


def test_nodes_without_addresses_receive_and_relay_by_push(tmp_path: Path) -> None:
    """Nobody can dial the two "behind NAT" nodes (no address in the plan). They dial their
    parents when they join the plan and get pushed over those connections; being the fastest,
    they relay too, dialling their (dialable) children. Pulls start only after
    stall_timeout_s (60 s here), so arriving in time means arriving by push."""
    learner, coord = Identity.generate(), Identity.generate()
    payload, _, env, src_store = make_version(tmp_path, learner, 1_000_000)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=60.0)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 5)
        by_name = {n.name: n for n in [src, *nodes]}
        hidden = {nodes[0].name, nodes[1].name}
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes], keys, cfg)
            d = _diss({n.name: (4 if n.name in hidden else 1) * MB for n in nodes}, addrs)
            for n in nodes:
                d.relays.set_reachable(n.name, n.name not in hidden, observed_ip="127.0.0.1")
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
            assert ann is not None
            edges = _edges(ann)
            assert {p for p, _ in edges} & hidden  # a node behind NAT relays
            assert not {(p, c) for p, c in edges if p in hidden and c in hidden}
            sealed = signing.seal_record(coord.private_key, ann)
            for n in [src, *nodes]:
                await n.relay.join_plan(sealed, coord.public_key_bytes, JOB)
            with trio.fail_after(30):
                for n in nodes:
                    t = await n.relay.wait(JOB, 1, timeout=30)
                    assert t.payload(n.store) == payload
            for parent, child in edges:
                if parent in hidden or child in hidden:
                    t = by_name[parent].relay.transfer(JOB, 1)
                    assert t is not None
                    states = {st for (_, c), st in t.child_state.items() if c == child}
                    assert states and states <= {"pushing", "done"}  # a push stream opened
            nursery.cancel_scope.cancel()

    run(body)


# ------------------------------------------------------------------ punched paths (issue 14)


def _nat_diss(routers: dict[str, str], ups: dict[str, float]) -> Dissemination:
    """Nodes named in ``routers`` are behind NAT (their router's public ip); the rest public."""
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for i, (name, up) in enumerate(sorted(ups.items())):
        d.relays.registered(name, [f"/ip4/192.168.{i}.2/tcp/{4001 + i}/p2p/{name}"], up)
        d.relays.measured(name, up)
        if name in routers:
            d.relays.set_reachable(name, False, verdict="nat", observed_ip=routers[name])
        else:
            d.relays.set_reachable(name, True, verdict="public", observed_ip="10.0.0.1")
    return d


def test_punch_pairs_lan_behind_one_router_punch_across_and_one_per_public_endpoint() -> None:
    routers = {"a": "198.51.100.1", "b": "198.51.100.1", "c": "198.51.100.2", "s": "198.51.100.3"}
    d = _nat_diss(routers, {n: 1 * MB for n in [*routers, "p"]})
    seen: dict[frozenset[str], str] = {}
    for _ in range(10):  # book them all as ok, round by round
        pairs = d.relays.punch_pairs()
        if not pairs:
            break
        for p in pairs:
            seen[frozenset((p.a, p.b))] = p.method
            d.relays.set_punched(p, True)
    assert "p" not in {n for k in seen for n in k}  # public nodes are dialled, not punched
    assert seen[frozenset("ab")] == "lan" and seen[frozenset("ac")] == "punch"
    assert len(seen) == 6
    assert d.relays.punch_pairs() == []  # all tried: nothing is asked twice
    assert d.relays.paths_of("c") == {"a", "b", "s"}
    # The punch goes to the router's public ip and the node's listen port.
    d2 = _nat_diss({"a": routers["a"], "c": routers["c"]}, {"a": MB, "c": MB})
    (ac,) = d2.relays.punch_pairs()
    assert (ac.a, ac.b, ac.method) == ("a", "c", "punch")
    assert ac.addrs_for_a == ("/ip4/198.51.100.2/tcp/4002/p2p/c",)
    assert ac.addrs_for_b == ("/ip4/198.51.100.1/tcp/4001/p2p/a",)
    # New addresses: the node's paths are forgotten and it is judged (then paired) afresh.
    d.relays.registered("c", ["/ip4/192.168.9.2/tcp/4009/p2p/c"], 1 * MB)
    assert d.relays.paths_of("c") == set() and d.relays.paths_of("a") == {"b", "s"}


def test_punches_run_side_by_side_up_to_a_few_per_node_and_none_twice() -> None:
    from echo.coordinator.dissemination.punch_pairs import MAX_CONCURRENT_PER_NODE

    routers = {f"n{i}": f"198.51.100.{i}" for i in range(8)}
    d = _nat_diss(routers, {n: MB for n in routers})
    pairs = d.relays.punch_pairs()
    per_node = Counter(n for p in pairs for n in (p.a, p.b))
    assert max(per_node.values()) == MAX_CONCURRENT_PER_NODE
    busy = Counter(per_node)
    flying = {frozenset((p.a, p.b)) for p in pairs}
    assert d.relays.punch_pairs(busy, flying) == []  # everyone at the cap
    busy.subtract(["n0"] * MAX_CONCURRENT_PER_NODE)
    again = d.relays.punch_pairs(busy, flying)
    assert again and all("n0" in (p.a, p.b) for p in again)
    assert not {frozenset((p.a, p.b)) for p in again} & flying


def test_two_behind_one_router_on_one_port_only_the_first_punches() -> None:
    routers = {"a": "198.51.100.1", "b": "198.51.100.1", "c": "198.51.100.2"}
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for n, ip in routers.items():
        d.relays.registered(n, [f"/ip4/192.168.0.{ord(n)}/tcp/4001/p2p/{n}"], 1 * MB)
        d.relays.set_reachable(n, False, verdict="nat", observed_ip=ip)
    pairs = []
    for _ in range(5):
        got = d.relays.punch_pairs()
        pairs += got
        for p in got:
            d.relays.set_punched(p, p.method == "lan")
    assert {(p.a, p.b, p.method) for p in pairs} == {("a", "b", "lan"), ("a", "c", "punch")}


def test_an_outcome_for_old_addresses_is_not_booked() -> None:
    routers = {"a": "198.51.100.1", "c": "198.51.100.2"}
    d = _nat_diss(routers, {"a": MB, "c": MB})
    (pair,) = d.relays.punch_pairs()
    d.relays.registered("c", ["/ip4/192.168.9.2/tcp/4009/p2p/c"], 1 * MB)
    d.relays.set_reachable("c", False, verdict="nat", observed_ip="198.51.100.2")
    d.relays.set_punched(pair, True)
    assert d.relays.paths_of("a") == set()


def test_a_nat_node_relays_over_its_punched_paths() -> None:
    # e0, e1 behind one eim router, e3 behind another, s2 behind a symmetric one (every punch
    # with it fails); three public nodes, slow ones: the home uplinks behind NAT are faster.
    routers = {"e0": "198.51.100.1", "e1": "198.51.100.1", "s2": "198.51.100.2",
               "e3": "198.51.100.3"}
    ups = {n: (4 if n in routers else 0.25) * MB for n in [*routers, "p0", "p1", "p2"]}
    d = _nat_diss(routers, ups)
    for _ in range(10):
        for p in d.relays.punch_pairs():
            d.relays.set_punched(p, "s2" not in (p.a, p.b))
    assert d.relays.paths_of("s2") == set() and d.relays.paths_of("e3") == {"e0", "e1"}
    size = 64 * MB
    for full in (False, True):  # the quick plan, then the full re-plan patched
        ann = d.plan("job", 1, b"m", size, source="L", source_addrs=[], nodes=list(ups))
        assert ann is not None
        relays = _parents(ann) & set(routers)
        assert relays
        across = set()
        for s in ann.plan.stripes:
            assert sorted(c for e in s for c in e.children) == sorted(ups)  # once per stripe
            parent_of = {c: e.parent for e in s for c in e.children}
            assert parent_of["s2"] not in routers  # no path: fed by a dialable parent
            for kid, parent in parent_of.items():
                if parent in routers and kid in routers:  # only over a path they hold
                    assert kid in d.relays.paths_of(parent), (parent, kid)
                    if routers[parent] != routers[kid]:
                        across.add((parent, kid))
        # The full plan sends a stripe over a punched path across two routers (the quick one,
        # a single tree, has the learner feed all four NAT'd nodes here).
        assert across or not full
        by_peer = {p.peer_id: p.addrs for p in ann.peers}
        assert all(by_peer[r] == [] for r in relays)  # still announced without addresses
        d.refresh("job")
    # A punched path that is gone (new addresses): no edge between two NAT'd nodes is left,
    # in the patched plan and in the full re-plan.
    for i, n in enumerate(("e0", "e1", "e3")):
        d.relays.registered(n, [f"/ip4/192.168.9.{i + 2}/tcp/{4009 + i}/p2p/{n}"], 4 * MB)
        d.relays.set_reachable(n, False, verdict="nat", observed_ip=routers[n])
    for _ in range(2):
        ann = d.plan("job", 2, b"m", size, source="L", source_addrs=[], nodes=list(ups))
        assert ann is not None
        assert not {(p, c) for p, c in _edges(ann) if p in routers and c in routers}
        d.refresh("job")


def test_a_nat_relay_pushes_over_the_punched_connection(tmp_path: Path) -> None:
    """Three "behind NAT" nodes announced without addresses; two of them hold a direct
    connection (here dialled on loopback, standing in for a punched one) and the plan makes one
    the other's relay. The child gets the version pushed by its NAT'd parent over that
    connection: no address of either is announced, pulls start only after 60 s."""
    learner, coord = Identity.generate(), Identity.generate()
    payload, _, env, src_store = make_version(tmp_path, learner, 1_000_000)
    keys = {JOB: learner.public_key_bytes}
    cfg = RelayConfig(stall_timeout_s=60.0)

    async def body() -> None:
        src = Node(learner.peer_id_str, learner, src_store)
        nodes = nodes_for(tmp_path, 5)
        by_name = {n.name: n for n in [src, *nodes]}
        async with trio.open_nursery() as nursery:
            addrs = await start_swarm(nursery, [src, *nodes], keys, cfg)
            hidden = [nodes[0].name, nodes[1].name, nodes[2].name]
            # Home uplinks faster than the public nodes': a NAT'd relay shortens the plan (the
            # planner uses punched paths only where they do).
            d = _diss({n.name: (4 if n.name in hidden else 0.25) * MB for n in nodes}, addrs)
            for i, n in enumerate(nodes):
                if n.name in hidden:
                    d.relays.set_reachable(
                        n.name, False, verdict="nat", observed_ip=f"198.51.100.{i}"
                    )
                else:
                    d.relays.set_reachable(n.name, True, verdict="public", observed_ip="127.0.0.1")
            pairs = d.relays.punch_pairs()
            assert len(pairs) == 3 and {p.method for p in pairs} == {"punch"}  # three routers
            (pair,) = [p for p in pairs if {p.a, p.b} == set(hidden[:2])]
            # The "punch": a direct connection between the pair, then both ends say ok.
            a, b_ = by_name[pair.a], by_name[pair.b]
            await a.host.connect(addrs[b_.name][0])
            d.relays.set_punched(pair, True)
            ann = d.plan(JOB, 1, env, len(payload), chunk_bytes=64 * 1024, source=src.name,
                         source_addrs=addrs[src.name], nodes=[n.name for n in nodes])
            assert ann is not None
            edges = {(e.parent, c) for s in ann.plan.stripes for e in s for c in e.children}
            relay, child = (a, b_) if (a.name, b_.name) in edges else (b_, a)
            assert (relay.name, child.name) in edges
            assert {p.peer_id: p.addrs for p in ann.peers}[relay.name] == []
            sealed = signing.seal_record(coord.private_key, ann)
            for n in [src, *nodes]:
                await n.relay.join_plan(sealed, coord.public_key_bytes, JOB)
            with trio.fail_after(30):
                for n in nodes:
                    t = await n.relay.wait(JOB, 1, timeout=30)
                    assert t.payload(n.store) == payload
            t = relay.relay.transfer(JOB, 1)
            assert t is not None
            states = {st for (_, c), st in t.child_state.items() if c == child.name}
            assert states and states <= {"pushing", "done"}, states  # a push stream opened
            got = child.relay.transfer(JOB, 1)
            assert got is not None
            assert sum(f.received for f in got.feeds if f.peer == relay.name) == got.n
            nursery.cancel_scope.cancel()

    run(body)
