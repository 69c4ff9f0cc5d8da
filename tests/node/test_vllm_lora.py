"""LoRA adapters in the vLLM engine: served through ``LoRARequest`` on a base loaded once with
LoRA enabled, hot-swapped between versions, within vLLM's threshold of the learner.

Skipped where vllm is not importable (the main venv); scripts/test runs it in .venv-vllm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from echo.learner.lora import LoraTrainer, adapter_ref
from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.models.lora import lora_digest
from echo.models.spec import ModelSpec
from echo.node.engines.torch_engine import TorchEngine
from tests.learner.test_lora import groups_from, lora_job, mean_gap

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.venv-vllm has it)"
)
SPEC = ModelSpec(heads=2)  # vLLM's CPU attention needs a head size of at least 32


def test_vllm_serves_adapters_and_hot_swaps_them(tmp_path: Path) -> None:
    from echo.node.engines.vllm_engine import VLLMEngine

    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    torch_engine = TorchEngine(SPEC)
    torch_engine.load_adapter(trainer.base, trainer.published_state(), ref)
    for step in range(3):
        trainer.learner.step(groups_from(torch_engine, 3, seed=100 + step, version=step))
        torch_engine.load_adapter(None, trainer.published_state(), ref)

    engine = VLLMEngine(SPEC, threads=1, max_seqs=16, workdir=tmp_path / "vllm")
    try:
        engine.load_adapter(trainer.base, trainer.published_state(), ref)
        served = lora_digest(trainer.base_digest, trainer.published_state())
        assert engine.lora_served == served == engine.state_digest()
        groups = groups_from(engine, 4, seed=300, version=trainer.version)
        gap = mean_gap(groups, trainer.learner.score(groups))
        print(f"vLLM with the adapter vs the learner: mean |log-prob gap| {gap:.2e}")
        assert gap < MISMATCH_THRESHOLDS["vllm"]

        llm = engine._llm
        loads = engine.last_load
        trainer.learner.step(groups)
        engine.load_adapter(None, trainer.published_state(), ref)  # a hot swap
        assert engine._llm is llm and engine.last_load is loads  # no restart, no weight reload
        assert engine.lora_served == lora_digest(trainer.base_digest, trainer.published_state())
        assert engine._lora is not None
        print(f"vLLM: base start {loads.seconds:.1f} s, adapter swap "
              f"{engine._lora.switch_seconds * 1e3:.0f} ms")  # fmt: skip
        again = groups_from(engine, 4, seed=301, version=trainer.version)
        gap2 = mean_gap(again, trainer.learner.score(again))
        assert gap2 < MISMATCH_THRESHOLDS["vllm"]
        assert len(list((tmp_path / "vllm" / "adapters").iterdir())) == 1
    finally:
        engine.close()
