"""LoRA adapters in the vLLM engine: the base loaded once with LoRA enabled, each adapter a
``peft`` folder served through ``LoRARequest`` and hot-swapped between versions.

:class:`VllmLora` owns that for one :class:`~echo.node.engines.vllm_engine.VLLMEngine`: a version
of the same base writes the adapter as a peft folder (``echo.learner.lora.write_peft_folder``'s
format: what ``PeftModel.from_pretrained`` and vLLM read) under a new adapter id, and the
engine's requests name it from then on; the previous id is removed from vLLM's adapter cache.
The base's weights are neither rewritten nor reloaded. The digest reported is of the base as
read back from vLLM's workers when it loaded and of the adapter as read back from the folder
vLLM loads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from echo.models.lora import lora_digest

if TYPE_CHECKING:
    from echo.node.engines.vllm_engine import VLLMEngine

# The ranks vLLM accepts for ``max_lora_rank``: an adapter of rank r needs the smallest at or above.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# peft's folder: the prefix its saved tensor names carry (as echo.learner.lora writes them).
PEFT_PREFIX = "base_model.model."


def max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``. :raises ValueError: over 512."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")


class VllmLora:
    """The adapters of one vLLM engine (see the module docstring)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.base_digest = ""
        self.rank = 0  # vLLM's max_lora_rank the engine was started with (0: LoRA off)
        self.request: Any = None  # the LoRARequest every generation names
        self.switch_seconds = 0.0
        self._serial = 0
        self._published: dict[str, torch.dtype] = {}

    def holds_base(self, base_digest: str) -> bool:
        held = self.engine._llm is not None
        return held and bool(base_digest) and self.base_digest == base_digest

    def start_args(self) -> dict[str, Any]:
        """What ``vllm.LLM`` needs to serve adapters (nothing when LoRA is off)."""
        if not self.rank:
            return {}
        return {"enable_lora": True, "max_lora_rank": self.rank, "max_loras": 1}

    def load(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> str:
        """Serve ``adapter`` (see ``Engine.load_adapter``); returns the digest of base and adapter.

        :raises ValueError: no ``base`` and another one held, a rank vLLM cannot serve.
        """
        engine = self.engine
        rank = max_lora_rank(int(ref.rank))
        if not self.holds_base(ref.base_digest) or rank > self.rank:
            if base is None:
                raise ValueError(f"the engine does not hold base {ref.base_digest[:12]}: send it")
            engine.close_llm()  # LoRA is switched on when vLLM starts: start it anew
            self.rank, self.request = rank, None
            engine.load_state(base)
            self.base_digest = engine.state_digest()
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        self._serial += 1
        folder = engine.workdir / "adapters" / str(self._serial)
        _write_peft(folder, adapter, ref)
        old, self.request = self.request, LoRARequest(f"v{self._serial}", self._serial, str(folder))
        # The first generation with the new id loads it; a tiny one here keeps that off a lease.
        engine.warm_up()
        if old is not None:
            with contextlib.suppress(Exception):
                engine._llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.switch_seconds = time.perf_counter() - t0
        self._published = {n: t.dtype for n, t in adapter.items()}
        return self.served_digest()

    def served_digest(self) -> str:
        """The digest of the base (read back when it loaded) and of the adapter folder named by
        the current request, read back from its file."""
        assert self.request is not None
        raw = load_file(f"{self.request.lora_path}/adapter_model.safetensors")
        names = {n: n.removeprefix(PEFT_PREFIX) for n in raw}
        adapter = {names[n]: t.to(self._published.get(names[n], t.dtype)) for n, t in raw.items()}
        return lora_digest(self.base_digest, adapter)


def _write_peft(folder: Any, adapter: dict[str, torch.Tensor], ref: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": int(ref.rank),
        "lora_alpha": float(ref.alpha),
        "lora_dropout": 0.0,
        "target_modules": list(ref.target_modules),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # float32 for vLLM (it computes adapters in the model's dtype); exact for any published one.
    save_file(
        {PEFT_PREFIX + n: t.to(torch.float32).contiguous() for n, t in adapter.items()},
        str(folder / "adapter_model.safetensors"),
    )
