"""The scheduler (pure): need, fit, priority and share, cost-aware activation, hysteresis."""

from __future__ import annotations

import random

import pytest

from echo.coordinator.scheduling.assign import (
    NO_NODES,
    SATURATED,
    STARVED,
    UNMEASURED,
    JobDemand,
    NodeSupply,
    SchedulerParams,
    allocate,
    schedule,
)
from echo.coordinator.scheduling.fit import estimate_rate, misfit, model_bytes, param_count
from echo.coordinator.scheduling.measure import JobTerms, learner_busy

P = SchedulerParams(min_stay_s=60.0, min_gain=0.15, headroom=1.1)


def nodes_on(assignment: dict, job: str | None) -> set[str]:
    return {n for n, j in assignment.items() if j == job}


def test_cheapest_nodes_per_unit_of_throughput_first_and_the_rest_stand_by() -> None:
    job = JobDemand("a", need_rps=10.0)
    nodes = [
        NodeSupply("fast-cheap", {"a": 10.0}, cost=1.0),  # 0.1 per rollout/s
        NodeSupply("slow-cheap", {"a": 5.0}, cost=1.0),  # 0.2
        NodeSupply("slow-dear", {"a": 5.0}, cost=4.0),  # 0.8
    ]
    d = schedule([job], nodes, now=0.0, params=P)
    # 10 < 11 (need with headroom 1.1): a second node, the cheaper per rollout/s; then met.
    assert nodes_on(d.assignment, "a") == {"fast-cheap", "slow-cheap"}
    assert d.assignment["slow-dear"] is None
    assert d.jobs["a"].state == SATURATED and d.jobs["a"].have_rps == 15.0


def test_an_unmeasured_job_takes_every_node_that_fits_it() -> None:
    nodes = [NodeSupply(f"n{i}", {"a": 1.0}) for i in range(3)]
    d = schedule([JobDemand("a", None)], nodes, now=0.0, params=P)
    assert nodes_on(d.assignment, "a") == {"n0", "n1", "n2"}
    assert d.jobs["a"].state == UNMEASURED


def test_two_new_jobs_share_two_nodes_one_each() -> None:
    jobs = [JobDemand("a", None, created_at=1.0), JobDemand("b", None, created_at=2.0)]
    nodes = [NodeSupply("n0", {"a": 1.0, "b": 1.0}), NodeSupply("n1", {"a": 1.0, "b": 1.0})]
    d = schedule(jobs, nodes, now=0.0, params=P)
    assert len(nodes_on(d.assignment, "a")) == 1 and len(nodes_on(d.assignment, "b")) == 1


def test_priority_meets_the_higher_job_first_but_every_job_gets_a_node() -> None:
    jobs = [JobDemand("low", 1.0, priority=0), JobDemand("high", 12.0, priority=5)]
    nodes = [NodeSupply(f"n{i}", {"low": 5.0, "high": 5.0}) for i in range(4)]
    d = schedule(jobs, nodes, now=0.0, params=P)
    assert len(nodes_on(d.assignment, "low")) == 1
    assert len(nodes_on(d.assignment, "high")) == 3
    assert d.jobs["high"].state == SATURATED  # 15 >= 12 (the state uses the need itself)


def test_equal_priorities_fill_the_job_furthest_from_its_need() -> None:
    jobs = [JobDemand("a", 10.0, created_at=1.0), JobDemand("b", 50.0, created_at=2.0)]
    nodes = [NodeSupply(f"n{i}", {"a": 10.0, "b": 10.0}) for i in range(5)]
    d = schedule(jobs, nodes, now=0.0, params=P)
    # One each; then b (10 of a target of 55) is further from its need than a (10 of 11):
    # b takes the other three, and is still short.
    assert len(nodes_on(d.assignment, "a")) == 1 and len(nodes_on(d.assignment, "b")) == 4
    assert d.jobs["a"].state == SATURATED and d.jobs["b"].state == STARVED


def test_max_share_caps_a_job_and_fit_is_respected() -> None:
    jobs = [JobDemand("a", None, max_share=0.5), JobDemand("big", None)]
    nodes = [NodeSupply(f"n{i}", {"a": 1.0}) for i in range(4)]  # "big" fits none of them
    d = schedule(jobs, nodes, now=0.0, params=P)
    assert len(nodes_on(d.assignment, "a")) == 2  # half of 4 nodes
    assert not nodes_on(d.assignment, "big") and d.jobs["big"].state == NO_NODES
    assert len(nodes_on(d.assignment, None)) == 2


