"""LoRA adapters in the torch engine: the same ``peft`` layers the learner trains and re-scores
with (:mod:`echo.models.lora`), so the engine's log-probs are the learner's function.

:class:`TorchLora` owns the engine's LoRA model: the base, loaded once per base digest, with the
adapter's layers injected; a new adapter of the same base and shape is a copy of its tensors into
those layers (no model load). The digest it reports is computed from the weights it holds, read
back after each load.
"""

from __future__ import annotations

from typing import Any

import torch

from echo.models.lora import (
    LoraShape,
    adapter_state,
    base_state,
    inject,
    load_adapter_state,
    load_base_state,
    lora_digest,
)
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import DTYPES, dtype_name, state_digest


def shape_of_ref(ref: Any) -> LoraShape:
    """The :class:`LoraShape` of a ``messages.AdapterRef``."""
    return LoraShape(int(ref.rank), float(ref.alpha), tuple(ref.target_modules))


class TorchLora:
    """The LoRA-wrapped model of a torch engine (see the module docstring)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: str) -> None:
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        self.shape: LoraShape | None = None
        self.base_digest = ""
        self._base_dtype = dtype
        self._adapter_dtypes: dict[str, torch.dtype] = {}

    def holds_base(self, base_digest: str) -> bool:
        return self.model is not None and self.base_digest == base_digest

    def load(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> str:
        """Serve ``adapter`` (see ``Engine.load_adapter``); returns the digest of what is served,
        read back from the model. :raises ValueError: no ``base`` and another one held, or
        tensors that do not fit (the adapter held before stays)."""
        shape = shape_of_ref(ref)
        if base is None and not self.holds_base(ref.base_digest):
            raise ValueError(f"the engine does not hold base {ref.base_digest[:12]}: send it")
        if base is not None and not self.holds_base(ref.base_digest):
            self._build(base, shape)
        elif shape != self.shape:
            # Another adapter shape on the base held: re-wrap the base this engine has.
            assert self.model is not None
            self._build(base_state(self.model, self._base_dtype), shape)
        assert self.model is not None
        load_adapter_state(self.model, adapter)
        self._adapter_dtypes = {n: t.dtype for n, t in adapter.items()}
        dtypes = {dtype_name(t) for t in self._adapter_dtypes.values()}
        held = adapter_state(self.model, dtypes.pop() if len(dtypes) == 1 else "float32")
        return lora_digest(self.base_digest, held)

    def served_digest(self) -> str:
        """The digest of base and adapter, read back from the model now."""
        assert self.model is not None
        dtypes = {dtype_name(t) for t in self._adapter_dtypes.values()}
        held = adapter_state(self.model, dtypes.pop() if len(dtypes) == 1 else "float32")
        return lora_digest(state_digest(base_state(self.model, self._base_dtype)), held)

    def _build(self, base: dict[str, torch.Tensor], shape: LoraShape) -> None:
        model = inject(build_model(self.spec), shape).to(self.device, DTYPES[self.dtype]).eval()
        load_base_state(model, base)
        floats = {dtype_name(t.dtype) for t in base.values() if t.is_floating_point()}
        self._base_dtype = floats.pop() if len(floats) == 1 else "float32"
        # From the weights as loaded: a base that did not load exactly shows as another digest.
        self.base_digest = state_digest(base_state(model, self._base_dtype))
        self.model, self.shape = model, shape
