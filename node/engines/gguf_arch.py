"""Which Hugging Face architectures the GGUF export writes, as a table: one :class:`ArchRule` each.

The tensor names come from gguf-py's ``TensorNameMap`` (maintained in the llama.cpp repository
beside ``convert_hf_to_gguf.py``), so a rule only says what differs from plain Llama in how
llama.cpp's graph for that architecture reads the weights and hyper-parameters, as the official
converter does it:

- ``permute_qk``: llama.cpp's ``llama`` graph rotates adjacent pairs where transformers rotates
  halves (``rotate_half``), so Q/K rows are permuted (a bit-exact reordering).
- ``norm_shift``: Gemma's RMSNorm multiplies by ``1 + w``; llama.cpp by ``w``, so the converter
  stores ``w + 1`` (computed in float32, as transformers computes it).
- ``swa_pattern``: the layers llama.cpp runs with sliding-window attention are fixed by
  architecture (layer ``i`` slides iff ``(i + 1) % pattern != 0``); a config whose
  ``layer_types`` differ is refused. Architectures without it that still declare a window
  (Mistral, Phi-3) are run with the context capped at the window, where both agree.
- ``extra``: hyper-parameters only this architecture writes (soft-capping, the window).
- ``rope_types``: the RoPE scalings llama.cpp's graph reproduces; Llama 3's (``llama3``) is a
  constant ``rope_freqs`` tensor of per-frequency divisors (:func:`constant_tensors`).

:func:`rule_for` returns the rule of a config after :meth:`ArchRule.check` refuses what llama.cpp
would compute differently, raising :class:`UnsupportedArchitecture` with one line that says why.
Adding an architecture is a new entry in :data:`RULES` (plus its test in
``tests/node/test_gguf_architectures.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class UnsupportedArchitecture(NotImplementedError):
    """The model cannot be run exactly by llama.cpp through this export; the message says why
    in one line (a node falls back to the torch engine on it)."""


def rope_of(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of ``config`` (transformers 5 ``rope_parameters``, older
    ``rope_scaling`` + ``rope_theta``), for ``layer_type`` where they are given per layer type."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    out = dict(rope)
    out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_type", out.get("type", "default"))
    return out


def _gemma_scale_check(config: Any, big_layers: int) -> None:
    """llama.cpp scales Gemma's queries by 1/sqrt(head_dim), except in the largest model
    (``big_layers`` blocks), where it uses 1/sqrt(hidden / heads)."""
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    want = config.hidden_size // heads if layers == big_layers else config.head_dim
    if int(config.query_pre_attn_scalar) != int(want):
        raise UnsupportedArchitecture(
            f"query_pre_attn_scalar {config.query_pre_attn_scalar} differs from the {want} "
            "llama.cpp uses for this size"
        )


def _gemma2_extra(config: Any) -> list[tuple[str, Any]]:
    _gemma_scale_check(config, big_layers=46)
    caps = (config.attn_logit_softcapping, config.final_logit_softcapping)
    if None in caps:
        # llama.cpp's gemma2 graph always soft-caps (defaults 50 and 30).
        raise UnsupportedArchitecture(
            "gemma2 without logit soft-capping is not what llama.cpp runs"
        )
    return [
        ("add_attn_logit_softcapping", float(caps[0])),
        ("add_final_logit_softcapping", float(caps[1])),
        ("add_sliding_window", int(config.sliding_window)),
    ]


def _gemma3_extra(config: Any) -> list[tuple[str, Any]]:
    _gemma_scale_check(config, big_layers=62)
    if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
        raise UnsupportedArchitecture("gemma3 with logit soft-capping is not what llama.cpp runs")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture("gemma3 with bidirectional attention is an embedding model")
    local = rope_of(config, "sliding_attention")
    # llama.cpp hard-codes the sliding layers' RoPE base of Gemma 3.
    if local["rope_type"] != "default" or float(local["rope_theta"]) != 10000.0:
        raise UnsupportedArchitecture(
            f"gemma3 sliding-layer RoPE {local['rope_type']} base {local['rope_theta']} "
            "differs from llama.cpp's default 10000"
        )
    return [("add_sliding_window", int(config.sliding_window))]


@dataclass(frozen=True)
class ArchRule:
    """How one transformers ``model_type`` becomes a llama.cpp GGUF (see the module docstring)."""

    gguf_arch: str
    act: str = "silu"
    permute_qk: bool = False
    norm_shift: float = 0.0
    swa_pattern: int = 0
    qkv_bias: bool | None = None  # True: required, False: refused, None: optional
    rope_layer_type: str | None = None
    rope_types: tuple[str, ...] = ("default",)
    extra: Callable[[Any], list[tuple[str, Any]]] = field(default=lambda config: [])

    def check(self, config: Any) -> None:
        """Raise :class:`UnsupportedArchitecture` for a feature llama.cpp would run otherwise."""
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act != self.act:
            raise UnsupportedArchitecture(f"activation {act!r} (llama.cpp's graph uses {self.act})")
        rope = rope_of(config, self.rope_layer_type)
        if rope["rope_type"] not in self.rope_types:
            raise UnsupportedArchitecture(f"RoPE scaling {rope['rope_type']!r} is not exported")
        if getattr(config, "mlp_bias", False):
            raise UnsupportedArchitecture("MLP biases are not exported")
        bias = bool(getattr(config, "attention_bias", False))
        if self.qkv_bias is False and bias:
            raise UnsupportedArchitecture(f"{self.gguf_arch} with attention biases")
        if getattr(config, "use_sliding_window", False) and not self.swa_pattern:
            raise UnsupportedArchitecture(f"{self.gguf_arch} with sliding-window attention")
        if self.swa_pattern:
            n = self.swa_pattern
            want = [
                "sliding_attention" if (i + 1) % n else "full_attention"
                for i in range(int(config.num_hidden_layers))
            ]
            if list(getattr(config, "layer_types", want)) != want:
                raise UnsupportedArchitecture(
                    f"layer_types differ from llama.cpp's {self.gguf_arch} pattern (every "
                    f"{n}th layer global)"
                )
        self.extra(config)  # validates what only this architecture writes

    def context_length(self, config: Any) -> int:
        """The longest sequence llama.cpp computes as transformers does: the trained context,
        capped at a sliding window that llama.cpp's graph for this architecture does not apply."""
        ctx = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        if window and not self.swa_pattern:
            ctx = min(ctx, int(window))
        return ctx


