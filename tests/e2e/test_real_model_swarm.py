"""A real model through the whole swarm: SmolLM2-135M-Instruct trained for a few versions by a
local swarm of real processes (coordinator, its learner, one node per engine this machine has:
torch, llama.cpp, and vLLM when ``scripts/vllm_env.sh`` has made ``.venv-vllm``), on a
GSM8K-style dataset task graded by math-verify and on a reasoning-gym task; then the final
version exported with ``echo-job export`` from a restarted coordinator.

torch and llama.cpp nodes run side by side; a vLLM node runs alone (see ``VLLM_STEPS``).
The runs are short but nothing is faked: the model, the chat-templated prompts in signed leases,
the rewards the coordinator recomputes, re-scoring, the bf16 anchor and patches down the relay
tree, and the export are the product's own. What keeps a run to a few minutes on 2 cores is the
job's size: 32 new tokens, groups of 4, 2 groups a step, 2 held-out prompts.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from echo.models.weights import state_digest, state_from_bytes, to_bits
from echo.tools.local_swarm import VLLM_READY, node_engines
from echo.tools.swarm import Swarm
from tests.e2e.swarm_tool import run_swarm_tool

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Versions per run. vLLM runs alone: on the CPU it starts in minutes and reloads each version in
# about 70 s (its checkpoint loader), so beside torch and llama.cpp nodes, which finish 8 versions
# first, it served no group in a run here; alone, 2 versions had 8 groups accepted, 0 rejected.
STEPS = 3
VLLM_STEPS = 2
# What a job needs to stay short on 2 cores; the task block is the only part that differs.
JOB_HEAD = """\
[job]
name = "{name}"
steps = {steps}
group_size = 4
batch_groups = 2
staleness = 1
publish_dtype = "bfloat16"

[job.model]
kind = "hf"
path = "{model}"

[job.sampling]
max_new_tokens = 32

[job.eval]
every = {steps}
prompts = 2

[job.grpo]
lr = 1e-6
"""
GSM8K_TASK = """
[job.task]
name = "dataset"
chat = "auto"

[job.task.params]
path = "{data}"
eval_fraction = 0.2
prompt_field = "question"
answer_field = "answer"
system_prompt = "Answer with the final number as <answer>N</answer>."
max_new_tokens = 32

[[job.reward]]
kind = "math"
weight = 1.0

[[job.reward]]
kind = "format"
weight = 0.1
"""
GYM_TASK = """
[job.task]
name = "gym:basic_arithmetic"
chat = "auto"

[job.task.params]
min_terms = 2
max_terms = 2
min_digits = 1
max_digits = 1
max_new_tokens = 32
"""
TASKS = {
    "gsm8k": GSM8K_TASK.format(data=ROOT / "tests" / "data" / "gsm8k_mini.jsonl"),
    "gym": GYM_TASK,
}


def engines() -> list[str]:
    """One node per in-process engine this machine has: torch, and llama.cpp when installed."""
    return [e for e in node_engines("mixed") if e != "vllm"]


def run_swarm(out: Path, task: str, model: Path, eng: list[str], steps: int) -> dict:
    """Run the job for ``task`` on nodes of engines ``eng`` through tools/local_swarm.py;
    returns its summary.json."""
    job = out / "job-in.toml"
    out.mkdir(parents=True, exist_ok=True)
    job.write_text(JOB_HEAD.format(name=f"real-{task}", steps=steps, model=model) + TASKS[task])
    run_swarm_tool(
        "echo.tools.local_swarm",
        out,
        ["--quiet", "--job", str(job), "--nodes", str(len(eng)), "--engines", ",".join(eng),
         "--leases-at-once", "1", "--timeout", "480"],
        timeout=600,
        what="local swarm",
    )  # fmt: skip
    return json.loads((out / "summary.json").read_text())


def export_final(out: Path, job_id: str) -> Path:
    """Start the coordinator again on the run's data and ``echo-job export`` the newest version
    into a new folder, as a researcher would after the run."""
    swarm = Swarm(out)
    try:
        info = swarm.start_coordinator()
        dest = out / "exported"
        echo_job = Path(sys.executable).parent / "echo-job"
        proc = subprocess.run(
            [
                str(echo_job),
                "export",
                job_id,
                str(dest),
                "--url",
                info["http"][0],
                "--token",
                info["token"],
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return dest
    finally:
        swarm.stop()


def check_run(out: Path, s: dict, eng: list[str], steps: int) -> None:
    """Versions to the end, groups from every engine, nothing rejected, every node on the final
    version with the published digest (in its engine too), and the export equal to it."""
    assert s["status"] == "done" and s["versions"] == steps, s
    assert s["nodes"] == len(eng) and sorted(s["engines"]) == sorted(eng), s["engines"]
    assert all(s["accepted_by_engine"].get(e, 0) > 0 for e in eng), s["accepted_by_engine"]
    assert s["rollouts_rejected"] == 0, s["rejected_by_reason"]
    assert s["rollouts_trained"] >= 2 * steps
    # Held-out accuracy was measured on the base model and at the last version.
    assert [e["version"] for e in s["eval_by_version"]] == [0, steps], s["eval_by_version"]

    db = sqlite3.connect(out / "coordinator" / "coordinator.sqlite")
    published = dict(db.execute("SELECT version, state_digest FROM versions").fetchall())
    final = max(published)
    assert final == steps
    node_state: dict[str, torch.Tensor] = {}
    for i in range(len(eng)):
        meta = json.loads((out / f"node-{i}" / "policy.json").read_text())
        node_state = state_from_bytes((out / f"node-{i}" / "policy.safetensors").read_bytes())
        assert meta["version"] == final, (i, meta)
        assert state_digest(node_state) == meta["state_digest"] == published[final], (i, meta)
        assert meta["engine_state_digest"] == published[final], (i, meta)
    assert all(t.dtype == torch.bfloat16 for t in node_state.values())

    from transformers import AutoModelForCausalLM

    dest = export_final(out, s["job_id"])
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.bfloat16)
    exported = to_bits({k: v for k, v in model.state_dict().items() if k in node_state})
    want = to_bits(node_state)
    assert exported.keys() == want.keys()
    for k in want:
        assert np.array_equal(exported[k], want[k]), k


# The gsm8k run on torch and llama.cpp nodes is a soak run (`pytest -m soak`, 99 s here): the
# vLLM run below takes the same dataset task, math-verify grading included, through a swarm, and
# the gym run the same torch and llama.cpp nodes; CI's budget asks for one of each.
@pytest.mark.parametrize("task", [pytest.param("gsm8k", marks=pytest.mark.soak), "gym"])
def test_smollm2_swarm(task: str, smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / task
    eng = engines()
    check_run(out, run_swarm(out, task, smollm2_path, eng, STEPS), eng, STEPS)


@pytest.mark.skipif(not VLLM_READY.exists(), reason=".venv-vllm is absent (scripts/vllm_env.sh)")
def test_smollm2_swarm_on_vllm(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "vllm"
    s = run_swarm(out, "gsm8k", smollm2_path, ["vllm"], VLLM_STEPS)
    check_run(out, s, ["vllm"], VLLM_STEPS)
