"""The task interface: a deterministic prompt source plus a verifiable reward.

A task is pure: :meth:`Task.prompt` depends only on the task's parameters and the prompt id, so
the coordinator re-derives any prompt from a lease and never trusts a node's copy, and
:meth:`Task.reward` is recomputed by the coordinator from the completion text alone.
Completions are decoded text with EOS (and other special tokens) removed.

Prompt ids: the coordinator numbers training prompts from 0, one per group. Ids from
:data:`EVAL_PROMPT_BASE` on are reserved for held-out evaluation and never leased;
:meth:`Task.eval_prompt_ids` lists the ones a task evaluates on (procedural tasks: the first ``n``
of that range; dataset tasks: their eval split).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

# Prompt ids travel in leases; bounding them keeps them a plain signed 64-bit integer everywhere.
MAX_PROMPT_ID = (1 << 63) - 1
# Far above any prompt id a job leases (one id per group: 10**9 groups is beyond any run).
EVAL_PROMPT_BASE = 10**9


def check_prompt_id(prompt_id: int) -> None:
    """Raise TypeError for a non-int (bools included) and ValueError outside [0, 2**63 - 1]."""
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, int):
        raise TypeError(f"prompt_id must be an int, not {type(prompt_id).__name__}")
    if not 0 <= prompt_id <= MAX_PROMPT_ID:
        raise ValueError(f"prompt_id {prompt_id} outside [0, 2**63 - 1]")


class TaskParams(BaseModel):
    """Base of every task's parameters: strict, immutable, JSON-able."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(ABC):
    """A prompt source and reward function. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[TaskParams]]

    def __init__(self, params: TaskParams) -> None:
        self.params = params

    @property
    @abstractmethod
    def max_new_tokens(self) -> int:
        """Generation budget: room for the longest correct answer, its EOS, and a little slack."""

    @abstractmethod
    def prompt(self, prompt_id: int) -> str:
        """The prompt text for ``prompt_id``; a pure function of the params and the id."""

    @abstractmethod
    def answer(self, prompt_id: int) -> str:
        """The reference answer (for tests and evaluation; rewards need not use it)."""

    @abstractmethod
    def reward(self, prompt_id: int, completion: str) -> float:
        """Score of ``completion`` (decoded, EOS removed) for ``prompt_id``, in [0, 1]."""

    @abstractmethod
    def format_example(self, rng: random.Random) -> tuple[str, str]:
        """A real-format prompt and a completion in the answer's format but with random content,
        for the supervised format warm-up (it teaches shape and stopping, not the task)."""

    def system_prompt(self, prompt_id: int) -> str | None:
        """The system prompt for ``prompt_id``, or None (the default: tasks without one)."""
        return None

    def scoring_context(self, prompt_id: int) -> Any:
        """What another process needs to score ``prompt_id`` exactly as this one would
        (picklable; None: the task's params suffice, the default). Tasks whose items depend on
        more than their params (reasoning-gym's, some of which vary with the interpreter's hash
        seed) return the item, and the scoring sandbox :meth:`pin` s it in its child."""
        return None

    def pin(self, prompt_id: int, context: Any) -> None:
        """Use ``context`` (from :meth:`scoring_context` in the parent) for ``prompt_id``."""
        return None  # tasks without a context have nothing to pin

    def eval_prompt_ids(self, n: int) -> list[int]:
        """At most ``n`` held-out prompt ids, the same on every call and every machine.

        Procedural tasks draw fresh prompts from ``EVAL_PROMPT_BASE`` on, so they always give
        ``n``; a dataset task gives its eval split's first ``n`` rows (fewer if the split is
        smaller). Raises ValueError if ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, not {n}")
        return list(range(EVAL_PROMPT_BASE, EVAL_PROMPT_BASE + n))

    def row_id(self, prompt_id: int) -> str:
        """A stable name of the prompt's source (a dataset row's id); procedural: the id."""
        return str(prompt_id)

    def params_dict(self) -> dict[str, Any]:
        """The parameters as plain JSON-able data."""
        return self.params.model_dump()

    def describe(self) -> dict[str, Any]:
        """``{"name": ..., "params": ...}``: enough to rebuild the task with ``make_task``."""
        return {"name": self.name, "params": self.params_dict()}

    def prompt_rng(self, prompt_id: int) -> random.Random:
        """A random stream owned by one prompt: seeded by sha256 of (task, params, prompt id), so it
        is the same on every machine and Python version (unlike ``hash()``)."""
        check_prompt_id(prompt_id)
        key = f"{self.name}|{self.params.model_dump_json()}|{prompt_id}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params_dict()})"
