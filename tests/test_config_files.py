"""The example configuration files validate, and bad keys are named in the error."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from echo.coordinator.config import load_config
from echo.node.config import load_node_config
from echo.protocol.jobspec import SpecError, load_job_toml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_examples_validate() -> None:
    cfg = load_config(EXAMPLES / "coordinator.toml")
    assert cfg.verification.lease_quota_ramp == 3 and cfg.learner.torch_threads == 2
    job = load_job_toml((EXAMPLES / "job.toml").read_text())
    assert job.steps == 200 and job.task.params == {"max_operand": 5}
    node = load_node_config(EXAMPLES / "node.toml", {})
    assert node.schedule == "22:00-07:00" and node.max_upload_mbps is None
    assert load_node_config(None, {"max_upload_mbps": 4.5}).max_upload_mbps == 4.5
    assert node.working_now(dt.datetime(2026, 1, 1, 23, 30))
    assert not node.working_now(dt.datetime(2026, 1, 1, 12, 0))


def test_bad_keys_are_named(tmp_path) -> None:
    with pytest.raises(SpecError, match=r"grpo\.lrr: unknown key"):
        load_job_toml("[job]\nname='x'\n[job.grpo]\nlrr=1\n")
    with pytest.raises(SpecError, match=r"staleness: Input should be greater than or equal"):
        load_job_toml("[job]\nname='x'\nstaleness=-1\n")
    assert load_job_toml("[job]\nname='x'\nstaleness=0\n").staleness == 0  # synchronous
    with pytest.raises(SpecError, match=r"grpo\.tis_cap: unknown key"):  # now dual_clip
        load_job_toml("[job]\nname='x'\n[job.grpo]\ntis_cap=2\n")
    with pytest.raises(SpecError, match=r"grpo: Value error, betas must be in"):
        load_job_toml("[job]\nname='x'\n[job.grpo]\nbetas=[0.9, 1.5]\n")
    bad = tmp_path / "c.toml"
    bad.write_text("[verification]\nlease_timeout=3\n")
    with pytest.raises(SpecError, match=r"verification\.lease_timeout: unknown key"):
        load_config(bad)
    with pytest.raises(SpecError, match="schedule"):
        load_node_config(None, {"schedule": "nightly"})
    with pytest.raises(SpecError, match="max_upload_mbps: Input should be greater than 0"):
        load_node_config(None, {"max_upload_mbps": -2})
    bad.write_text("[broadcast]\nlearner_pace=1.5\n")
    with pytest.raises(SpecError, match=r"broadcast\.learner_pace: Input should be less than"):
        load_config(bad)
    with pytest.raises(SpecError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_demo_buffer_batches_become_the_coordinators_buffer_groups(tmp_path) -> None:
    """``local_swarm.py --buffer-batches N`` keeps N batches ahead of the learner through the
    coordinator's own setting; 0 leaves the coordinator's default."""

    from echo.tools.swarm import DEMO_COORDINATOR_TOML, buffer_toml

    path = tmp_path / "coordinator.toml"
    path.write_text(DEMO_COORDINATOR_TOML + buffer_toml(5, 16))
    assert load_config(path).verification.buffer_groups == 80
    path.write_text(DEMO_COORDINATOR_TOML + buffer_toml(0, 16))
    assert load_config(path).verification.buffer_groups == 0
