"""End to end with an FSDP2 learner: a real coordinator starts it as 2 ranks under torchrun
(gloo, the CPU), two torch nodes feed it, and one rank is SIGKILLed mid-run.

The kill must end in a restart, not a hang: torchrun ends the other rank, the coordinator's
supervisor starts the learner again, it resumes from its last DCP checkpoint, and the job still
publishes every version, each node ending on the final one bit for bit.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from echo.learner import checkpoint
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state, state_digest, state_from_bytes, to_bits
from echo.protocol.jobspec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_fsdp2_learner_trains_through_a_killed_rank(tmp_path: Path) -> None:
    out = tmp_path / "swarm"
    proc = subprocess.run(
        [sys.executable, "-m", "echo.tools.local_swarm", "--out", str(out), "--quiet",
         "--nodes", "2", "--engines", "torch", "--steps", str(STEPS), "--batch-groups", "4",
         "--learner-backend", "fsdp2", "--nproc-per-node", "2", "--kill-learner-at", "5",
         "--timeout", "360"],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )
    (job_dir,) = (out / "coordinator" / "jobs").iterdir()
    log = (job_dir / "learner.log").read_text(errors="replace")
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-6000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "done" and s["versions"] == STEPS
    assert s["learner_killed_at"] is not None
    # torchrun saw the rank die, the supervisor restarted the learner, and it resumed.
    assert "SIGKILL" in log and "resumed from checkpoint" in log
    assert s["eval_first"] is not None and s["eval_last"] is not None

    db = sqlite3.connect(out / "coordinator" / "coordinator.sqlite")
    published = dict(db.execute("SELECT version, state_digest FROM versions").fetchall())
    assert sorted(published) == list(range(STEPS + 1))
    # The checkpoints are sharded (DCP) and read back whole give the published weights.
    spec = JobSpec.model_validate_json((job_dir / "job.json").read_text())
    root = job_dir / "checkpoints"
    assert json.loads((root / f"v{STEPS:08d}" / "meta.json").read_text())["format"] == "dcp"
    model = build_model(ModelSpec.from_dict(spec.model_spec_dict()))
    model.load_state_dict(checkpoint.load_model_state(root, STEPS))
    learner_state = export_state(model, spec.publish_dtype)
    assert state_digest(learner_state) == published[STEPS]
    learner_bits = to_bits(learner_state)
    for i in range(2):
        meta = json.loads((out / f"node-{i}" / "policy.json").read_text())
        node_state = state_from_bytes((out / f"node-{i}" / "policy.safetensors").read_bytes())
        assert meta["version"] == STEPS, (i, meta)
        assert state_digest(node_state) == meta["state_digest"] == published[STEPS]
        node_bits = to_bits(node_state)
        for k in learner_bits:
            assert np.array_equal(learner_bits[k], node_bits[k]), k
