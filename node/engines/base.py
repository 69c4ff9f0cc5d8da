"""The engine interface every rollout backend (torch, llama.cpp, vLLM) implements.

Log-prob convention, shared with ``GRPOLearner.score``: the log-prob reported for a sampled token is
``log_softmax(logits / temperature)[token]`` over the full vocabulary, taken BEFORE top-p
truncation. It is what the learner can recompute from the weights alone, so it serves both as the
behaviour policy for importance sampling and as the quantity the coordinator re-scores. With
temperature 0 (greedy) the raw ``log_softmax(logits)`` is reported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``seed`` None draws a fresh one; ``temperature`` 0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")


@dataclass(frozen=True)
class GenRequest:
    """``n`` samples continuing the token ids ``prompt_ids`` (one GRPO group)."""

    prompt_ids: list[int]
    n: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, not {self.n}")


@dataclass
class Completion:
    """Generated token ids (EOS included when it stopped there), the log-prob of each under the
    convention above, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Engine(ABC):
    """A rollout backend holding one set of weights at a time."""

    name: str
    # tokens, seconds and tokens_per_s of the last generate() call; set by each engine.
    last_stats: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the last :meth:`generate` call."""
        return self.last_stats["tokens_per_s"]

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """For each request, its ``n`` completions, in order."""

    @abstractmethod
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the weights with ``state`` (an ``echo.models.weights`` state)."""

    def close(self) -> None:
        """Release what the engine holds outside this process's memory (worker processes,
        temporary files). Idempotent; the default holds nothing of the kind."""
        return None

    # What a LoRA job's node reports it samples from: ``echo.models.lora.lora_digest`` of the
    # base and adapter the engine holds, computed from its own weights when it loaded them (the
    # base alone gives the digest of no adapter). "" until an engine serves an adapter job.
    lora_served: str = ""

    def holds_base(self, base_digest: str) -> bool:
        """Whether the engine holds the base model of state digest ``base_digest`` (so that a
        LoRA version of it needs only its adapter)."""
        return False

    def load_adapter(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> None:
        """Serve LoRA ``adapter`` (``ref``: its ``messages.AdapterRef``) on the base model whose
        state digest is ``ref.base_digest``: ``base`` is that base's state, or None when the
        engine holds it already, so that switching adapters loads no model.

        :raises NotImplementedError: this engine serves no adapters.
        :raises ValueError: no ``base`` and another one held, or tensors that do not fit.
        """
        raise NotImplementedError(f"the {self.name} engine does not serve LoRA adapters")

    @abstractmethod
    def state_digest(self) -> str:
        """``echo.models.weights.state_digest`` of the weights the engine holds now, computed from
        them (not remembered): equal to the learner's digest iff the weights are bit-identical."""
