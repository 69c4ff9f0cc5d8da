"""End to end, issue 15's story: one coordinator, two jobs at once and a third submitted later,
two nodes started once. The scheduler spreads the nodes, job A finishes early and its node moves
on, the late job gets nodes; all three jobs train to completion, and no node exits or restarts.
Real processes on loopback, as tools/local_swarm.py runs them."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from echo.tools.swarm import DEMO_COORDINATOR_TOML, Swarm, job_toml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCHED = "\n[scheduler]\nevery_s = 1.0\nmin_stay_s = 5.0\n"


def job(name: str, steps: int) -> str:
    return job_toml(
        name, steps=steps, group_size=4, batch_groups=2, anchor_every=5, warmup=0, eval_every=0
    )


def test_two_nodes_serve_three_jobs_to_completion_without_restarting(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr("echo.tools.swarm.DEMO_COORDINATOR_TOML", DEMO_COORDINATOR_TOML + SCHED)
    swarm = Swarm(tmp_path)
    try:
        swarm.start_coordinator()
        a = swarm.submit(job("a", 6))
        b = swarm.submit(job("b", 30))
        nodes = [
            swarm.start_node(f"node-{i}", ["--threads", "1", "--engine", "torch"]) for i in range(2)
        ]
        c = None
        deadline = time.time() + 420
        status: dict[str, str] = {}
        while time.time() < deadline:
            assert swarm.api is not None
            listed = swarm.api.get("/v1/jobs").json()
            status = {j["job_id"]: j["status"] for j in listed}
            if c is None and status[a] == "done":
                c = swarm.submit(job("c", 6))  # submitted while B still trains
            if c is not None and all(s == "done" for s in status.values()):
                break
            assert all(p.poll() is None for p in swarm.procs), "a process exited"
            time.sleep(1.0)
        assert c is not None and status == {a: "done", b: "done", c: "done"}, status
        # No node exited or restarted: the same two processes served every job.
        assert all(p.poll() is None for p in nodes)
        logs = [(tmp_path / f"node-{i}.log").read_text(errors="replace") for i in range(2)]
        # A's node went on to other work when A finished (switching without a restart), and
        # C, submitted late, got a node.
        served = [set(re.findall(r"registered · job (\S+)", text)) for text in logs]
        assert all(served) and set.union(*served) == {a, b, c}, served
        moved_on = [i for i, s in enumerate(served) if a in s and len(s) >= 2]
        assert moved_on and "switching to job" in logs[moved_on[0]], served
        versions = swarm.api.get(f"/v1/jobs/{c}").json()["versions"]
        assert max(v["version"] for v in versions) == 6
        # Between jobs the nodes say they are idle, or were moved: never "leaving".
        assert not any("leaving" in text for text in logs)
    finally:
        swarm.stop()
