"""What a job learns and how an answer is scored: the task (``[job.task]``) and the reward
components (``[[job.reward]]``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
