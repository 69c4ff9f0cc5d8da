"""Tiny random Hugging Face checkpoints of each architecture the GGUF export claims, saved as
folders with the byte tokenizer, so the engines load them exactly as they load a real model.

Weights are drawn wider than transformers' default initialisation (and norm weights are not left
at their constant init), so distributions are peaked and the per-architecture transforms (Q/K
permutation, Gemma's ``1 + w`` norms, soft-capping) visibly change log-probs when wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from echo.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, byte_tokenizer

# Shared by every config: 2 KV heads under 4 query heads (GQA), head size 16.
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

# name -> (transformers config class, overrides). Sliding windows are smaller than the test
# sequences where llama.cpp applies them (Gemma), so the window is exercised.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # Llama 3.1/3.2's RoPE scaling (a rope_freqs tensor in the GGUF), with an original context
    # shorter than the test sequences so the scaled frequencies matter.
    "llama3_rope": (
        "LlamaConfig",
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "num_hidden_layers": 6},
    ),
    "phi3": ("Phi3Config", {}),
}


def make_config(arch: str, **over: Any) -> Any:
    """The transformers config of a tiny model of ``arch`` (a key of :data:`ARCHS`)."""
    import transformers

    cls_name, extra = ARCHS[arch]
    return getattr(transformers, cls_name)(**{**COMMON, **extra, **over})


def save_model_folder(config: Any, path: Path, seed: int = 0) -> Path:
    """A random model of ``config`` with widened weights saved at ``path`` (safetensors, config,
    byte tokenizer); returns ``path``."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
        # Gemma's norms multiply by 1 + w, the others by w: centre both on a gain of 1.
        gain = 0.0 if config.model_type.startswith("gemma") else 1.0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p) * 0.3 + (gain if "norm" in name else 0.0))
                else:
                    p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
