"""Tracking: the real learner logs each published version's metrics to TensorBoard (read back
from the event file); a backend whose package is missing is one clear error naming the extra,
at submit and at learner start. Warm-up defaults by model kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from echo.learner.service import Learner
from echo.learner.tracking import STEP_TOKENS_PER_S, TAGS, TrackingError, open_tracker, tracked
from echo.protocol.jobspec import JobSpec, SpecError, TrackingSection, parse_job


def events(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_the_learner_logs_each_version_to_tensorboard(tmp_path: Path) -> None:
    spec = parse_job({"name": "tb", "warmup": {"steps": 0}, "tracking": {"backend": "tensorboard"}})
    job_dir = tmp_path / "jobs" / "tb-1"
    job_dir.mkdir(parents=True)
    (job_dir / "job.json").write_text(spec.model_dump_json())
    learner = Learner(job_dir, "tb-1", "/ip4/127.0.0.1/tcp/1", torch.get_num_threads())
    learner.build()
    reported = [
        {"eval_accuracy": 0.25},
        {
            "reward": 0.5,
            "loss": -0.125,
            "mismatch": 3e-3,
            "is_w": 1.01,
            "is_w_outside": 0.02,
            "staleness_mean": 1.5,
            "tokens": 640.0,
            "step_s": 0.5,
            "custom": 7.0,
        },
    ]
    for v, metrics in enumerate(reported):
        learner.version = v
        learner._publish([], [], metrics)
    learner.tracker.close()
    acc = events(job_dir / "tracking" / "tb-1")
    scalars = set(acc.Tags()["scalars"])
    assert {
        TAGS["eval_accuracy"],
        TAGS["reward"],
        TAGS["mismatch"],
        TAGS["is_w"],
        TAGS["is_w_outside"],
        TAGS["staleness_mean"],
        STEP_TOKENS_PER_S,
        "learner/custom",
        "throughput/tokens_per_s",
    } <= scalars

    def at(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert at(TAGS["eval_accuracy"]) == [(0, 0.25)]
    assert at(TAGS["reward"]) == [(1, 0.5)]
    assert at(TAGS["loss"]) == [(1, -0.125)]
    assert at(STEP_TOKENS_PER_S) == [(1, 1280.0)]
    # The learner's own figures are logged too (what publishing the version cost).
    assert [s for s, _ in at(TAGS["payload_bytes"])] == [0, 1]


def test_tracked_names_and_throughput() -> None:
    out = tracked({"tokens": 100.0, "step_s": 0.25, "x": 1.0}, wall_s=2.0)
    assert out == {
        "rollout/tokens": 100.0,
        "time/step_s": 0.25,
        "learner/x": 1.0,
        "throughput/tokens_per_s": 50.0,
        STEP_TOKENS_PER_S: 400.0,
    }
    assert "throughput/tokens_per_s" not in tracked({"tokens": 1.0}, wall_s=None)


def test_no_backend_no_tracker(tmp_path: Path) -> None:
    assert open_tracker(TrackingSection(), tmp_path, "j", {}) is None
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["trackio", "wandb"])
def test_a_missing_backend_package_is_one_clear_error(tmp_path: Path, backend: str) -> None:
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here")
    with pytest.raises(
        SpecError, match=rf"tracking.backend: .*pip install 'echo-swarm\[{backend}\]'"
    ):
        parse_job({"name": "t", "tracking": {"backend": backend}})
    # An external learner checks its own environment when it starts, not the coordinator's.
    spec = parse_job(
        {"name": "t", "tracking": {"backend": backend}, "learner_public_key": "00" * 32}
    )
    with pytest.raises(TrackingError, match=rf"echo-swarm\[{backend}\]"):
        open_tracker(spec.tracking, tmp_path, "t", {})


def test_a_stored_job_loads_without_the_backend_package() -> None:
    # The coordinator re-reads stored jobs at restart: no package check there.
    spec = JobSpec.model_validate({"name": "t", "tracking": {"backend": "wandb", "dir": "/x"}})
    assert spec.tracking.dir == "/x"


def test_tracking_keys_are_checked_by_name() -> None:
    with pytest.raises(SpecError, match="tracking.backend"):
        parse_job({"name": "t", "tracking": {"backend": "mlflow"}})
    with pytest.raises(SpecError, match="tracking.folder: unknown key"):
        parse_job({"name": "t", "tracking": {"folder": "x"}})


def test_warmup_defaults_by_model_kind(tmp_path: Path) -> None:
    assert parse_job({"name": "t"}).warmup.steps == 150
    hf = {"kind": "hf", "path": str(tmp_path)}
    assert parse_job({"name": "t", "model": hf}).warmup.steps == 0
    asked = parse_job({"name": "t", "model": hf, "warmup": {"steps": 20}})
    assert asked.warmup.steps == 20
    assert parse_job({"name": "t", "warmup": {"steps": 0}}).warmup.steps == 0
    # The stored job holds the resolved number, and reads back the same.
    again = JobSpec.model_validate_json(asked.model_dump_json())
    assert again.warmup.steps == 20 and again == asked
