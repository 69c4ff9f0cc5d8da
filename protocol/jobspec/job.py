"""The whole job (:class:`JobSpec`, the ``[job]`` table) and its parsing from a submitted
mapping (:func:`parse_job`: the ``[job]`` table of job.toml, or the same as JSON) or from
job.toml text (:func:`load_job_toml`)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.protocol.jobspec.errors import SpecError, explain_validation
from echo.protocol.jobspec.model import LoraSection, ModelSection
from echo.protocol.jobspec.reporting import EvalSection, TrackingSection
from echo.protocol.jobspec.schedule import ScheduleSection
from echo.protocol.jobspec.task import RewardSection, TaskSection
from echo.protocol.jobspec.training import (
    WARMUP_STEPS_BY_KIND,
    GRPOParams,
    SamplingSection,
    WarmupSection,
)

# A job is at most four tables deep (job.task.params.<key>, job.reward[i].<key>); a submitted
# mapping nested deeper is not a job, and deep input costs recursion in every parser and
# validator after this point, so it is refused first, by a walk that cannot overflow itself.
MAX_SPEC_DEPTH = 8


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    reward: list[RewardSection] = Field(
        default_factory=list,
        max_length=16,
        description="[[job.reward]] components, summed with their weights; none: the task's own",
    )
    grpo: GRPOParams = Field(default_factory=GRPOParams)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    lora: LoraSection | None = Field(
        default=None, description="[job.lora]: train a LoRA adapter only (unset: every weight)"
    )
    steps: int = Field(default=60, ge=1, le=10_000_000, description="policy versions to train")
    group_size: int = Field(default=16, ge=2, le=256)
    batch_groups: int = Field(default=8, ge=1, le=4096, description="GRPO groups per step")
    staleness: int = Field(
        default=2,
        ge=0,
        le=64,
        description="max versions a rollout may lag; 0 = synchronous (train only on groups "
        "sampled from the current version)",
    )
    skip_uniform_groups: bool = Field(
        default=False,
        description="dynamic sampling (DAPO): a group whose samples all scored the same carries "
        "no advantage; it is credited to its node but not trained on, and another prompt is "
        "leased in its place (at most 4 batches of such groups per sampled version: beyond "
        "that they train as usual, so a policy that solves every prompt still steps)",
    )
    anchor_every: int = Field(default=10, ge=1, description="full anchor every K versions")
    publish_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    learner_public_key: str | None = Field(
        default=None, description="hex Ed25519 key of an external learner; unset = local learner"
    )

    @model_validator(mode="after")
    def _warmup_default(self) -> JobSpec:
        # Resolved here, once, so the stored job and the learner read the same number.
        if self.warmup.steps is None:
            self.warmup.steps = WARMUP_STEPS_BY_KIND[self.model.kind]
        return self

    def model_spec_dict(self) -> dict[str, Any]:
        m = self.model
        if m.kind == "hf":
            return {"kind": "hf", "path": m.path}
        return {"kind": "tiny", "hidden": m.hidden, "layers": m.layers, "heads": m.heads}


def _kind(data: object) -> str:
    """What a JSON value is, in words, for an error message."""
    if data is None:
        return "null"
    if isinstance(data, bool):
        return "a boolean"
    if isinstance(data, (int, float)):
        return "a number"
    if isinstance(data, str):
        return "a string"
    if isinstance(data, (list, tuple)):
        return "a list"
    return type(data).__name__


def nested_deeper_than(data: object, limit: int) -> bool:
    """Whether ``data`` holds lists or mappings more than ``limit`` levels deep (``data`` itself
    is level 1). Iterative: a hostile depth cannot overflow this walk."""
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, Mapping):
            children: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            children = obj
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_job(data: Any) -> JobSpec:
    """Validate a job mapping (the ``[job]`` table of job.toml, or the same as JSON) as it is
    submitted: a tracking backend a local learner could not import is refused here (an
    external learner checks its own when it starts), and so is a tracking folder or run name
    outside the job's folder. Raises SpecError naming the bad key, or saying what the input is
    when it is not a table (a string, null, a list) or nests deeper than
    :data:`MAX_SPEC_DEPTH`."""
    if not isinstance(data, Mapping):
        raise SpecError(f"job: the spec must be a table of keys (a JSON object), not {_kind(data)}")
    if nested_deeper_than(data, MAX_SPEC_DEPTH):
        raise SpecError(f"job: the spec is nested deeper than {MAX_SPEC_DEPTH} levels")
    if "job" in data and isinstance(data["job"], Mapping) and len(data) == 1:
        data = data["job"]
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise explain_validation(exc, "job") from None
    escape = spec.tracking.escape_problem()
    if escape:
        raise SpecError(f"job: {escape}")
    missing = None if spec.learner_public_key else spec.tracking.missing_package()
    if missing:
        raise SpecError(f"job: tracking.backend: {missing}")
    return spec


def load_job_toml(text: str) -> JobSpec:
    """Parse and validate job.toml text; SpecError for bad TOML (nested arrays past the
    parser's recursion limit included) or a bad job (see :func:`parse_job`)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"job.toml is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise SpecError("job.toml is nested too deeply to be a job") from None
    return parse_job(data)
