"""The job specification a researcher submits (``job.toml``), validated with clear messages.

Every field has a default that trains the tiny model on the CPU, so ``[job]`` with a name is a
valid job. Unknown keys are refused by name: a typo must not silently fall back to a default.

This package owns the spec's types and their validation, one concept a module, and exports every
public name here, so importers write ``from echo.protocol.jobspec import JobSpec``:

- :mod:`~echo.protocol.jobspec.job`: the whole job (:class:`JobSpec`) and its parsing
  (:func:`parse_job`, :func:`load_job_toml`);
- :mod:`~echo.protocol.jobspec.model`: what trains (``[job.model]``, ``[job.lora]``);
- :mod:`~echo.protocol.jobspec.task`: what it learns and how answers score (``[job.task]``,
  ``[[job.reward]]``);
- :mod:`~echo.protocol.jobspec.training`: how it trains (``[job.grpo]``, ``[job.sampling]``,
  ``[job.warmup]``);
- :mod:`~echo.protocol.jobspec.reporting`: what the learner reports (``[job.tracking]``,
  ``[job.eval]``);
- :mod:`~echo.protocol.jobspec.schedule`: where the scheduler may put nodes (``[job.schedule]``);
- :mod:`~echo.protocol.jobspec.paths`: the file paths a job names, and which stay on the
  coordinator;
- :mod:`~echo.protocol.jobspec.errors`: :class:`SpecError` and the TOML and validation-error
  helpers every config file shares.
"""

from echo.protocol.jobspec.errors import SpecError, explain_validation, read_toml
from echo.protocol.jobspec.job import (
    MAX_SPEC_DEPTH,
    JobSpec,
    load_job_toml,
    nested_deeper_than,
    parse_job,
)
from echo.protocol.jobspec.model import LORA_TARGETS, LoraSection, ModelSection
from echo.protocol.jobspec.paths import (
    is_local_path_param,
    node_task_params,
    relative_path_problem,
)
from echo.protocol.jobspec.reporting import TRACKING_PACKAGES, EvalSection, TrackingSection
from echo.protocol.jobspec.schedule import ScheduleSection
from echo.protocol.jobspec.task import RewardSection, TaskSection
from echo.protocol.jobspec.training import (
    WARMUP_STEPS_BY_KIND,
    GRPOParams,
    SamplingSection,
    WarmupSection,
)

__all__ = [
    "LORA_TARGETS",
    "MAX_SPEC_DEPTH",
    "TRACKING_PACKAGES",
    "WARMUP_STEPS_BY_KIND",
    "EvalSection",
    "GRPOParams",
    "JobSpec",
    "LoraSection",
    "ModelSection",
    "RewardSection",
    "SamplingSection",
    "ScheduleSection",
    "SpecError",
    "TaskSection",
    "TrackingSection",
    "WarmupSection",
    "explain_validation",
    "is_local_path_param",
    "load_job_toml",
    "nested_deeper_than",
    "node_task_params",
    "parse_job",
    "read_toml",
    "relative_path_problem",
]
