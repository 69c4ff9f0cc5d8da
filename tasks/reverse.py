"""``rev abc=`` -> ``cba``: a string task with partial credit per character position."""

from __future__ import annotations

import random
import string

from pydantic import Field, model_validator

from echo.tasks.base import Task, TaskParams


class ReverseParams(TaskParams):
    min_len: int = Field(3, ge=1, le=256)
    max_len: int = Field(6, ge=1, le=256)
    max_new_tokens: int | None = Field(None, ge=1, le=4096)  # None: max_len + 2

    @model_validator(mode="after")
    def _check(self) -> ReverseParams:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) exceeds max_len ({self.max_len})")
        return self


def _word(rng: random.Random, params: ReverseParams) -> str:
    n = rng.randint(params.min_len, params.max_len)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


class Reverse(Task):
    """Prompt ``"rev abc="``; reward = characters in the right position of the stripped completion
    over max(len(answer), len(completion)), so extra or missing characters cost."""

    name = "reverse"
    Params = ReverseParams
    params: ReverseParams

    @property
    def max_new_tokens(self) -> int:
        if self.params.max_new_tokens is not None:
            return self.params.max_new_tokens
        return self.params.max_len + 2

    def _word(self, prompt_id: int) -> str:
        return _word(self.prompt_rng(prompt_id), self.params)

    def prompt(self, prompt_id: int) -> str:
        return f"rev {self._word(prompt_id)}="

    def answer(self, prompt_id: int) -> str:
        return self._word(prompt_id)[::-1]

    def reward(self, prompt_id: int, completion: str) -> float:
        answer = self.answer(prompt_id)
        got = completion.strip()
        right = sum(1 for x, y in zip(answer, got, strict=False) if x == y)
        return right / max(len(answer), len(got))

    def format_example(self, rng: random.Random) -> tuple[str, str]:
        word = _word(rng, self.params)
        noise = "".join(rng.choice(string.ascii_lowercase) for _ in word)
        return f"rev {word}=", noise
