"""reasoning-gym tasks by name: procedural prompts and reasoning-gym's own scorers.

``name = "gym"`` with ``params = { dataset = "basic_arithmetic", ... }``, or
``name = "gym:basic_arithmetic"``. Params other than those of :class:`GymParams` go to the
dataset's own config (``min_terms = 2`` ...); a key the config does not have is an error that
lists the ones it has. Only scalar config values fit a job's params.

Determinism: prompt id ``p`` is item ``p mod CHUNK`` of a dataset built with ``size = CHUNK``
and a seed derived by sha256 from (dataset, params, ``seed``, ``p div CHUNK``). reasoning-gym
generates each item from ``Random(seed + index)``, so a prompt is the same on every machine and
nothing is downloaded. Held-out ids (from ``EVAL_PROMPT_BASE``) fall in chunks no training run
reaches.

Scoring (always in the scoring sandbox on a coordinator, with :mod:`echo.tasks.gym_guards` in
front of the scorers that would run an interpreter): the answer is taken from the completion
first (the last ``<answer>...</answer>`` content, else the last non-empty line;
:func:`echo.tasks.rewards.final_answer`), then given to the dataset's ``score_answer`` with
the item. The default system prompt is reasoning-gym's ``default`` one, which asks for the
answer in those tags.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict
from typing import Any

from pydantic import ConfigDict, Field, model_validator

import echo.tasks.rewards as rw
from echo.tasks.base import Task, TaskParams, check_prompt_id
from echo.tasks.gym_guards import install as install_guards

# Items per generated dataset object: reasoning-gym's own default size.
CHUNK = 500
_CACHED_CHUNKS = 4


def gym_datasets() -> list[str]:
    """Names reasoning-gym registers (importing it registers them)."""
    import reasoning_gym  # noqa: F401 - registers the datasets
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


class GymParams(TaskParams):
    # Extra keys are the dataset's config; checked against it below.
    model_config = ConfigDict(extra="allow", frozen=True)
    dataset: str = Field(min_length=1)
    seed: int = Field(0, ge=0, le=2**31)
    system_prompt: str | None = Field(None, max_length=16384)
    max_new_tokens: int = Field(512, ge=1, le=8192)

    def config(self) -> dict[str, Any]:
        """The dataset config's keys (the params this class does not declare)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _check(self) -> GymParams:
        names = gym_datasets()
        if self.dataset not in names:
            raise ValueError(
                f"unknown reasoning-gym dataset {self.dataset!r} (known: {', '.join(names)})"
            )
        import dataclasses

        from reasoning_gym.factory import DATASETS

        allowed = {f.name for f in dataclasses.fields(DATASETS[self.dataset][1])}
        allowed -= {"seed", "size"}  # owned by this task, see the module doc
        for key in self.config():
            if key not in allowed:
                raise ValueError(
                    f"{key!r} is not a setting of reasoning-gym dataset "
                    f"{self.dataset!r} (settings: {', '.join(sorted(allowed))})"
                )
        return self


class GymTask(Task):
    """A reasoning-gym dataset as a task (see the module doc)."""

    name = "gym"
    Params = GymParams
    params: GymParams

    def __init__(self, params: TaskParams) -> None:
        super().__init__(params)
        self._lock = threading.Lock()
        self._chunks: OrderedDict[int, Any] = OrderedDict()
        # Items handed in by the process that rendered the prompts (see ``scoring_context``).
        self._pinned: dict[int, dict[str, Any]] = {}
        install_guards(self.params.dataset)
        # Building one dataset object validates the config now, not at the first lease.
        self._chunk(0)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    def _chunk(self, chunk: int) -> Any:
        with self._lock:
            ds = self._chunks.get(chunk)
            if ds is not None:
                self._chunks.move_to_end(chunk)
                return ds
        import reasoning_gym

        key = f"{self.params.model_dump_json()}|{chunk}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little") >> 1
        try:
            ds = reasoning_gym.create_dataset(
                self.params.dataset, seed=seed, size=CHUNK, **self.params.config()
            )
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"reasoning-gym dataset {self.params.dataset!r}: {exc}") from None
        with self._lock:
            self._chunks[chunk] = ds
            while len(self._chunks) > _CACHED_CHUNKS:
                self._chunks.popitem(last=False)
        return ds

    def item(self, prompt_id: int) -> tuple[Any, dict[str, Any]]:
        """(dataset object, item) behind ``prompt_id``; TypeError/ValueError for a bad id."""
        check_prompt_id(prompt_id)
        chunk, idx = divmod(prompt_id, CHUNK)
        ds = self._chunk(chunk)
        pinned = self._pinned.get(prompt_id)
        return ds, (pinned if pinned is not None else ds[idx])

    def scoring_context(self, prompt_id: int) -> dict[str, Any]:
        """The item itself: some datasets (polynomial_multiplication) generate other items
        under another hash seed, so a scoring process must not regenerate it."""
        return self.item(prompt_id)[1]

    def pin(self, prompt_id: int, context: Any) -> None:
        if isinstance(context, dict):
            self._pinned[prompt_id] = context

    def prompt(self, prompt_id: int) -> str:
        return str(self.item(prompt_id)[1]["question"])

    def system_prompt(self, prompt_id: int) -> str | None:
        if self.params.system_prompt is not None:
            return self.params.system_prompt
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return SYSTEM_PROMPTS["default"]

    def answer(self, prompt_id: int) -> str:
        return str(self.item(prompt_id)[1]["answer"])

    def reward(self, prompt_id: int, completion: str) -> float:
        ds, entry = self.item(prompt_id)
        return float(ds.score_answer(rw.final_answer(completion), entry))

    def format_example(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(CHUNK), rng.randrange(CHUNK)
        ds = self._chunk(0)
        return str(ds[a]["question"]), f"<answer>{ds[b]['answer']}</answer>"
