"""The coordinator's HTTP API over a real hypercorn server, and the capacity model."""

from __future__ import annotations

import math

import httpx

from echo.coordinator.scheduling.capacity import (
    NodeRate,
    plan,
    recommend_staleness,
    required_throughput,
    staleness_options,
    step_period,
)
from tests.conftest import run_with_coordinator

JOB = b"""
[job]
name = "api-test"
steps = 3
[job.task]
name = "addition"
params = { max_operand = 5 }
"""


def test_job_api_auth_validation_and_lifecycle(tmp_path) -> None:
    async def body(coord, client) -> None:
        base = coord.http_addrs[0]
        auth = {"Authorization": "Bearer test-token"}
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            assert (await http.get("/healthz")).json() == {"ok": True}
            r = await http.get("/v1/jobs")
            assert r.status_code == 401
            r = await http.post("/v1/jobs", content=b"[job]\nname='x'\nstepz=3\n", headers=auth)
            assert r.status_code == 400 and "stepz: unknown key" in r.json()["error"]
            r = await http.post("/v1/jobs", content=b"not toml [", headers=auth)
            assert r.status_code == 400 and "TOML" in r.json()["error"]
            r = await http.post("/v1/jobs", content=JOB, headers=auth)
            assert r.status_code == 201
            job_id = r.json()["job_id"]
            jobs = (await http.get("/v1/jobs", headers=auth)).json()
            assert [j["job_id"] for j in jobs] == [job_id]
            st = (await http.get(f"/v1/jobs/{job_id}", headers=auth)).json()
            assert st["status"] == "pending" and st["current_version"] == -1
            assert st["steps"] == 3 and st["rollouts"]["rejected_total"] == 0
            plan_ = (await http.get(f"/v1/jobs/{job_id}/plan", headers=auth)).json()
            assert plan_["R"] == 16 * 8 and plan_["measured_versions"] == 0
            assert plan_["staleness"] == 2 and len(plan_["staleness_options"]) == 7
            assert plan_["recommended_staleness"] == 2  # nothing measured: the default
            mem = plan_["learner_memory"]  # the tiny model fits any machine these tests run on
            assert mem["fits"] and mem["backend"] == "single" and mem["state_bytes"] > 0
            assert st["learning"]["versions"] == 0 and st["learning"]["eval_last"] is None
            assert (await http.get("/v1/jobs/nope", headers=auth)).status_code == 404
            r = await http.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
            assert r.json() == {"cancelled": True}
            r = await http.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
            assert r.json() == {"cancelled": False}
            assert (await http.get(f"/v1/jobs/{job_id}", headers=auth)).json()["status"] \
                == "cancelled"
            metrics = (await http.get("/metrics")).text
            assert "echo_jobs_submitted_total 1.0" in metrics
            assert "Echo swarm coordinator" in (await http.get("/")).text

    run_with_coordinator(tmp_path, body)


def test_capacity_rule_and_cost_aware_activation() -> None:
    # kappa = S - 1 = 2: need 2 * 256 / (2 * 1.0 - 0.5) = 341.3 rollouts/s.
    assert math.isclose(required_throughput(256, 1.0, 0.5, 2), 2 * 256 / 1.5)
    assert math.isinf(required_throughput(256, 1.0, 3.0, 2))
    nodes = [NodeRate("slow-cheap", 100, 0.1), NodeRate("fast", 300, 1.0),
             NodeRate("pricey", 300, 10.0)]
    p = plan(256, 1.0, 0.5, 3, nodes)
    assert p.feasible and p.kappa == 2
    # Cheapest per unit of throughput first, until the rule holds; the rest on standby.
    assert p.active == ["slow-cheap", "fast"] and p.standby == ["pricey"]
    short = plan(256, 1.0, 0.5, 3, nodes[:1])
    assert not short.feasible and "short by" in short.note
    stuck = plan(256, 1.0, 5.0, 2, nodes)
    assert not stuck.feasible and stuck.to_dict()["required_rollouts_per_s"] is None


def test_staleness_recommendation() -> None:
    # 256 rollouts per step at 512/s: 0.5 s to generate a batch; T_train 1 s, T_bcast 0.2 s.
    assert math.isclose(step_period(256, 1.0, 0.2, 512, 0), 0.2 + 0.5 + 1.0)  # all in series
    assert step_period(256, 1.0, 0.2, 512, 1) == 1.0  # generation hides behind training
    opts = staleness_options(256, 1.0, 0.2, 512)
    assert [o.staleness for o in opts] == list(range(7))
    assert math.isclose(opts[1].speedup_vs_sync, 1.7) and opts[1].learner_busy == 1.0
    s, why = recommend_staleness(opts)
    assert s == 1 and "1.70x" in why  # the least staleness that is as fast as any
    # A slow broadcast (2 s): each version must now serve several steps, kappa = S - 1, until
    # the learner is busy at S = 5; S = 6 would add staleness for nothing.
    slow = staleness_options(256, 1.0, 2.0, 512)
    assert [round(o.period_s, 3) for o in slow] == [3.5, 2.5, 2.5, 1.5, 1.167, 1.0, 1.0]
    assert recommend_staleness(slow)[0] == 5
    # Generation-bound (4 s a batch): asynchrony only hides the broadcast; S = 1 is enough.
    assert recommend_staleness(staleness_options(256, 1.0, 0.2, 64))[0] == 1
    # Nothing measured yet: keep the default.
    assert recommend_staleness(staleness_options(256, 0.0, 0.0, 0.0))[0] == 2
