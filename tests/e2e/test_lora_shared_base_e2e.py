"""End to end, issue 28's several LoRA jobs on one base: two LoRA jobs of the same base model on
one coordinator, and a torch node and a llama.cpp node (two torch nodes where llama.cpp is not
installed) started once. The coordinator tells each node the jobs that share its job's base;
each node takes leases of both, switching its engine's adapter between them, and loads the base
once. Real processes on loopback, as tools/local_swarm.py runs them."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest

from echo.tools.local_swarm import node_engines
from echo.tools.swarm import DEMO_COORDINATOR_TOML, Swarm, job_toml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Long enough for both nodes to join: at 6 steps the torch node, whose base loads first,
# finished both jobs in 2 s, before the llama.cpp node had loaded its base (CI, once).
STEPS = 30
LORA_TABLE = """
[job.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj"]
"""
SCHED = "\n[scheduler]\nevery_s = 1.0\nmin_stay_s = 5.0\n"


def lora_job(name: str, task_operand: int) -> str:
    # No warm-up: both jobs' base is the seed-0 model, bit for bit (the learner publishes it).
    return (
        job_toml(
            name, steps=STEPS, group_size=4, batch_groups=2, anchor_every=3, warmup=0,
            eval_every=0, lr=5e-3, max_operand=task_operand,
        )
        + LORA_TABLE
    )  # fmt: skip


def test_two_lora_jobs_share_one_base_on_the_same_nodes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("echo.tools.swarm.DEMO_COORDINATOR_TOML", DEMO_COORDINATOR_TOML + SCHED)
    engines = [e for e in node_engines("mixed") if e != "vllm"]
    engines = (engines + ["torch"])[:2]
    swarm = Swarm(tmp_path)
    try:
        swarm.start_coordinator()
        a = swarm.submit(lora_job("a", 5))
        b = swarm.submit(lora_job("b", 6))
        # Both jobs published version 0 before the nodes register: the coordinator lists the
        # jobs of a base at registration.
        deadline = time.time() + 300
        while time.time() < deadline:
            if all(swarm.status(j)[0]["current_version"] >= 0 for j in (a, b)):
                break
            assert all(p.poll() is None for p in swarm.procs), "a process exited"
            time.sleep(1.0)
        else:
            pytest.fail("the jobs did not publish version 0")
        for i, engine in enumerate(engines):
            swarm.start_node(f"node-{i}", ["--threads", "1", "--engine", engine])
        final = {j: swarm.wait_finished(j, stall_s=150.0, cap_s=420.0) for j in (a, b)}
        for job_id, (st, trace) in final.items():
            assert st["status"] == "done" and st["current_version"] == STEPS, (job_id, trace)

        db = sqlite3.connect(tmp_path / "coordinator" / "coordinator.sqlite")
        rows = db.execute("SELECT job_id, manifest FROM versions WHERE version = 0").fetchall()
        from echo.protocol import messages as m
        from echo.protocol import signing

        bases = {j: signing.open_record(bytes(env), m.Manifest)[1].adapter.base_digest
                 for j, env in rows}  # fmt: skip
        assert bases[a] == bases[b], "the two jobs' versions adapt one base"
        for i, engine in enumerate(engines):
            log = (tmp_path / f"node-{i}.log").read_text(errors="replace")
            node_id = re.search(r"node (\S+) · engine", log).group(1)
            # The node served both jobs: the coordinator accepted groups of each from it ...
            served = dict(db.execute(
                "SELECT job_id, COUNT(*) FROM rollouts WHERE node_id = ? AND status != 'rejected'"
                " GROUP BY job_id", (node_id,),
            ).fetchall())  # fmt: skip
            assert served.get(a, 0) > 0 and served.get(b, 0) > 0, (engine, served)
            assert "also serving job" in log, engine
            # ... and its engine loaded the base once: every other version of either job, and
            # every turn between the jobs, was an adapter switch.
            assert len(re.findall(r"loaded base \w+ into the", log)) == 1, (engine, log[-3000:])
            assert "wrong_weights" not in log, engine
            print(f"{engine} node: groups accepted per job {served}, base loads 1")
        rejected = db.execute("SELECT COUNT(*) FROM rollouts WHERE status = 'rejected'").fetchone()
        accepted = db.execute("SELECT COUNT(*) FROM rollouts WHERE status != 'rejected'").fetchone()
        assert rejected[0] <= 0.01 * accepted[0] + 1, (rejected, accepted)
    finally:
        swarm.stop()