# transformers model_type -> rule. Mistral is a Llama graph in llama.cpp (as in the converter).
RULES: dict[str, ArchRule] = {
    "llama": ArchRule("llama", permute_qk=True, rope_types=("default", "llama3")),
    "mistral": ArchRule("llama", permute_qk=True, qkv_bias=False),
    "qwen2": ArchRule("qwen2", qkv_bias=True),
    "qwen3": ArchRule("qwen3", qkv_bias=False),
    "gemma2": ArchRule(
        "gemma2",
        act="gelu_pytorch_tanh",
        norm_shift=1.0,
        swa_pattern=2,
        qkv_bias=False,
        extra=_gemma2_extra,
    ),
    "gemma3_text": ArchRule(
        "gemma3",
        act="gelu_pytorch_tanh",
        norm_shift=1.0,
        swa_pattern=6,
        qkv_bias=False,
        rope_layer_type="full_attention",
        extra=_gemma3_extra,
    ),
    "phi3": ArchRule("phi3", qkv_bias=False),
}


def rule_for(config: Any) -> ArchRule:
    """The checked :class:`ArchRule` of a transformers config; :class:`UnsupportedArchitecture`
    (one line naming the model type and the reason) when llama.cpp cannot run it exactly."""
    model_type = getattr(config, "model_type", None)
    rule = RULES.get(str(model_type))
    if rule is None:
        names = ", ".join(sorted(RULES))
        raise UnsupportedArchitecture(
            f"llama.cpp export does not support {model_type!r} models (supported: {names})"
        )
    try:
        rule.check(config)
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(f"{model_type}: {exc}") from None
    return rule


def constant_tensors(rope: dict[str, Any], rope_dims: int) -> list[tuple[str, np.ndarray]]:
    """Tensors llama.cpp needs that are not weights (never patched): for Llama 3's RoPE scaling,
    ``rope_freqs.weight``, the factor each inverse frequency is divided by, computed as
    transformers' ``_compute_llama3_parameters`` scales them."""
    if rope["rope_type"] != "llama3":
        return []
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_ctx = float(rope["original_max_position_embeddings"])
    base = float(rope["rope_theta"])
    factors = []
    for i in range(0, rope_dims, 2):
        wavelen = 2 * math.pi * base ** (i / rope_dims)
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return [("rope_freqs.weight", np.asarray(factors, dtype=np.float32))]
