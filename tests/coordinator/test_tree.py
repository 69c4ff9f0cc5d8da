"""Broadcast planner (echo.coordinator.dissemination.planner.best and its tree_* modules): every
node reached once per stripe, fan-out within upload capacity, fast uploaders nearer the root,
striping using more uplinks, bound and estimate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo.coordinator.dissemination.planner.best import (
    best_plan,
    chain_plan,
    plan_record,
    route_for,
    star_plan,
)
from echo.coordinator.dissemination.planner.equal import plan_tree
from echo.coordinator.dissemination.planner.plan import TreePlan, lower_bound_s
from echo.coordinator.dissemination.planner.weighted import plan_weighted
from echo.p2p.relay.routes import route_from_record
from echo.protocol import broadcast as b

MB = 1e6
SRC = "src"

uplinks = st.dictionaries(
    st.from_regex(r"n[0-9]{1,3}", fullmatch=True),
    st.floats(min_value=0.0, max_value=20 * MB, allow_nan=False),
    min_size=1,
    max_size=40,
)


def check_reaches_everyone_once(plan: TreePlan, nodes) -> None:
    for stripe in plan.stripes:
        children = [c for cs in stripe.children.values() for c in cs]
        assert sorted(children) == sorted(nodes), "every node is a child exactly once"
        assert SRC not in children
        depths = stripe.depths(SRC)  # walks from the source: unreachable nodes would be missing
        assert set(depths) == {SRC, *nodes}


def check_capacity(plan: TreePlan, nodes, source_up: float) -> None:
    rate = plan.stripes[0].rate_bps
    assert all(s.rate_bps == rate for s in plan.stripes)
    for n, up in nodes.items():
        # A node is interior in at most one stripe, and its children fit its uplink at the rate.
        interior = [s for s in plan.stripes if s.children.get(n)]
        assert len(interior) <= 1
        assert plan.fanout(n) * rate <= up * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(nodes=uplinks, source_up=st.floats(min_value=0.1 * MB, max_value=50 * MB),
       stripes=st.integers(min_value=1, max_value=6))
def test_plan_properties(nodes, source_up, stripes) -> None:
    plan = plan_tree(SRC, source_up, nodes, stripes=stripes)
    assert len(plan.stripes) == min(stripes, len(nodes))
    check_reaches_everyone_once(plan, nodes)
    check_capacity(plan, nodes, source_up)
    rate = plan.stripes[0].rate_bps
    src_kids = plan.fanout(SRC)
    assert src_kids * rate <= source_up * (1 + 1e-9) or src_kids <= len(nodes) * len(plan.stripes)
    # Fast uploaders higher: within a stripe, a strictly faster interior candidate is never
    # deeper than a slower one; leaves (no capacity in this stripe) are never above them.
    for stripe in plan.stripes:
        depth = stripe.depths(SRC)
        interior = [n for n in nodes if stripe.children.get(n)]
        for a in interior:
            for c in nodes:
                if nodes[a] > nodes[c] and stripe.children.get(c):
                    assert depth[a] <= depth[c]
    # The estimate never beats the lower bound.
    total, chunk = 64 * MB, 256 * 1024
    bound = lower_bound_s(total, source_up, [math.inf] * len(nodes), list(nodes.values()))
    assert plan.estimate_s(total, chunk) >= bound * (1 - 1e-9)


def test_fast_nodes_near_root_and_fanout_by_capacity() -> None:
    nodes = {"fast": 8 * MB, "mid": 4 * MB, **{f"slow{i}": 0.5 * MB for i in range(10)}}
    plan = plan_tree(SRC, 2 * MB, nodes, rate_bps=1 * MB)
    (stripe,) = plan.stripes
    assert stripe.children[SRC] == ("fast", "mid")
    assert len(stripe.children["fast"]) == 8
    assert len(stripe.children["mid"]) == 2  # the rest; it could take 4
    assert all(f"slow{i}" not in stripe.children for i in range(10))
    depth = stripe.depths(SRC)
    assert depth["fast"] == depth["mid"] == 1
    assert all(depth[f"slow{i}"] == 2 for i in range(10))


def test_highest_feasible_rate_is_chosen() -> None:
    nodes = {f"n{i}": 4 * MB for i in range(8)}
    plan = plan_tree(SRC, 4 * MB, nodes)
    # Equal 4 MB/s uplinks: one child each at the full 4 MB/s (a chain) is the fastest tree.
    assert plan.stripes[0].rate_bps == pytest.approx(4 * MB, rel=1e-6)
    assert plan.depth() == 8
    check_reaches_everyone_once(plan, nodes)
    # Halving the rate target doubles the fan-out: a binary tree of depth 3.
    half = plan_tree(SRC, 4 * MB, nodes, rate_bps=2 * MB)
    assert half.depth() == 3 and half.fanout(SRC) == 2
    # best_plan weighs pipeline fill (depth) against rate: never worse than either, and for a
    # payload of a few chunks it prefers the shallow tree to the chain.
    chunk = 256 * 1024
    for size in (1 * MB, 1000 * MB):
        best = best_plan(SRC, 4 * MB, nodes, total_bytes=int(size), chunk_bytes=chunk)
        t = best.estimate_s(int(size), chunk)
        assert t <= min(plan.estimate_s(int(size), chunk), half.estimate_s(int(size), chunk))
    assert best_plan(SRC, 4 * MB, nodes, total_bytes=int(1 * MB), chunk_bytes=chunk).depth() < 8


def test_striping_uses_more_uplinks_and_approaches_the_bound() -> None:
    ups = [8, 2, 5, 1, 10, 3, 6, 1.5, 4, 2.5, 7, 1, 3.5, 9, 2, 5.5]
    nodes = {f"n{i:02d}": u * MB for i, u in enumerate(ups)}
    total, chunk = 64 * MB, 256 * 1024
    bound = lower_bound_s(total, 10 * MB, [25 * MB] * 16, list(nodes.values()))
    one = plan_tree(SRC, 10 * MB, nodes, stripes=1)
    best = best_plan(SRC, 10 * MB, nodes, total_bytes=int(total), chunk_bytes=chunk)
    uploading = {n for n in nodes if one.fanout(n)}
    uploading_best = {n for n in nodes if best.fanout(n)}
    assert len(best.stripes) > 1
    assert len(uploading_best) > len(uploading)
    assert best.estimate_s(total, chunk) < one.estimate_s(total, chunk)
    assert best.estimate_s(total, chunk) <= 1.2 * bound
    star = star_plan(SRC, 10 * MB, nodes)
    assert star.estimate_s(total, chunk) == pytest.approx(16 * total / (10 * MB), rel=0.01)
    assert star.estimate_s(total, chunk) > 5 * best.estimate_s(total, chunk)


def test_star_and_chain_shapes() -> None:
    nodes = {"a": 1 * MB, "b": 3 * MB, "c": 2 * MB}
    star = star_plan(SRC, 5 * MB, nodes)
    assert star.stripes[0].children == {SRC: ("b", "c", "a")}
    chain = chain_plan(SRC, 5 * MB, nodes)
    assert chain.stripes[0].children == {SRC: ("b",), "b": ("c",), "c": ("a",)}
    assert chain.depth() == 3
    # The chain runs at its slowest forwarding uplink (c, 2 MB/s); a's uplink idles.
    assert chain.estimate_s(20 * MB, MB) == pytest.approx(
        MB / (5 * MB) + MB / (3 * MB) + MB / (2 * MB) + 19 * MB / (2 * MB), rel=1e-6)


def test_lower_bound_terms() -> None:
    assert lower_bound_s(100, 10, [50, 50], [10, 10]) == pytest.approx(10)  # source
    assert lower_bound_s(100, 100, [5, 50], [100, 100]) == pytest.approx(20)  # slowest down
    assert lower_bound_s(100, 10, [1e9] * 4, [2.5] * 4) == pytest.approx(20)  # total upload
    assert lower_bound_s(0, 10, [1], [1]) == 0.0
    assert lower_bound_s(100, 0, [1], [1]) == math.inf


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan_tree(SRC, 1 * MB, {SRC: 1 * MB})
    with pytest.raises(ValueError):
        plan_tree(SRC, 1 * MB, {"a": -1.0})
    with pytest.raises(ValueError):
        plan_tree(SRC, 0.0, {"a": 1.0})
    with pytest.raises(ValueError):
        plan_tree(SRC, 1 * MB, {"a": 1.0}, stripes=0)
    with pytest.raises(ValueError):
        plan_tree(SRC, 1 * MB, {"a": 1.0, "b": 1.0}, rate_bps=10 * MB)  # nobody can take both


def test_routes_and_plan_record() -> None:
    nodes = {f"n{i}": (i + 1) * MB for i in range(6)}
    plan = plan_tree(SRC, 3 * MB, nodes, stripes=2)
    addrs = {n: [f"/ip4/10.0.0.{i}/tcp/1/p2p/{n}"] for i, n in enumerate([SRC, *nodes])}
    for n in [SRC, *nodes]:
        route = route_for(plan, n, addrs, "job", 3)
        again = b.decode(b.Route, b.encode(route))
        assert again == route and route.stripes == 2
        assert [[c.peer_id for c in kids] for kids in route.children] == plan.children_of(n)
        assert n not in {p.peer_id for p in route.sources}
        assert (route.origin is None) == (n == SRC)
        if route.origin is not None:
            assert route.origin.peer_id == SRC and route.origin.addrs == addrs[SRC]
    rec = b.decode(b.BroadcastPlan, b.encode(plan_record(plan, "job", 3)))
    for s, stripe in enumerate(plan.stripes):
        assert {e.parent: tuple(e.children) for e in rec.stripes[s]} == dict(stripe.children)


def test_chunk_size_keeps_the_pipeline_short_and_manifests_small() -> None:
    from echo.p2p.chunkstore import MIN_CHUNK_BYTES, chunk_size_for
    from echo.protocol.limits import MAX_ARRAY_LEN, MAX_CHUNK_BYTES

    assert chunk_size_for(0) == chunk_size_for(3_000_000) == MIN_CHUNK_BYTES
    assert chunk_size_for(16_000_000) == 128 * 1024  # 122 chunks: depth-3 fill is a few %
    assert chunk_size_for(64_000_000) == 128 * 1024
    assert chunk_size_for(256_000_000) == 512 * 1024
    assert chunk_size_for(14_000_000_000) == MAX_CHUNK_BYTES  # a 7B bf16 anchor
    for total in (1, 5_000_000, 100_000_000, 2 * 10**9, 3 * 10**11):
        size = chunk_size_for(total)
        assert size & (size - 1) == 0
        if total <= MAX_CHUNK_BYTES * MAX_ARRAY_LEN:
            assert math.ceil(total / size) <= MAX_ARRAY_LEN
    # For a planned payload the chosen size beats the old fixed 4 MiB on the planner's estimate.
    nodes = {f"n{i:02d}": (1 + i % 10) * MB for i in range(16)}
    for total in (16_000_000, 64_000_000):
        fine = best_plan(SRC, 10 * MB, nodes, total_bytes=total, chunk_bytes=chunk_size_for(total))
        coarse = best_plan(SRC, 10 * MB, nodes, total_bytes=total, chunk_bytes=MAX_CHUNK_BYTES)
        assert (fine.estimate_s(total, chunk_size_for(total))
                < 0.8 * coarse.estimate_s(total, MAX_CHUNK_BYTES))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.lists(st.integers(1, b.MAX_WEIGHT), min_size=1, max_size=12))
def test_stripe_table_splits_every_prefix_by_weight(n, weights) -> None:
    k = len(weights)
    table = b.stripe_table(n, k, weights)
    assert len(table) == n and all(0 <= s < k for s in table)
    assert b.stripe_table(n, k, weights) == table  # every relay computes the same
    counts = [0] * k
    total = sum(weights)
    for i, s in enumerate(table):
        counts[s] += 1
        if i % 97 == 0 or i == n - 1:
            for j in range(k):  # each stripe within k chunks of its share of the prefix
                assert abs(counts[j] - (i + 1) * weights[j] / total) <= k + 1e-9
    if len(set(weights)) == 1:
        assert table == [i % k for i in range(n)]


def test_weights_must_match_the_stripes() -> None:
    with pytest.raises(ValueError, match="2 stripe weights for 3 stripes"):
        b.stripe_table(10, 3, [1, 2])
    bad = {"job_id": "j", "version": 1, "stripes": 3, "children": [[], [], []], "weights": [1, 2]}
    with pytest.raises(Exception, match="stripe weights"):
        b.from_obj(b.Route, bad)
    with pytest.raises(Exception, match="stripe 3 of 3"):
        b.from_obj(b.PushHello, {"job_id": "j", "version": 1, "stripe": 3, "stripes": 3,
                                 "manifest": b""})
    with pytest.raises(Exception, match="greater than or equal to 1"):
        b.from_obj(b.Route, {**bad, "weights": [0, 1, 1]})


def test_weighted_stripes_use_fast_groups_fully() -> None:
    # The broadcast benchmark's first 8 uplinks: with one rate for all stripes the slowest group
    # sets it; per-stripe rates and shares let the others run at theirs.
    ups = [8, 2, 5, 1, 10, 3, 6, 1.5]
    nodes = {f"n{i}": u * 0.2 * MB for i, u in enumerate(ups)}
    total, chunk = 16_000_000, 128 * 1024
    bound = lower_bound_s(total, 2 * MB, [5 * MB] * len(nodes), list(nodes.values()))
    for k in (2, 3, 4):
        equal = plan_tree(SRC, 2 * MB, nodes, stripes=k)
        weighted = plan_weighted(SRC, 2 * MB, nodes, stripes=k)
        assert len(weighted.weights) == k and min(weighted.weights) >= 1
        assert weighted.estimate_s(total, chunk) <= equal.estimate_s(total, chunk) * (1 + 1e-9)
        for stripe in weighted.stripes:  # still a tree to every node
            assert sorted(stripe.parents()) == sorted(nodes)
    best = best_plan(SRC, 2 * MB, nodes, total_bytes=total, chunk_bytes=chunk)
    old = min(plan_tree(SRC, 2 * MB, nodes, stripes=k).estimate_s(total, chunk)
              for k in range(1, 9))
    assert best.weights and best.estimate_s(total, chunk) < 0.97 * old
    assert best.estimate_s(total, chunk) < 1.15 * bound
    # The shares travel with the plan: in every route and in the wire record.
    addrs = {n: [f"/ip4/10.0.0.{i}/tcp/1"] for i, n in enumerate([SRC, *nodes])}
    rec = b.decode(b.BroadcastPlan, b.encode(plan_record(best, "job", 1)))
    assert rec.weights == list(best.weights)
    for n in nodes:
        route = route_for(best, n, addrs, "job", 1)
        assert route.weights == list(best.weights)
        assert route_from_record(rec, addrs, n).weights == route.weights
