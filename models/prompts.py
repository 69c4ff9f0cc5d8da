"""Prompt ids of a task for one model: the single place a prompt becomes token ids.

The coordinator (training prompts, put in leases) and the learner (held-out evaluation) both
render through :class:`PromptRenderer`, so every engine and the learner see the same ids for a
prompt id. Whether the chat template applies is decided once per job from ``[job.task] chat``
(:func:`echo.models.spec.use_chat_template`) and logged, so a job that falls back to plain text
says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from echo.models.spec import ChatMode, ModelSpec, encode_prompt, use_chat_template

log = logging.getLogger(__name__)


class PromptSource(Protocol):
    """What rendering needs of a task (``echo.tasks.base.Task`` is one)."""

    def prompt(self, prompt_id: int) -> str:
        """The prompt text."""

    def system_prompt(self, prompt_id: int) -> str | None:
        """The system prompt, or None."""


@dataclass(frozen=True)
class PromptRenderer:
    """``ids(prompt_id)``: the task's prompt (and system prompt) as the model's token ids."""

    spec: ModelSpec
    task: PromptSource
    tokenizer: Any
    chat: bool

    @classmethod
    def for_job(
        cls, spec: ModelSpec, task: PromptSource, tokenizer: Any, mode: ChatMode, job: str = ""
    ) -> PromptRenderer:
        """Resolve ``mode`` for this model and log the outcome once.

        :raises ValueError: ``mode = "always"`` for a model without a chat template.
        """
        chat = use_chat_template(spec, tokenizer, mode)
        if chat:
            log.info("job %s: prompts use the model's chat template", job)
        elif spec.kind == "hf" and mode == "auto":
            log.warning(
                "job %s: the tokenizer at %s has no chat template; prompts are plain text",
                job,
                spec.path,
            )
        else:
            log.info("job %s: prompts are plain text (chat = %r, model %s)", job, mode, spec.kind)
        return cls(spec, task, tokenizer, chat)

    @property
    def prompt_format(self) -> str:
        """``"chat template"`` or ``"plain text"``: what a job status shows."""
        return "chat template" if self.chat else "plain text"

    def ids(self, prompt_id: int) -> list[int]:
        """Token ids of prompt ``prompt_id`` (raises what the task raises for a bad id)."""
        return encode_prompt(
            self.spec,
            self.task.prompt(prompt_id),
            self.tokenizer,
            system=self.task.system_prompt(prompt_id),
            chat=self.chat,
        )
