"""LoRA adapters in the llama.cpp engine: the base GGUF written and loaded once, each adapter a
GGUF LoRA file of its own (:mod:`echo.node.engines.gguf_lora`) set on the running context.

:class:`LlamaLora` owns that for one :class:`~echo.node.engines.llamacpp_engine.LlamaCppEngine`:
a version of the same base writes a small adapter file and switches the context to it
(``llama_adapter_lora_init`` + ``llama_set_adapters_lora``); the base's mapped weights are never
rewritten or reloaded. The digest it reports is computed from the files llama.cpp loaded: the
base read back from its GGUF when it loaded, the adapter read back from its own.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from echo.models.lora import lora_digest
from echo.models.weights import state_digest
from echo.node.engines.gguf_lora import read_gguf_lora, write_gguf_lora

if TYPE_CHECKING:
    from echo.node.engines.llamacpp_engine import LlamaCppEngine


class LlamaLora:
    """The adapters of one llama.cpp engine (see the module docstring)."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.base_digest = ""
        self.active = False  # an adapter is set on the context
        self.switch_seconds = 0.0  # what the last adapter switch took (write + set)
        self._serial = 0
        self._path = engine.workdir / "adapter-0.gguf"
        self._published: dict[str, torch.dtype] = {}

    def holds_base(self, base_digest: str) -> bool:
        return (
            bool(base_digest)
            and self.base_digest == base_digest
            and self.engine._llama.model is not None
        )

    def load(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> str:
        """Serve ``adapter`` (see ``Engine.load_adapter``); returns the digest of base and
        adapter as read back from the files llama.cpp loaded.

        :raises ValueError: no ``base`` and another one held, or tensors that do not fit the
            model (the adapter held before stays).
        :raises RuntimeError: llama.cpp cannot load the base or the adapter.
        """
        engine = self.engine
        if not self.holds_base(ref.base_digest):
            if base is None:
                raise ValueError(f"the engine does not hold base {ref.base_digest[:12]}: send it")
            engine.load_state(base)  # drops any adapter first
            self.base_digest = state_digest(engine.held_state())
        t0 = time.perf_counter()
        self._serial += 1
        path = engine.workdir / f"adapter-{self._serial}.gguf"
        write_gguf_lora(engine.layout, adapter, float(ref.alpha), path)
        try:
            engine._llama.set_adapter(path)
        except RuntimeError:
            path.unlink(missing_ok=True)
            raise
        self.switch_seconds = time.perf_counter() - t0
        old, self._path = self._path, path
        with contextlib.suppress(OSError):
            old.unlink(missing_ok=True)
        self.active = True
        self._published = {n: t.dtype for n, t in adapter.items()}
        return self.served_digest()

    def served_digest(self) -> str:
        """:func:`~echo.models.lora.lora_digest` of the base and the adapter file set now."""
        adapter = read_gguf_lora(self._path, self.engine.layout, self._published)
        return lora_digest(self.base_digest, adapter)

    def drop(self) -> None:
        """Compute with no adapter (a full-weight version is about to load)."""
        if self.active and self.engine._llama.ctx is not None:
            self.engine._llama.set_adapter(None)
        self.active = False
        self.base_digest = ""
        self.engine.lora_served = ""
