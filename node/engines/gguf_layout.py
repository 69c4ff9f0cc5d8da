"""Which tensors a Llama-family GGUF holds, under which names, in which shapes and precisions.

:func:`layout_of` reads the hyper-parameters llama.cpp needs from a :class:`ModelSpec` or a
transformers config, for the Llama family only:

- ``llama``: ``LlamaForCausalLM`` (the tiny model, Llama 2/3-style checkpoints with default RoPE;
  optional attention biases). Q and K rows get the official converter's permutation, because
  transformers rotates halves of each head (``rotate_half``) where llama.cpp's ``llama`` graph
  rotates adjacent pairs.
- ``qwen2``: ``Qwen2ForCausalLM`` (Q/K/V biases). llama.cpp runs it with NEOX RoPE, the layout
  transformers uses, so nothing is permuted.

:func:`expected_tensors` maps each state tensor (transformers name) to its GGUF name, shape and
permutation; :func:`check_state` refuses a state that does not match before anything is written.
Matrices are stored in the precision they were published in (F32, F16 or BF16, never quantized,
so a weight patch stays exact); 1-D tensors (norms, biases) as F32, as the official converter does
(:func:`storage_dtype`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from echo.models.spec import ModelSpec
from echo.models.weights import dtype_name

# ggml type ids (ggml.h) of the float types we write; nothing quantized.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_BY_DTYPE = {"float32": GGML_F32, "float16": GGML_F16, "bfloat16": GGML_BF16}


@dataclass(frozen=True)
class LlamaLayout:
    """The hyper-parameters a Llama-family GGUF needs, from a :class:`ModelSpec` or HF config."""

    arch: Literal["llama", "qwen2"]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    o_bias: bool


def layout_of(model: ModelSpec | LlamaLayout | Any) -> LlamaLayout:
    """The :class:`LlamaLayout` of a :class:`ModelSpec` or a transformers ``PretrainedConfig``
    (a :class:`LlamaLayout` is returned as it is).

    Raises NotImplementedError for architectures or features this exporter does not write
    (model types other than llama/qwen2, RoPE scaling, MLP biases, sliding windows).
    """
    if isinstance(model, LlamaLayout):
        return model
    config = _config_of(model) if isinstance(model, ModelSpec) else model
    model_type = getattr(config, "model_type", None)
    if model_type not in ("llama", "qwen2"):
        raise NotImplementedError(
            f"GGUF export supports llama and qwen2 models, not {model_type!r}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported by the GGUF export")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "mlp_bias", False):
        raise NotImplementedError("MLP biases are not supported by the GGUF export")
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported by the GGUF export")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    return LlamaLayout(
        arch=model_type,
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        context_length=int(config.max_position_embeddings),
        rms_eps=float(config.rms_norm_eps),
        rope_theta=float(theta),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
    )


def _config_of(spec: ModelSpec) -> Any:
    """The transformers config of ``spec``: read from disk for ``hf``; for ``tiny`` the config
    ``build_model`` makes, built on the meta device so no weights are allocated."""
    if spec.kind == "hf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    from echo.models.spec import build_model

    with torch.device("meta"):
        return build_model(spec).config


@dataclass(frozen=True)
class TensorSlot:
    """Where one state tensor goes: its GGUF name, its (torch-order) shape, and the number of
    heads its rows are permuted over (None: not permuted)."""

    gguf_name: str
    shape: tuple[int, ...]
    permute_heads: int | None = None


def expected_tensors(layout: LlamaLayout) -> dict[str, TensorSlot]:
    """State name (transformers) -> :class:`TensorSlot`, for every tensor the state must hold."""
    h, hd, ff = layout.hidden, layout.head_dim, layout.intermediate
    q_rows, kv_rows = layout.heads * hd, layout.kv_heads * hd
    # Only the llama graph needs the rotate-half -> pairs permutation (see the module docstring).
    pq = layout.heads if layout.arch == "llama" else None
    pk = layout.kv_heads if layout.arch == "llama" else None
    out = {
        "model.embed_tokens.weight": TensorSlot("token_embd.weight", (layout.vocab, h)),
        "model.norm.weight": TensorSlot("output_norm.weight", (h,)),
    }
    if not layout.tied:
        out["lm_head.weight"] = TensorSlot("output.weight", (layout.vocab, h))
    for i in range(layout.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[p + "input_layernorm.weight"] = TensorSlot(b + "attn_norm.weight", (h,))
        out[p + "self_attn.q_proj.weight"] = TensorSlot(b + "attn_q.weight", (q_rows, h), pq)
        out[p + "self_attn.k_proj.weight"] = TensorSlot(b + "attn_k.weight", (kv_rows, h), pk)
        out[p + "self_attn.v_proj.weight"] = TensorSlot(b + "attn_v.weight", (kv_rows, h))
        out[p + "self_attn.o_proj.weight"] = TensorSlot(b + "attn_output.weight", (h, q_rows))
        if layout.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = TensorSlot(b + "attn_q.bias", (q_rows,), pq)
            out[p + "self_attn.k_proj.bias"] = TensorSlot(b + "attn_k.bias", (kv_rows,), pk)
            out[p + "self_attn.v_proj.bias"] = TensorSlot(b + "attn_v.bias", (kv_rows,))
        if layout.o_bias:
            out[p + "self_attn.o_proj.bias"] = TensorSlot(b + "attn_output.bias", (h,))
        out[p + "post_attention_layernorm.weight"] = TensorSlot(b + "ffn_norm.weight", (h,))
        out[p + "mlp.gate_proj.weight"] = TensorSlot(b + "ffn_gate.weight", (ff, h))
        out[p + "mlp.up_proj.weight"] = TensorSlot(b + "ffn_up.weight", (ff, h))
        out[p + "mlp.down_proj.weight"] = TensorSlot(b + "ffn_down.weight", (h, ff))
    return out


def check_state(layout: LlamaLayout, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSlot]:
    """Validate ``state`` against ``layout``; return :func:`expected_tensors`.

    Raises ValueError naming the first missing, unexpected, mis-shaped or non-float (F32/F16/BF16)
    tensor; nothing is written before this passes.
    """
    slots = expected_tensors(layout)
    for name in sorted(slots):
        if name not in state:
            raise ValueError(f"state is missing tensor {name!r}")
    for name in sorted(state):
        if name not in slots:
            raise ValueError(f"state has unexpected tensor {name!r}")
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != slots[name].shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {slots[name].shape}"
            )
        if dtype_name(t.dtype) not in GGML_BY_DTYPE:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype_name(t.dtype)}; "
                f"GGUF export takes {sorted(GGML_BY_DTYPE)}"
            )
    return slots


def storage_dtype(published: str, ndim: int, override: str | None) -> str:
    """The dtype a tensor is stored in: F32 for 1-D tensors, else ``override`` or as published."""
    if ndim <= 1:
        return "float32"
    return override or published

