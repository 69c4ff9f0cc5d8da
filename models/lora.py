"""LoRA adapters on a policy: injecting them (``peft``), their states, and what identifies them.

A LoRA job's model is a base model, fixed for the whole job, with a low-rank adapter on some
projections: ``W x + (alpha / r) B A x``. The learner trains the adapter alone; what a version
publishes is the *adapter state* (:func:`adapter_state`: ``peft``'s names, such as
``model.layers.0.self_attn.q_proj.lora_A.weight``), and the base is published once, as the
*base state* (:func:`base_state`: the plain model's names, as ``export_state`` gives them).

Learner, re-scorer and the torch engine all run the same ``peft`` LoRA layers, so their
log-probs are one function. What a node serves is identified by :func:`lora_digest` of the base's
state digest and the adapter's: a node holding the base alone, or a stale adapter, reports a
digest the coordinator refuses (``wrong_weights``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from echo.models.weights import DTYPES, state_digest

# peft names an adapter's tensors ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``.
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")
_BASE_LAYER = ".base_layer."
# Seed offset for the adapter's A matrices: independent of the base model's initialisation.
_ADAPTER_SEED_OFFSET = 0x10A


@dataclass(frozen=True)
class LoraShape:
    """What an adapter is: rank, scaling and the projections it wraps (job spec or manifest)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_name(name: str) -> bool:
    """Whether tensor ``name`` belongs to an adapter (as opposed to the base model)."""
    return any(part in name for part in _ADAPTER_PARTS)


def split_state(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``state`` as (base tensors, adapter tensors), by name."""
    base = {n: t for n, t in state.items() if not is_adapter_name(n)}
    adapter = {n: t for n, t in state.items() if is_adapter_name(n)}
    return base, adapter


def lora_digest(base_digest: str, adapter: Mapping[str, torch.Tensor] | None) -> str:
    """The identity of base + adapter: sha256 over the base's state digest and the adapter's
    (``None``: no adapter loaded, which is never a published version's digest)."""
    adapter_digest = "" if adapter is None else state_digest(adapter)
    entries = ["lora", base_digest, adapter_digest]
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def inject(model: torch.nn.Module, shape: LoraShape, seed: int = 0) -> torch.nn.Module:
    """Wrap ``model``'s target projections with a LoRA adapter (in place; returned too): A drawn
    from ``seed`` (the caller's random stream left untouched), B = 0, so the model still computes
    what the base does. Every base weight is frozen; only the adapter trains.

    :raises ValueError: a target module the model does not have.
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=shape.rank,
        lora_alpha=shape.alpha,
        lora_dropout=0.0,
        target_modules=list(shape.target_modules),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _ADAPTER_SEED_OFFSET)
        inject_adapter_in_model(config, model)
    wrapped = {
        n.removesuffix(".lora_A").rsplit(".", 1)[-1]
        for n, _ in model.named_modules()
        if n.endswith(".lora_A")
    }
    missing = set(shape.target_modules) - wrapped
    if missing:
        raise ValueError(f"the model has no module named {', '.join(sorted(missing))}")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name.replace(".default.", ".")))
    return model


def adapter_state(model: torch.nn.Module, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names, cast to ``dtype``, copied to the CPU,
    sorted by name (they never alias the live parameters)."""
    from peft import get_peft_model_state_dict

    target = DTYPES[dtype]
    with torch.no_grad():
        sd = get_peft_model_state_dict(model)
        out = {n: t.detach().to("cpu", dtype=target, copy=True).contiguous() for n, t in sd.items()}
    return dict(sorted(out.items()))


def _base_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors of an injected ``model`` under their plain names (tied tensors
    once, under their first name), as live references."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if is_adapter_name(name.replace(".default.", ".")) or id(t) in seen:
            continue
        seen.add(id(t))
        out[name.replace(_BASE_LAYER, ".")] = t
    return out


def base_state(model: torch.nn.Module, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The base model's weights (without the adapter) as a state, under the names
    ``export_state`` gives the plain model: what a node loads once."""
    target = DTYPES[dtype]
    with torch.no_grad():
        out = {
            n: (t.detach().to("cpu", dtype=target, copy=True) if t.is_floating_point()
                else t.detach().to("cpu", copy=True)).contiguous()
            for n, t in _base_params(model).items()
        }
    return dict(sorted(out.items()))


def _check_names(
    what: str, given: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """ValueError naming the first tensor of ``given`` that is missing, unexpected or of
    another shape than in ``expected``; checked before anything is copied."""
    for name in sorted(expected):
        if name not in given:
            raise ValueError(f"{what} is missing tensor {name!r}")
    for name, t in given.items():
        if name not in expected:
            raise ValueError(f"{what} has unexpected tensor {name!r}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{what} tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                f"{tuple(expected[name].shape)}"
            )
        if t.is_floating_point() != expected[name].is_floating_point():
            raise ValueError(f"{what} tensor {name!r} has dtype {t.dtype}")


def load_base_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a base state into an injected ``model`` exactly (cast to its dtype); ValueError
    naming the first bad tensor, and the model unchanged, when names or shapes differ."""
    params = _base_params(model)
    _check_names("base state", state, params)
    with torch.no_grad():
        for name, src in state.items():
            params[name].copy_(src)


def _adapter_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's live parameters of an injected ``model`` under peft's saved names."""
    return {
        n.replace(".default.", "."): p
        for n, p in model.state_dict(keep_vars=True).items()
        if is_adapter_name(n.replace(".default.", "."))
    }


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy an adapter state into an injected ``model`` exactly: a switch of adapters costs a
    copy of the adapter's tensors, not a model load. ValueError naming the first bad tensor, and
    the model unchanged, when names or shapes differ from the model's adapter."""
    params = _adapter_params(model)
    _check_names("adapter state", state, params)
    with torch.no_grad():
        for name, src in state.items():
            params[name].copy_(src)
