"""End to end, a LoRA job: the real programs on loopback (coordinator, its learner and nodes),
driven by tools/local_swarm.py: a swarm of a torch node and a llama.cpp node where it is
installed, and, where .venv-vllm exists, a swarm of one vLLM node (vLLM starts in minutes on a
loaded CPU, by which time a short job is over in a swarm of faster engines). Versions are
adapters of a base the nodes fetched once, and every node ends on the final adapter with its
digest computed from its engine's own weights."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from safetensors.torch import load_file

from echo.models.lora import lora_digest
from echo.models.weights import state_digest, state_from_bytes
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tools.local_swarm import node_engines
from echo.tools.swarm import HEADS, VLLM_HEADS, job_toml
from tests.e2e.swarm_tool import run_swarm_tool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 8
LORA_TABLE = """
[job.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj", "up_proj", "down_proj"]
"""


SWARMS = {
    "torch+llamacpp": [e for e in node_engines("mixed") if e != "vllm"],
    "vllm": [e for e in node_engines("mixed") if e == "vllm"],
}


# vLLM's own LoRA swarm starts its engine for minutes on a CPU; tests/node/test_vllm_lora.py
# checks its adapters against the learner in every run, so the swarm is a soak run.
@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=pytest.mark.soak) if name == "vllm" else name
            for name in sorted(SWARMS)],
)
def lora_run(request, tmp_path_factory) -> tuple[Path, list[str]]:
    engines = SWARMS[request.param]
    if not engines:
        pytest.skip(".venv-vllm does not exist here (scripts/vllm_env.sh makes it)")
    out = tmp_path_factory.mktemp("lora-swarm")
    job = out.parent / f"{out.name}-job.toml"
    vllm = "vllm" in engines  # vLLM's CPU attention needs a head size of 32; it starts slowly
    job.write_text(
        job_toml("lora", steps=STEPS, group_size=8, batch_groups=4, anchor_every=4, warmup=30,
                 lr=5e-3, eval_every=4, heads=VLLM_HEADS if vllm else HEADS)
        + LORA_TABLE
    )  # fmt: skip
    run_swarm_tool(
        "echo.tools.local_swarm",
        out,
        ["--quiet", "--nodes", str(len(engines)), "--engines", ",".join(engines), "--job",
         str(job), "--timeout", "600" if vllm else "240"],
        timeout=1200 if vllm else 360,
        what="LoRA swarm",
        logs="**/*.log",
    )  # fmt: skip
    return out, engines


def test_a_lora_job_trains_through_the_swarm_and_every_node_ends_on_the_final_adapter(
    lora_run: tuple[Path, list[str]],
) -> None:
    out, engines = lora_run
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "done" and s["versions"] == STEPS, s
    assert set(s["engines"]) == set(engines)
    assert all(s["accepted_by_engine"][e] > 0 for e in engines), s["accepted_by_engine"]
    assert s["rollouts_rejected"] <= 0.01 * s["rollouts_accepted"] + 1, s

    (job_dir,) = (out / "coordinator" / "jobs").iterdir()
    db = sqlite3.connect(out / "coordinator" / "coordinator.sqlite")
    rows = db.execute("SELECT version, manifest FROM versions ORDER BY version").fetchall()
    assert [v for v, _ in rows] == list(range(STEPS + 1))
    manifests = [signing.open_record(bytes(env), m.Manifest)[1] for _, env in rows]
    base_digest = manifests[0].adapter.base_digest
    for man in manifests:
        assert man.adapter is not None and man.adapter.base_digest == base_digest
        assert man.adapter.carries_base == (man.version == 0)
        assert man.kind == ("anchor" if man.version % 4 == 0 else "patch")
    # The base travelled once, with v0; every later version is the adapter alone.
    assert max(man.total_size for man in manifests[1:]) * 20 < manifests[0].total_size

    # The learner's base and final adapter, as it checkpointed them.
    base = load_file(str(job_dir / "lora_base.safetensors"))
    assert state_digest(base) == base_digest
    final = manifests[-1]
    for i in range(len(engines)):
        meta = json.loads((out / f"node-{i}" / "policy.json").read_text())
        assert meta["version"] == STEPS
        assert meta["state_digest"] == final.state_digest
        # Computed from the engine's own weights (llama.cpp: read back from its GGUF files).
        assert meta["engine_state_digest"] == final.state_digest, meta["engine"]
        adapter = state_from_bytes((out / f"node-{i}" / "policy.safetensors").read_bytes())
        assert lora_digest(base_digest, adapter) == final.state_digest
        log = (out / f"node-{i}.log").read_text()
        assert "wrong_weights" not in log
