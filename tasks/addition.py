"""``a+b=`` with exact-match reward: the smallest task a tiny model visibly learns with GRPO."""

from __future__ import annotations

import random

from pydantic import Field

from echo.tasks.base import Task, TaskParams


class AdditionParams(TaskParams):
    # Operands are drawn from range(max_operand): 10 means single digits 0-9.
    max_operand: int = Field(10, ge=1, le=10**9)
    max_new_tokens: int | None = Field(None, ge=1, le=4096)  # None: answer digits + 2


class Addition(Task):
    """Prompt ``"3+4="``; reward 1.0 iff the stripped completion is the decimal sum."""

    name = "addition"
    Params = AdditionParams
    params: AdditionParams

    @property
    def max_new_tokens(self) -> int:
        if self.params.max_new_tokens is not None:
            return self.params.max_new_tokens
        return len(str(2 * (self.params.max_operand - 1))) + 2

    def _operands(self, prompt_id: int) -> tuple[int, int]:
        rng = self.prompt_rng(prompt_id)
        return rng.randrange(self.params.max_operand), rng.randrange(self.params.max_operand)

    def prompt(self, prompt_id: int) -> str:
        a, b = self._operands(prompt_id)
        return f"{a}+{b}="

    def answer(self, prompt_id: int) -> str:
        a, b = self._operands(prompt_id)
        return str(a + b)

    def reward(self, prompt_id: int, completion: str) -> float:
        return 1.0 if completion.strip() == self.answer(prompt_id) else 0.0

    def format_example(self, rng: random.Random) -> tuple[str, str]:
        m = self.params.max_operand
        a, b = rng.randrange(m), rng.randrange(m)
        # A random number from the range of sums: right shape, no arithmetic.
        return f"{a}+{b}=", str(rng.randrange(2 * m - 1))
