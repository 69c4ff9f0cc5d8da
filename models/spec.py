"""Which model a job trains, as data: :class:`ModelSpec`, and how to build it and its tokenizer.

Two kinds:

- ``tiny``: a small ``LlamaForCausalLM`` with random weights over the byte vocabulary of
  :mod:`echo.models.tokenizer`. Needs no files, so every test and CPU demo uses it.
- ``hf``: a local Hugging Face checkpoint directory (``local_files_only``: nothing is downloaded).

A spec travels in job descriptions and in the warm-up cache key, so it is strict (unknown fields are
an error) and round-trips through :meth:`ModelSpec.to_dict` / :meth:`ModelSpec.from_dict`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from echo.models.tokenizer import decode as byte_decode
from echo.models.tokenizer import encode as byte_encode


class ModelSpec(BaseModel):
    """A model reference. Fields other than ``kind`` and ``path`` only apply to ``tiny``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tiny", "hf"] = "tiny"
    hidden: int = Field(64, ge=8, le=8192)
    layers: int = Field(2, ge=1, le=128)
    heads: int = Field(4, ge=1, le=256)
    kv_heads: int | None = Field(None, ge=1, le=256)  # None: same as heads (no GQA)
    intermediate: int | None = Field(None, ge=8, le=65536)  # None: 4 * hidden
    max_position: int = Field(128, ge=8, le=1 << 20)
    vocab: int = Field(VOCAB_SIZE, ge=VOCAB_SIZE, le=1 << 20)
    tie_embeddings: bool = False
    path: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.kind == "hf":
            if not self.path:
                raise ValueError("a 'hf' model spec needs 'path' (a local checkpoint directory)")
        else:
            if self.path is not None:
                raise ValueError("'path' is only for kind 'hf'")
            if self.hidden % self.heads:
                raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads})")
            if self.heads % self.num_kv_heads:
                raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads")
        return self

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def intermediate_size(self) -> int:
        return self.intermediate if self.intermediate is not None else 4 * self.hidden

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the fields that matter for the kind."""
        if self.kind == "hf":
            return {"kind": "hf", "path": self.path}
        return self.model_dump(exclude={"path"})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Validate ``data`` (raises ``pydantic.ValidationError``, a ValueError, on bad input)."""
        return cls.model_validate(data)


def build_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """A float32 causal LM in eval mode. ``tiny`` weights depend only on ``seed`` (the global RNG
    is left untouched); ``hf`` weights come from ``spec.path``."""
    if spec.kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            spec.path, local_files_only=True, dtype=torch.float32
        )
        return model.eval()

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=spec.tie_embeddings,
        dtype=torch.float32,
    )
    # fork_rng: initialise from our seed without disturbing the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def load_tokenizer(spec: ModelSpec) -> Any:
    """The transformers tokenizer of the model (``tiny``: the in-memory byte tokenizer)."""
    if spec.kind == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    from echo.models.tokenizer import byte_tokenizer

    return byte_tokenizer()


def eos_token_id(spec: ModelSpec) -> int:
    """The id generation stops at. For ``hf`` checkpoints listing several, the first one."""
    if spec.kind == "tiny":
        return EOS_ID
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(spec.path, local_files_only=True).eos_token_id
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    if eos is None:
        eos = load_tokenizer(spec).eos_token_id
    if eos is None:
        raise ValueError(f"model at {spec.path!r} defines no EOS token")
    return int(eos)


ChatMode = Literal["auto", "always", "never"]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (the byte tokenizer does not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(spec: ModelSpec, tokenizer: Any, mode: ChatMode) -> bool:
    """Resolve a job's ``[job.task] chat`` setting for this model.

    ``auto``: the template when the tokenizer has one; ``always``: the template, and an error
    without one; ``never``: plain text. The ``tiny`` byte model has no template.

    :raises ValueError: ``always`` for a model without a chat template, or an unknown mode.
    """
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"chat must be 'auto', 'always' or 'never', not {mode!r}")
    has = spec.kind == "hf" and has_chat_template(tokenizer)
    if mode == "always" and not has:
        where = "the tiny byte model" if spec.kind == "tiny" else f"the tokenizer at {spec.path}"
        raise ValueError(f"task.chat = 'always' but {where} has no chat template")
    return has and mode != "never"


def encode_prompt(
    spec: ModelSpec,
    text: str,
    tokenizer: Any = None,
    *,
    system: str | None = None,
    chat: bool = False,
) -> list[int]:
    """Token ids of a prompt as every engine and the learner see it.

    Plain text (``chat`` False): the model's BOS, then the text, with ``system`` (if any) and a
    blank line before it. ``tiny`` uses the pure byte encoder (no tokenizer object needed).

    Chat (``chat`` True, ``hf`` only): the tokenizer's chat template rendered over
    ``[system?, user]`` with ``add_generation_prompt=True``, then tokenized without adding
    special tokens again (the template writes BOS itself where the model wants one).

    :raises ValueError: an ``hf`` spec without its tokenizer, or ``chat`` without a template.
    """
    if not chat:
        if system:
            text = f"{system}\n\n{text}"
        if spec.kind == "tiny":
            return byte_encode(text, add_bos=True)
        if tokenizer is None:
            raise ValueError("encode_prompt for an 'hf' spec needs its tokenizer")
        return list(tokenizer(text).input_ids)
    if tokenizer is None or not has_chat_template(tokenizer):
        raise ValueError("encode_prompt with chat=True needs a tokenizer with a chat template")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def decode_completion(spec: ModelSpec, ids: list[int], tokenizer: Any = None) -> str:
    """Text of generated ids without special tokens (what a task's reward reads)."""
    if spec.kind == "tiny":
        return byte_decode(ids)
    if tokenizer is None:
        raise ValueError("decode_completion for an 'hf' spec needs its tokenizer")
    return tokenizer.decode(ids, skip_special_tokens=True)