def test_a_working_node_stays_its_minimum_time_then_moves_for_a_clear_gain() -> None:
    # n0 and n1 both serve "a" (need 5, met by one); "b" arrives, needing 5 too.
    jobs = [JobDemand("a", 5.0, created_at=1.0), JobDemand("b", 5.0, created_at=2.0)]
    nodes = [
        NodeSupply("n0", {"a": 6.0, "b": 6.0}, job="a", since=100.0),
        NodeSupply("n1", {"a": 6.0, "b": 6.0}, job="a", since=100.0),
    ]
    early = schedule(jobs, nodes, now=130.0, params=P)
    assert early.moves == [] and nodes_on(early.assignment, "a") == {"n0", "n1"}
    late = schedule(jobs, nodes, now=161.0, params=P)
    assert len(late.moves) == 1 and late.moves[0].dst == "b"
    assert len(nodes_on(late.assignment, "a")) == 1 and len(nodes_on(late.assignment, "b")) == 1


def test_small_gains_do_not_move_nodes() -> None:
    # a holds 2 nodes (10 of need 12: 76% of its target), b holds 1 (5 of need 6: 76%).
    # Moving a node either way helps one as much as it hurts the other: nobody moves.
    jobs = [JobDemand("a", 12.0), JobDemand("b", 6.0)]
    nodes = [
        NodeSupply("n0", {"a": 5.0, "b": 5.0}, job="a"),
        NodeSupply("n1", {"a": 5.0, "b": 5.0}, job="a"),
        NodeSupply("n2", {"a": 5.0, "b": 5.0}, job="b"),
    ]
    assert schedule(jobs, nodes, now=1e6, params=P).moves == []


def test_no_bouncing_under_noisy_measurements() -> None:
    """Rates and needs jitter by 10% every pass (as measurements do): after the first pass
    places the nodes, no node moves again."""
    rng = random.Random(0)
    jobs0 = [JobDemand("a", 20.0, created_at=1.0), JobDemand("b", 30.0, created_at=2.0)]
    speeds = {f"n{i}": 4.0 + i for i in range(8)}
    where: dict[str, str | None] = {n: None for n in speeds}
    since = dict.fromkeys(speeds, 0.0)
    moves_after_first = 0
    for step in range(200):
        now = 10.0 * step
        jit = lambda x: x * rng.uniform(0.9, 1.1)  # noqa: E731
        jobs = [JobDemand(j.job_id, jit(j.need_rps), created_at=j.created_at) for j in jobs0]
        nodes = [
            NodeSupply(n, {"a": jit(s), "b": jit(s)}, job=where[n], since=since[n])
            for n, s in speeds.items()
        ]
        d = schedule(jobs, nodes, now, P)
        if step:
            moves_after_first += len(d.moves)
        for mv in d.moves:
            where[mv.node_id], since[mv.node_id] = mv.dst, now
    assert moves_after_first == 0


def test_a_node_whose_job_ended_moves_at_once_and_a_surplus_node_stands_by() -> None:
    jobs = [JobDemand("b", 3.0)]
    nodes = [
        NodeSupply("n0", {"b": 5.0}, job="gone", since=999.0),  # its job ended just now
        NodeSupply("n1", {"b": 5.0}, job="b", since=0.0),
    ]
    d = schedule(jobs, nodes, now=1000.0, params=P)
    # n1 alone meets b (5 >= 3.3): n0 goes to standby at once, without waiting min_stay.
    assert d.assignment == {"n0": None, "n1": "b"}
    # ... and a node b does not need goes to standby after its minimum stay (cost saved), when
    # the rest stay clear of the target (5 >= 3.3 x 1.15).
    nodes = [NodeSupply("n0", {"b": 5.0}, job="b", since=0.0), nodes[1]]
    d = schedule(jobs, nodes, now=1000.0, params=P)
    assert sorted(d.assignment.values(), key=str) == [None, "b"]
    assert [m.dst for m in d.moves] == [None]


def test_a_job_without_a_node_takes_one_from_a_job_with_two() -> None:
    jobs = [JobDemand("a", None, created_at=1.0), JobDemand("b", None, created_at=2.0)]
    nodes = [
        NodeSupply("n0", {"a": 1.0, "b": 1.0}, job="a", since=0.0),
        NodeSupply("n1", {"a": 1.0, "b": 1.0}, job="a", since=0.0),
    ]
    d = schedule(jobs, nodes, now=1000.0, params=P)
    assert len(d.moves) == 1 and d.moves[0].dst == "b" and "no node" in d.moves[0].why


