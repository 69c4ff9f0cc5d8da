"""Which tensors a GGUF holds, under which names, in which shapes, precisions and transforms.

:func:`layout_of` reads a :class:`ModelSpec` or a transformers config into a :class:`GGUFLayout`:
the hyper-parameters llama.cpp needs and one :class:`TensorSlot` per state tensor. The state's
tensor names and shapes are those of the model itself, built from its config on the meta device
(no weights allocated), with tied tensors once, as ``echo.models.weights.export_state`` gives
them. Each name is mapped to llama.cpp's by gguf-py's ``TensorNameMap`` (maintained in the
llama.cpp repository with its converter); what differs per architecture is the table of
:mod:`echo.node.engines.gguf_arch`, whose :class:`UnsupportedArchitecture` says in one line why a
model cannot be exported.

Matrices are stored in the precision they were published in (F32, F16 or BF16, never quantized,
so a weight patch stays exact); 1-D tensors (norms, biases) as F32, as the official converter does
(:func:`storage_dtype`). Transforms are the converter's: a Q/K row permutation (exact) and
Gemma's norm shift ``w + 1`` in float32 (see :mod:`echo.node.engines.gguf_file` for how it is
read back exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from echo.models.spec import ModelSpec
from echo.models.weights import dtype_name
from echo.node.engines.gguf_arch import (
    UnsupportedArchitecture,
    constant_tensors,
    rope_of,
    rule_for,
)

# ggml type ids (ggml.h) of the float types we write; nothing quantized.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_BY_DTYPE = {"float32": GGML_F32, "float16": GGML_F16, "bfloat16": GGML_BF16}

__all__ = [
    "GGML_BY_DTYPE",
    "GGUFLayout",
    "TensorSlot",
    "UnsupportedArchitecture",
    "check_state",
    "expected_tensors",
    "layout_of",
    "storage_dtype",
]


@dataclass(frozen=True)
class TensorSlot:
    """Where one state tensor goes: its GGUF name, its (torch-order) shape, the number of heads
    its rows are permuted over (None: not permuted) and the value added to it in float32
    (Gemma's norms: 1.0; 0.0: stored as is)."""

    gguf_name: str
    shape: tuple[int, ...]
    permute_heads: int | None = None
    shift: float = 0.0


@dataclass(frozen=True, eq=False)
class GGUFLayout:
    """What a GGUF of one model holds: llama.cpp's architecture name, the hyper-parameters every
    architecture writes, ``extra`` ones (GGUFWriter method name, value), the tensor slots, and
    ``constants``: tensors that are not weights (GGUF name, float32 array; never patched)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    intermediate: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    extra: tuple[tuple[str, Any], ...]
    slots: Mapping[str, TensorSlot]
    constants: tuple[tuple[str, Any], ...] = ()

    @property
    def tied(self) -> bool:
        """Whether the output projection is the token embedding (no ``lm_head`` tensor)."""
        return "lm_head.weight" not in self.slots


def layout_of(model: ModelSpec | GGUFLayout | Any) -> GGUFLayout:
    """The :class:`GGUFLayout` of a :class:`ModelSpec` or a transformers ``PretrainedConfig``
    (a :class:`GGUFLayout` is returned as it is).

    Raises :class:`UnsupportedArchitecture` (a NotImplementedError) for architectures or
    features llama.cpp would not compute as transformers does; the message is one line.
    """
    if isinstance(model, GGUFLayout):
        return model
    config = _config_of(model) if isinstance(model, ModelSpec) else model
    rule = rule_for(config)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = rope_of(config, rule.rope_layer_type)
    partial = float(
        rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    names = _state_shapes(config)
    import gguf

    tmap = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[rule.gguf_arch.upper()], config.num_hidden_layers
    )
    slots: dict[str, TensorSlot] = {}
    for name, shape in names.items():
        gguf_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UnsupportedArchitecture(
                f"{config.model_type}: tensor {name!r} has no place in llama.cpp's "
                f"{rule.gguf_arch} graph"
            )
        permute = None
        if rule.permute_qk:
            proj = name.rsplit(".", 2)[-2]  # "...self_attn.q_proj.weight" -> "q_proj"
            permute = {"q_proj": heads, "k_proj": kv_heads}.get(proj)
        shift = rule.norm_shift if name.endswith("norm.weight") else 0.0
        slots[name] = TensorSlot(gguf_name, shape, permute, shift)
    return GGUFLayout(
        arch=rule.gguf_arch,
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rope_dims=int(head_dim * partial),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        context_length=rule.context_length(config),
        rms_eps=float(config.rms_norm_eps),
        rope_theta=float(rope["rope_theta"]),
        extra=tuple(rule.extra(config)),
        slots=slots,
        constants=tuple(constant_tensors(rope, int(head_dim * partial))),
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


def _state_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``export_state`` gives for a model of ``config`` (tied
    tensors once, under their first name), from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    out: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = tuple(t.shape)
    return dict(sorted(out.items()))


def expected_tensors(layout: GGUFLayout) -> dict[str, TensorSlot]:
    """State name (transformers) -> :class:`TensorSlot`, for every tensor the state must hold."""
    return dict(layout.slots)


def check_state(layout: GGUFLayout, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSlot]:
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
