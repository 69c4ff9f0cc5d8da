"""The job specification a researcher submits (``job.toml``), validated with clear messages.

Every field has a default that trains the tiny model on the CPU, so ``[job]`` with a name is a
valid job. Unknown keys are refused by name: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpecError(ValueError):
    """A job or config file that does not validate; the message names the bad key."""


# A job is at most four tables deep (job.task.params.<key>, job.reward[i].<key>); a submitted
# mapping nested deeper is not a job, and deep input costs recursion in every parser and
# validator after this point, so it is refused first, by a walk that cannot overflow itself.
MAX_SPEC_DEPTH = 8


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["tiny", "hf"] = "tiny"
    path: str | None = Field(default=None, description="local Hugging Face model folder (kind=hf)")
    hidden: int = Field(default=64, ge=8, le=8192)
    layers: int = Field(default=2, ge=1, le=128)
    heads: int = Field(default=4, ge=1, le=128)
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_hf(self) -> ModelSection:
        if self.kind == "hf" and not self.path:
            raise ValueError("model.path is required when model.kind = 'hf'")
        return self


class TaskSection(BaseModel):
    """``[job.task]``: which task (``echo.tasks.make_task`` checks name and params) and how its
    prompts reach the model."""

    model_config = ConfigDict(extra="forbid")
    name: str = "addition"
    params: dict[str, int | float | str | bool] = Field(default_factory=dict)
    chat: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="render prompts with the tokenizer's chat template: 'auto' when it has one "
        "(plain text otherwise, and the job says so), 'always' (a model without one is an "
        "error), 'never' (plain text); the tiny byte model has none",
    )


# Which optional keys each reward kind reads; any other is refused by name.
_REWARD_KEYS: dict[str, set[str]] = {
    "task": set(),
    "math": {"tag", "timeout_s"},
    "exact": {"tag"},
    "regex": {"pattern"},
    "format": {"tag"},
    "python": {"entry_point", "timeout_s"},
}


class RewardSection(BaseModel):
    """One ``[[job.reward]]`` component; the job's reward is the weighted sum of them all (the
    task's own scorer when there is none). ``echo.tasks.scoring`` documents each kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["task", "math", "exact", "regex", "format", "python"]
    weight: float = Field(default=1.0, ge=-1000, le=1000, allow_inf_nan=False)
    tag: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z][\w-]{0,31}$",
        description="answer tag read by math/exact and required by format (default 'answer')",
    )
    pattern: str | None = Field(
        default=None,
        max_length=1024,
        description="regex searched in the completion; {answer} stands for the escaped answer",
    )
    entry_point: str | None = Field(
        default=None,
        max_length=128,
        description="name of a function registered in entry point group echo_swarm.rewards",
    )
    timeout_s: int | None = Field(
        default=None, ge=1, le=300, description="limit per call (math, python; default 5)"
    )

    @model_validator(mode="after")
    def _keys_fit_kind(self) -> RewardSection:
        given = {k for k in ("tag", "pattern", "entry_point", "timeout_s") if getattr(self, k)}
        extra = given - _REWARD_KEYS[self.kind]
        if extra:
            raise ValueError(f"{', '.join(sorted(extra))} does not apply to kind {self.kind!r}")
        if self.kind == "regex":
            if not self.pattern:
                raise ValueError("kind 'regex' needs 'pattern'")
            try:
                re.compile(self.pattern.replace("{answer}", "x"))
            except re.error as exc:
                raise ValueError(f"pattern does not compile: {exc}") from None
        if self.kind == "python" and not self.entry_point:
            raise ValueError("kind 'python' needs 'entry_point'")
        return self


