"""LoRA adapters in the llama.cpp engine: a GGUF LoRA adapter beside the untouched base GGUF,
switched on the running context, exact with the learner within the engine's threshold."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from echo.learner.lora import LoraTrainer, adapter_ref
from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.models.lora import lora_digest
from echo.node.engines.torch_engine import TorchEngine
from tests.learner.test_lora import SPEC, groups_from, lora_job, mean_gap

HAVE_LLAMA = (
    importlib.util.find_spec("gguf") is not None
    and importlib.util.find_spec("llama_cpp") is not None
)
pytestmark = pytest.mark.skipif(
    not HAVE_LLAMA, reason="needs llama-cpp-python and gguf: pip install 'echo-swarm[llamacpp]'"
)


def trained(tmp_path: Path, steps: int = 3) -> tuple[LoraTrainer, TorchEngine]:
    """A LoRA trainer some steps away from B = 0, and a torch engine serving its adapter."""
    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    torch_engine = TorchEngine(SPEC)
    torch_engine.load_adapter(trainer.base, trainer.published_state(), ref)
    for step in range(steps):
        trainer.learner.step(groups_from(torch_engine, 3, seed=100 + step, version=step))
        torch_engine.load_adapter(None, trainer.published_state(), ref)
    return trainer, torch_engine


def test_the_gguf_adapter_reads_back_exactly(tmp_path: Path) -> None:
    from echo.node.engines.gguf_layout import layout_of
    from echo.node.engines.gguf_lora import read_gguf_lora, write_gguf_lora

    trainer, _ = trained(tmp_path, steps=1)
    layout = layout_of(SPEC)
    for dtype in (torch.float32, torch.bfloat16):
        adapter = {n: t.to(dtype) for n, t in trainer.published_state().items()}
        write_gguf_lora(layout, adapter, 8.0, tmp_path / "a.gguf")
        back = read_gguf_lora(tmp_path / "a.gguf", layout, {n: dtype for n in adapter})
        assert all(torch.equal(back[n], adapter[n]) for n in adapter)
    with pytest.raises(ValueError, match="wraps no weight"):
        write_gguf_lora(layout, {"model.norm.lora_A.weight": torch.zeros(4, 64)}, 8.0,
                        tmp_path / "b.gguf")  # fmt: skip
    with pytest.raises(ValueError, match="has shape"):
        bad = {n: torch.zeros(t.shape[0], t.shape[1] + 1) for n, t in adapter.items()}
        write_gguf_lora(layout, bad, 8.0, tmp_path / "b.gguf")
    assert not (tmp_path / "b.gguf").exists()


def test_llamacpp_serves_adapters_exactly_and_switches_without_reloading_the_base(
    tmp_path: Path,
) -> None:
    from echo.node.engines.llamacpp_engine import LlamaCppEngine

    trainer, torch_engine = trained(tmp_path)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    engine = LlamaCppEngine(SPEC, threads=1, dtype="float32", workdir=tmp_path / "llama")
    try:
        engine.load_adapter(trainer.base, trainer.published_state(), ref)
        # Computed from llama.cpp's files: the same digest the learner published.
        served = lora_digest(trainer.base_digest, trainer.published_state())
        assert engine.lora_served == served == engine.state_digest() == torch_engine.lora_served
        groups = groups_from(engine, 4, seed=300, version=trainer.version)
        gap = mean_gap(groups, trainer.learner.score(groups))
        print(f"llama.cpp with the GGUF adapter vs the learner: mean |log-prob gap| {gap:.2e}")
        assert gap < MISMATCH_THRESHOLDS["llamacpp"]

        # The next version: an adapter switch on the same model and context.
        base_bytes = engine.gguf_path.read_bytes()
        model = ctypes.cast(engine._llama.model, ctypes.c_void_p).value
        loads = engine.last_load
        trainer.learner.step(groups)
        engine.load_adapter(None, trainer.published_state(), ref)
        assert ctypes.cast(engine._llama.model, ctypes.c_void_p).value == model
        assert engine.last_load is loads  # no base write or load
        assert engine.gguf_path.read_bytes() == base_bytes  # the base GGUF is untouched
        assert engine.lora_served == lora_digest(trainer.base_digest, trainer.published_state())
        assert engine.lora_served != served
        assert engine._lora is not None
        print(f"llama.cpp: base write + load {loads.seconds * 1e3:.1f} ms, adapter switch "
              f"(write + set) {engine._lora.switch_seconds * 1e3:.1f} ms")  # fmt: skip
        again = groups_from(engine, 4, seed=301, version=trainer.version)
        assert mean_gap(again, trainer.learner.score(again)) < MISMATCH_THRESHOLDS["llamacpp"]
        assert len(list((tmp_path / "llama").glob("adapter-*.gguf"))) == 1

        # The base alone samples another function; a full-weight version drops the adapter.
        engine.load_state(trainer.base)
        assert engine.lora_served == "" and engine.state_digest() == trainer.base_digest
        base_only = groups_from(engine, 4, seed=301, version=trainer.version)
        assert mean_gap(base_only, trainer.learner.score(base_only)) > 100 * gap
        with pytest.raises(ValueError, match="does not hold base"):
            engine.load_adapter(None, trainer.published_state(), ref)
    finally:
        engine.close()
