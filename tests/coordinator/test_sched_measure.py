"""The scheduler's throughput estimate from delivered work: what the coordinator accepted from a
node, not what the node says it does."""

from __future__ import annotations

import pytest

from echo.coordinator.scheduling.fit import (
    DELIVERY_MIN_GROUPS,
    DELIVERY_WINDOW_S,
    delivered_rate,
    estimate_rate,
)
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job


def test_delivered_rate_counts_the_groups_accepted_in_the_window_of_the_current_stint() -> None:
    # A group of 8 every 4 s since t=100 (the first at 104): 2 completions/s.
    groups = [(100.0 + 4.0 * k, 8) for k in range(1, 40)]
    assert delivered_rate(groups, since=100.0, now=160.0) == pytest.approx(2.0, rel=0.05)
    # Only the last window counts (groups at an earlier, faster pace fall out of it).
    fast_then_slow = [(float(t), 80) for t in range(0, 100, 2)] + groups
    assert delivered_rate(fast_then_slow, since=0.0, now=256.0) == pytest.approx(2.0, rel=0.1)
    # The time before the first group (model download, engine start) is not the node's pace.
    late = [(130.0 + 4.0 * k, 8) for k in range(8)]  # from 130 to 158
    assert delivered_rate(late, since=100.0, now=158.0) == pytest.approx(2.0)
    # Groups from before the node's current stint on the job do not count.
    assert delivered_rate(groups, since=150.0, now=160.0) is None
    # Too few groups, too early: no measure; a whole window with few or none: that is the pace.
    few = groups[: DELIVERY_MIN_GROUPS - 1]
    assert delivered_rate(few, since=100.0, now=few[-1][0]) is None
    one = delivered_rate(few, since=100.0, now=few[-1][0] + DELIVERY_WINDOW_S - 1.0)
    assert one == pytest.approx(8 / DELIVERY_WINDOW_S)
    assert delivered_rate(few, since=100.0, now=few[-1][0] + DELIVERY_WINDOW_S + 1.0) == 0.0
    assert delivered_rate([], since=0.0, now=DELIVERY_WINDOW_S) == 0.0


def test_a_node_is_estimated_at_what_it_delivered_not_at_what_it_reports() -> None:
    sizes = {"a": 1_000, "b": 4_000}
    tpr = {"a": 10.0, "b": 10.0}
    # It reports 1,000 tokens/s (100 rollouts/s) on a and delivered 10 rollouts/s there.
    assert estimate_rate({"a": 1000.0}, sizes, tpr, "a", 0.0, {"a": 10.0}) == 10.0
    # On b, which it has not delivered on, its report is taken at the share it kept on a (1/10).
    assert estimate_rate({"a": 1000.0, "b": 1000.0}, sizes, tpr, "b", 0.0, {"a": 10.0}) == (
        pytest.approx(10.0)
    )
    # No report on b: its report on a scaled by the sizes (1/4), at the share it kept.
    assert estimate_rate({"a": 1000.0}, sizes, tpr, "b", 0.0, {"a": 10.0}) == pytest.approx(2.5)
    # A node that delivers more than it reports is not scaled up by its delivery elsewhere.
    assert estimate_rate({"a": 100.0, "b": 100.0}, sizes, tpr, "b", 0.0, {"a": 50.0}) == 10.0
    # Before any delivery: its report, then its declaration.
    assert estimate_rate({"a": 1000.0}, sizes, tpr, "a", 0.0, {}) == 100.0
    assert estimate_rate({}, sizes, tpr, "a", 500.0, {}) == 50.0
    # Delivery without any report: scaled by the sizes.
    assert estimate_rate({}, sizes, tpr, "b", 0.0, {"a": 8.0}) == pytest.approx(2.0)


def test_a_node_that_reports_ten_times_what_it_delivers_is_planned_at_what_it_delivers(
    tmp_path,
) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client, batch_groups=8)  # room for 5 groups
        node = await client()
        assert (await node.register()).assigned_job == job_id
        node_id = str(node.host.peer_id)
        # Five groups of 4 completions accepted over the submit RPC.
        for _ in range(5):
            lr = await node.leases(job_id, have=0)
            assert lr.leases, lr.message
            lease = open_lease(coord, lr.leases[0])
            reply = await node.submit(node.seal(group_for(lease)))
            assert reply.accepted, reply.reason
        placement = coord.placement
        times = [t for t, _ in placement.nodes[node_id].accepted[job_id]]
        assert len(times) == 5
        # Seen 16 s after its first accepted group: 4 groups x 4 completions after the first,
        # 1 completion/s delivered. It reports ten times that in tokens/s.
        now = times[0] + 16.0
        tpr = coord.store.mean_tokens_per_rollout(job_id)
        assert tpr
        placement.observed(node_id, job_id, 10.0 * tpr, 0)
        decision = placement.refresh(now=now)
        assert decision.assignment[node_id] == job_id
        assert placement.nodes[node_id].delivered[job_id] == pytest.approx(1.0, rel=0.02)
        assert decision.jobs[job_id].have_rps == pytest.approx(1.0, rel=0.02)

    run_with_coordinator(tmp_path, body)
