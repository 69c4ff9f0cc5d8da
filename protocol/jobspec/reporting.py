"""What the learner reports while it trains: per-version metrics to a tracking backend
(``[job.tracking]``) and held-out greedy accuracy (``[job.eval]``)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from echo.protocol.jobspec.paths import relative_path_problem

# Tracking backend -> (module to import, the echo-swarm extra that installs it).
TRACKING_PACKAGES = {
    "tensorboard": ("tensorboard", "tracking"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
}


class TrackingSection(BaseModel):
    """``[job.tracking]``: where the learner logs its per-version metrics
    (``echo.learner.tracking``); off unless a backend is named."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["none", "tensorboard", "trackio", "wandb"] = Field(
        default="none", description="tensorboard, trackio or wandb (offline); none: no tracking"
    )
    dir: str | None = Field(
        default=None,
        max_length=4096,
        description="folder the backend writes to (a relative path is under the job's folder); "
        "unset: <job folder>/tracking",
    )
    project: str = Field(
        default="echo-swarm", min_length=1, max_length=128, description="trackio/wandb project"
    )
    run_name: str | None = Field(
        default=None, max_length=128, description="the run's name; unset: the job id"
    )

    def escape_problem(self) -> str | None:
        """Why ``dir`` or ``run_name`` could make the learner write outside the job's folder
        (one line naming the key), else None. Checked when a job is submitted, not when a
        stored one is read back: the learner refuses such a folder itself
        (:func:`echo.learner.tracking.open_tracker`)."""
        if self.dir is not None:
            why = relative_path_problem(self.dir)
            if why:
                return f"tracking.dir: {why}"
        if self.run_name is not None:
            name = self.run_name
            # The run's name is a folder of its own under dir (TensorBoard): one plain part.
            if any(c in name for c in "/\\\x00") or name in ("", ".", ".."):
                return (
                    f"tracking.run_name: {name!r} must be one folder name (no '/', '\\', "
                    "'..' or NUL)"
                )
        return None

    def missing_package(self) -> str | None:
        """What to install when the backend's package is not importable here (one line naming
        the extra), else None. Looks the module up without importing it."""
        if self.backend == "none":
            return None
        module, extra = TRACKING_PACKAGES[self.backend]
        if importlib.util.find_spec(module) is not None:
            return None
        return (
            f"backend {self.backend!r} needs the {module} package, which is not installed: "
            f"pip install 'echo-swarm[{extra}]'"
        )


class EvalSection(BaseModel):
    """Held-out greedy accuracy, measured by the learner (``echo.learner.evaluate``)."""

    model_config = ConfigDict(extra="forbid")
    every: int = Field(default=10, ge=0, description="versions between evaluations; 0 = never")
    prompts: int = Field(default=256, ge=1, le=100_000, description="held-out prompts")