class GRPOParams(BaseModel):
    """GRPO's hyper-parameters, the ``[job.grpo]`` table: defined once, here, and read by the
    learner as they are (``echo.learner.grpo``, whose docstring gives the objective)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # 7e-4, not 1e-3: one version of staleness makes a converged policy's answers swing (late
    # corrections under Adam's lr-sized steps); 7e-4 cut the swings threefold at every lag and
    # the swarm's late answer losses from 5 in 60 runs to none (README, "Answers lost late").
    lr: float = Field(default=7e-4, gt=0, le=1, description="AdamW learning rate")
    betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas")
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient norm clip")
    clip_eps: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="PPO trust region around the behaviour policy: ratio in [1-eps, 1+eps]",
    )
    dual_clip: float = Field(
        default=2.0, ge=1, description="a negative advantage's ratio counts at most this much"
    )
    objective: Literal["ppo", "cispo"] = Field(
        default="ppo",
        description="per-token objective: ppo (clipped surrogate anchored at the behaviour "
        "policy) or cispo (clipped, detached importance weight; every token keeps pushing)",
    )
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="optimizer steps per batch")
    adv_eps: float = Field(default=1e-6, gt=0, description="added to the group's reward std")
    kl_coef: float = Field(
        default=0.0, ge=0, le=10, description="weight of KL(policy || initial policy) (0: none)"
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> GRPOParams:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError("betas must be in [0, 1)")
        return self


class SamplingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(default=1.0, gt=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=8, ge=1, le=8192)


# Format warm-up steps when ``[job.warmup] steps`` is unset, by model kind: a random tiny model
# needs the answer's shape; random labels would damage a pretrained one.
WARMUP_STEPS_BY_KIND = {"tiny": 150, "hf": 0}


class WarmupSection(BaseModel):
    """``[job.warmup]``: supervised format warm-up before GRPO (``echo.learner.warmup``)."""

    model_config = ConfigDict(extra="forbid")
    steps: int | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="format warm-up steps on random-content answers; unset: 150 for the tiny "
        "model, 0 for a pretrained model (kind 'hf'), which random labels would damage: set it "
        "to warm a pretrained model up anyway. A validated job always holds the number",
    )
    lr: float = Field(default=3e-3, gt=0)


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


class ScheduleSection(BaseModel):
    """``[job.schedule]``: the operator's say in where the coordinator's scheduler puts nodes
    (``echo.coordinator.scheduling.assign``)."""

    model_config = ConfigDict(extra="forbid")
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="a job of higher priority has its measured need met before a lower one "
        "gets more than its first node; equal priorities share by how far each is from its need",
    )
    max_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="the largest fraction of the swarm's nodes this job may hold (at least one)",
    )


# The projections a LoRA adapter may wrap: every engine maps these names (the GGUF adapter's
# tensor names among them), so a job naming another module could not be served everywhere.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(BaseModel):
    """``[job.lora]``: train a LoRA adapter (``echo.learner.lora``) instead of every weight;
    versions then carry the adapter, on a base model nodes fetch once (``echo.models.lora``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(ge=1, le=1024, description="the adapter's rank r")
    alpha: float = Field(
        gt=0, le=1_000_000, allow_inf_nan=False, description="scaling: the update is alpha/r B A"
    )
    dropout: float = Field(
        default=0.0,
        description="must be 0: engines sample without dropout, and the learner's log-probs "
        "must be the function they sample from",
    )
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        max_length=len(LORA_TARGETS),
        description=f"projections the adapter wraps, among {', '.join(LORA_TARGETS)}",
    )
    init: str | None = Field(
        default=None,
        max_length=4096,
        description="a peft adapter folder (adapter_config.json and adapter_model.safetensors "
        "of the same rank, alpha and modules) the adapter starts from; unset: B = 0, so "
        "version 0 samples as the base model",
    )

    @model_validator(mode="after")
    def _check(self) -> LoraSection:
        if self.dropout != 0:
            raise ValueError(
                f"dropout must be 0, not {self.dropout}: rollouts are sampled without dropout "
                "and the learner re-scores them with the same function"
            )
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"target_modules: {', '.join(map(repr, unknown))} is not one of "
                f"{', '.join(LORA_TARGETS)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules names a module twice")
        if self.init is not None and ("\x00" in self.init or not self.init.strip()):
            raise ValueError("init must name a folder")
        return self


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


def explain_validation(exc: ValidationError, what: str) -> SpecError:
    """One line per bad key: where it is and what is wrong ('unknown key' for typos)."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{what}: {where}: {msg}")
    return SpecError("\n".join(lines))


def read_toml(path: Path | None) -> dict[str, Any]:
    """The table in TOML file ``path`` ({} for None); SpecError if missing or malformed."""
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path} is not valid TOML: {exc}") from None


def relative_path_problem(path: str) -> str | None:
    """Why ``path`` could name something outside the folder it is taken relative to (absolute,
    a ``..`` part, a NUL byte), else None."""
    if "\x00" in path:
        return "must not contain a NUL byte"
    # A backslash is a separator on Windows; here it only hides a '..' from a casual reader.
    parts = PurePosixPath(path.replace("\\", "/"))
    if parts.is_absolute() or path.startswith("~"):
        return f"{path!r} must be relative to the job's folder, not absolute"
    if ".." in parts.parts:
        return f"{path!r} must stay inside the job's folder (no '..')"
    return None


def is_local_path_param(key: str) -> bool:
    """Whether task parameter ``key`` names a file on the coordinator (``path``, ``eval_path``,
    any ``*_path``): such a value is read only under the operator's dataset roots and never
    sent to nodes."""
    return key == "path" or key.endswith("_path")


def node_task_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The task parameters a node may see: all but those naming local files
    (:func:`is_local_path_param`). Nodes generate from the token ids in their leases and never
    read the dataset; where the coordinator keeps its files is nobody else's business."""
    return {k: v for k, v in params.items() if not is_local_path_param(k)}


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