def test_allocate_ignores_the_current_placement_except_to_break_ties() -> None:
    jobs = [JobDemand("a", 1.0)]
    nodes = [NodeSupply("n0", {"a": 5.0}), NodeSupply("n1", {"a": 5.0}, job="a")]
    assert allocate(jobs, nodes, P) == {"n0": None, "n1": "a"}


def test_param_count_matches_the_built_tiny_model() -> None:
    from echo.models.spec import ModelSpec, build_model

    for spec in (
        {"kind": "tiny", "hidden": 64, "layers": 2, "heads": 4},
        {"kind": "tiny", "hidden": 128, "layers": 3, "heads": 4, "kv_heads": 2},
    ):
        model = build_model(ModelSpec.from_dict(spec))
        assert param_count(spec) == sum(p.numel() for p in model.parameters()), spec


def test_fit_by_memory_and_engine() -> None:
    tiny = {"kind": "tiny", "hidden": 64, "layers": 2, "heads": 4}
    big = {"kind": "tiny", "hidden": 4096, "layers": 32, "heads": 32}
    small_ram = {"ram_bytes": 4 << 30}
    assert misfit(tiny, "float32", small_ram, "torch") is None
    assert model_bytes(big, "bfloat16") > 4 << 30
    assert "GB" in (misfit(big, "bfloat16", small_ram, "torch") or "")
    # A GPU's memory counts for vLLM on a GPU, RAM otherwise.
    gpu = {"ram_bytes": 4 << 30, "vram_bytes": 80 << 30, "gpu": "H100"}
    assert misfit(big, "bfloat16", gpu, "vllm") is None
    # vLLM on a CPU cannot run a head size under 32 (the demo's 4 heads of 16).
    assert "head size" in (misfit(tiny, "float32", {"ram_bytes": 8 << 30}, "vllm") or "")
    assert misfit({**tiny, "heads": 2}, "float32", {"ram_bytes": 8 << 30}, "vllm") is None


def test_estimated_rates_scale_with_model_size() -> None:
    sizes = {"small": 1_000, "large": 4_000}
    tpr = {"small": 4.0, "large": 8.0}
    # Measured on the job: tokens/s over tokens per rollout.
    assert estimate_rate({"small": 400.0}, sizes, tpr, "small", 0.0) == 100.0
    # Measured on another job only: scaled by the sizes (4x the parameters: 1/4 the tokens/s).
    assert estimate_rate({"small": 400.0}, sizes, tpr, "large", 0.0) == pytest.approx(12.5)
    assert estimate_rate({}, sizes, tpr, "large", 80.0) == 10.0
    assert estimate_rate({}, sizes, tpr, "large", 0.0) is None


def test_measured_terms_and_utilization() -> None:
    t = JobTerms(R=128, t_train_s=1.0, t_bcast_s=0.5, kappa=1, tokens_per_rollout=4.0, busy=None)
    assert t.need_rps == pytest.approx(256.0)  # kappa R / (kappa T_train - T_bcast)
    assert JobTerms(128, 0.0, 0.0, 1, 4.0, None).need_rps is None  # not measured yet
    assert JobTerms(128, 1.0, 2.0, 1, 4.0, None).need_rps is None  # broadcast too slow
    # Versions every 2 s, each 1 s of learner time: busy half the time.
    assert learner_busy([(0.0, 0.0), (2.0, 1.0), (4.0, 1.0)]) == pytest.approx(0.5)
    assert learner_busy([(0.0, 1.0)]) is None


def test_a_job_keeps_its_last_node_unless_a_higher_priority_job_needs_it() -> None:
    # b is measured and far from its need; a's only node would help b more than it helps a,
    # but moving it would leave a with nothing: it stays (the swap that caused bouncing).
    jobs = [JobDemand("a", None, created_at=1.0), JobDemand("b", 100.0, created_at=2.0)]
    nodes = [
        NodeSupply("n0", {"a": 1.0, "b": 20.0}, job="a", since=0.0),
        NodeSupply("n1", {"a": 20.0, "b": 1.0}, job="b", since=0.0),
    ]
    assert schedule(jobs, nodes, now=1e6, params=P).moves == []
    urgent = [JobDemand("a", None, created_at=1.0), JobDemand("b", 100.0, priority=1)]
    moves = schedule(urgent, nodes, now=1e6, params=P).moves
    assert [(mv.node_id, mv.dst) for mv in moves] == [("n0", "b")]
