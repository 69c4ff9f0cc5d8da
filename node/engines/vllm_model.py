"""The model the vLLM engine serves, as vLLM loads it: a Hugging Face folder of its own.

:class:`HFModel` owns what the engine knows of the model without building its weights: its
transformers config (on the meta device), the tensors a published state must hold (names,
shapes, floating or not; tied tensors once, under their first name) and the check of a state
against them, the KV cache a token takes, whether vLLM's CPU attention can run it, and writing
the folder vLLM starts from (``config.json``, tokenizer files, ``model.safetensors`` in the
published dtypes). Later versions rewrite only ``model.safetensors``, as a temporary file renamed
over the old one, for the workers to reload.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from echo.models.spec import ModelSpec
from echo.models.weights import DTYPES

# The engine's CPU KV cache holds float32 keys and values.
_KV_BYTES = 4


class HFModel:
    """The layout and folder of the model one vLLM engine serves (see the module docstring)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.config = _hf_config(spec)
        self.expected = _expected_meta(self.config)

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token of one sequence takes (keys and values, every layer)."""
        c = self.config
        heads = int(getattr(c, "num_attention_heads", 1))
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        return 2 * int(c.num_hidden_layers) * kv_heads * head_dim * _KV_BYTES

    def check_cpu_head_size(self) -> None:
        """vLLM's CPU attention supports a few head sizes only; say so before it fails deep
        inside its worker. :raises ValueError: this model's is not one of them."""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:
            return
        config = self.config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"vLLM on the CPU supports attention head sizes {sizes}; this model's is "
                f"{head_dim} (hidden {config.hidden_size} / {heads} heads)"
            )

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """:raises ValueError: ``state`` lacks a tensor of the model, has one it does not, or one
        of another shape or not a published float where the model has a float."""
        for name in sorted(self.expected):
            if name not in state:
                raise ValueError(f"state is missing tensor {name!r}")
        for name, t in state.items():
            if name not in self.expected:
                raise ValueError(f"state has unexpected tensor {name!r}")
            shape, floating = self.expected[name]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {shape}"
                )
            if t.is_floating_point() != floating or (floating and t.dtype not in DTYPES.values()):
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not a published float")

    def write(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the whole model folder vLLM starts from, with ``state`` as its weights."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.spec.kind == "tiny":
            self.config.architectures = ["LlamaForCausalLM"]
        self.config.save_pretrained(str(folder))
        from echo.models.spec import load_tokenizer

        # Not read by vLLM (token ids go in and out directly): a complete checkpoint for tools.
        load_tokenizer(self.spec).save_pretrained(str(folder))
        self.write_weights(folder, state)

    def write_weights(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """Replace ``folder``'s ``model.safetensors`` with ``state``, atomically."""
        from safetensors.torch import save_file

        path = folder / "model.safetensors"
        tmp = path.with_suffix(".safetensors.tmp")
        save_file({n: t.contiguous() for n, t in state.items()}, str(tmp), {"format": "pt"})
        os.replace(tmp, path)


def _hf_config(spec: ModelSpec) -> Any:
    """The transformers config of ``spec`` without building its weights."""
    if spec.kind == "hf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    from echo.models.spec import build_model

    with torch.device("meta"):
        return build_model(spec).config


def _expected_meta(config: Any) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (shape, floating) of the state ``export_state`` gives for this config (tied
    tensors once, under their first name)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = (tuple(t.shape), t.is_floating_point())
    return out
