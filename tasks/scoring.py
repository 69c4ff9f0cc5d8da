"""The job's reward: a weighted sum of ``[[job.reward]]`` components over one task.

Kinds (see :class:`~echo.protocol.jobspec.RewardSection` for the keys each reads):

- ``task``: the task's own scorer (``Task.reward``); the whole reward when a job lists none;
- ``math``: math-verify of the completion against the reference answer (boxed answers, LaTeX,
  the last number; :func:`~echo.tasks.rewards.math_score`), ``timeout_s`` per call (default 5);
- ``exact``: the completion's final answer equals the reference (``rewards.final_answer``);
- ``regex``: ``pattern`` found in the completion, ``{answer}`` standing for the escaped answer;
- ``format``: exactly one non-empty ``<tag>...</tag>`` (default ``answer``) ending the text;
- ``python``: a researcher's function registered as entry point ``entry_point`` in group
  ``echo_swarm.rewards``, called as ``fn(prompt=str, completion=str, answer=str,
  prompt_id=int) -> float``, ``timeout_s`` per call (default 5).

A :class:`JobReward` calls every scorer in the calling thread and process: it is what runs
*inside* the scoring sandbox (:class:`echo.tasks.sandbox.Sandbox`), which confines the process and
enforces the time limits. Code that holds completions from the network never calls it directly.
A component that fails (raises, or returns a non-number) scores 0.0 for that completion, and
:meth:`JobReward.detailed` says so with the outcome ``scorer_error``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import echo.tasks.rewards as rw
from echo.tasks.base import Task
from echo.tasks.reward_worker import find_entry_point, resolve

__all__ = ["JobReward", "RewardTerm", "find_entry_point", "has_advantage"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5


def has_advantage(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ. One whose samples all scored the same carries no
    advantage under GRPO's normalisation within the group (the learner's ``group_advantages``
    gives it zeros), which is what dynamic sampling (``skip_uniform_groups``) sets aside."""
    return min(rewards) != max(rewards)


class RewardConfig(Protocol):
    """One component's settings, as ``[[job.reward]]`` gives them (``RewardSection`` in
    ``echo.protocol.jobspec``, which validates which keys apply to which kind)."""

    @property
    def kind(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def tag(self) -> str | None: ...
    @property
    def pattern(self) -> str | None: ...
    @property
    def entry_point(self) -> str | None: ...
    @property
    def timeout_s(self) -> int | None: ...


@dataclass(frozen=True)
class RewardTerm:
    """One component's settings as plain data (what crosses into the sandbox); the default is
    the component a job without ``[[job.reward]]`` is scored by: the task's own scorer."""

    kind: str = "task"
    weight: float = 1.0
    tag: str | None = None
    pattern: str | None = None
    entry_point: str | None = None
    timeout_s: int | None = None


@dataclass(frozen=True)
class Component:
    """One weighted term: ``score(prompt_id, completion)`` in [0, 1] for built-ins."""

    label: str
    weight: float
    score: Callable[[int, str], float]


class JobReward:
    """``reward(prompt_id, completion)``: the weighted sum of the job's components.

    Built from validated sections, so the only errors left are about the environment:
    :raises ValueError: a ``python`` component whose entry point is not registered.
    :raises ImportError, AttributeError, TypeError: one whose function does not load.
    """

    def __init__(self, task: Task, sections: Sequence[RewardConfig] = ()) -> None:
        self.task = task
        sections = list(sections) or [RewardTerm()]
        self.components = [self._component(i, s) for i, s in enumerate(sections)]

    def _component(self, i: int, s: RewardConfig) -> Component:
        task, tag = self.task, s.tag or "answer"
        timeout = s.timeout_s or DEFAULT_TIMEOUT_S
        score: Callable[[int, str], float]
        if s.kind == "task":
            score = task.reward
        elif s.kind == "math":
            score = lambda pid, text: rw.math_score(text, task.answer(pid), timeout, tag)  # noqa: E731
        elif s.kind == "exact":
            score = lambda pid, text: rw.exact_score(text, task.answer(pid), tag)  # noqa: E731
        elif s.kind == "regex":
            pattern = s.pattern or ""
            score = lambda pid, text: rw.regex_score(text, pattern, task.answer(pid))  # noqa: E731
        elif s.kind == "format":
            score = lambda pid, text: rw.format_score(text, tag)  # noqa: E731
        elif s.kind == "python":
            name = s.entry_point or ""
            find_entry_point(name)  # names the registered ones when it is missing
            score = self._python(resolve(f"entry:{name}"))
            return Component(f"python:{name}", s.weight, score)
        else:
            raise ValueError(f"reward #{i}: unknown kind {s.kind!r}")
        return Component(f"{s.kind}#{i}" if s.kind != "task" else "task", s.weight, score)

    def _python(self, fn: Callable[..., object]) -> Callable[[int, str], float]:
        task = self.task

        def score(pid: int, text: str) -> float:
            value = fn(
                prompt=task.prompt(pid), completion=text, answer=task.answer(pid), prompt_id=pid
            )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"returned {type(value).__name__}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return float(value)

        return score

    def __call__(self, prompt_id: int, completion: str) -> float:
        """The weighted sum for one completion; never raises for what the completion says."""
        return self.detailed(prompt_id, completion)[0]

    def detailed(self, prompt_id: int, completion: str) -> tuple[float, str]:
        """The weighted sum and ``"ok"``, or ``"scorer_error"`` when a component raised (it
        scored 0)."""
        scores, failed = self._scored(prompt_id, completion)
        total = sum(c.weight * s for c, s in zip(self.components, scores, strict=True))
        return total, ("scorer_error" if failed else "ok")

    def breakdown(self, prompt_id: int, completion: str) -> dict[str, float]:
        """Each component's unweighted score, by label (for logs and tests)."""
        return dict(
            zip(
                (c.label for c in self.components),
                self._scored(prompt_id, completion)[0],
                strict=True,
            )
        )

    def _scored(self, prompt_id: int, completion: str) -> tuple[list[float], bool]:
        out, failed = [], False
        for c in self.components:
            try:
                out.append(float(c.score(prompt_id, completion)))
            except Exception as exc:  # noqa: BLE001 - odd node text must not stop verification
                log.debug("reward %s raised on prompt %d, scored 0: %s", c.label, prompt_id, exc)
                out.append(0.0)
                failed = True
        return out, failed

    def describe(self) -> str:
        """``"1*math#0 + 0.1*format#1"``: what the job is trained on, for logs."""
        return " + ".join(f"{c.weight:g}*{c.label}" for c in self.components)
