"""Benchmark LoRA jobs (issue 28) on a tiny model: what a version costs to send, and what an
adapter switch costs an engine against loading a model.

(a) ``lora_bytes_per_version_vs_full_patch``: a LoRA learner and a full-weight learner of the
    same model take the same number of GRPO steps at the same lr (each on groups its own policy
    sampled); every version after the first is published as a patch (``anchor_every`` above the
    step count), and the mean adapter patch bytes are divided by the mean full-weight patch
    bytes, in each publish dtype.
(b) ``adapter_switch_s_<engine>`` against ``model_load_s_<engine>``: an engine holding the base
    switches to the next version's adapter (``Engine.load_adapter`` without the base: the
    digest read-back included) against a fresh engine loading the full weights (torch: build +
    ``load_state``; llama.cpp: GGUF write + load). Medians; ``switch_vs_load_<engine>`` is
    their ratio (the issue's goal: at most 0.1).

vLLM is not measured here (it runs in .venv-vllm; tests/node/test_vllm_lora.py prints its figures),
nor SmolLM2-135M.

Run: ``python benchmarks/lora.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from echo.learner.algorithm.grpo import TrainGroup
from echo.learner.lora import AdapterPublisher, LoraTrainer, adapter_ref
from echo.learner.publish import Publisher
from echo.learner.trainer import Trainer
from echo.models.spec import ModelSpec, encode_prompt
from echo.node.engines.base import Engine, GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.identity import Identity
from echo.protocol.jobspec import parse_job
from echo.tasks import make_task
from echo.tools.bench import emit, median, parse_args, say

TASK = make_task("addition", {"max_operand": 20})


def groups(engine: Engine, spec: ModelSpec, n: int, seed: int, version: int) -> list[TrainGroup]:
    reqs = [
        GenRequest(encode_prompt(spec, TASK.prompt(seed + i)), 8,
                   SamplingParams(max_new_tokens=TASK.max_new_tokens, seed=seed + i))
        for i in range(n)
    ]  # fmt: skip
    return [
        TrainGroup(r.prompt_ids, [c.token_ids for c in comps], [c.logprobs for c in comps],
                   [float(j % 2) for j in range(len(comps))], version)
        for r, comps in zip(reqs, engine.generate(reqs), strict=True)
    ]  # fmt: skip


def job(dtype: str, lora: bool, steps: int) -> object:
    fields = {"name": "b", "warmup": {"steps": 20}, "grpo": {"lr": 7e-4}, "publish_dtype": dtype,
              "anchor_every": steps + 10}  # fmt: skip
    if lora:
        fields["lora"] = {"rank": 8, "alpha": 16,
                          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # fmt: skip
    return parse_job(fields)


def patch_bytes(spec: ModelSpec, dtype: str, lora: bool, steps: int, root: Path) -> float:
    """Mean patch payload bytes per version over ``steps`` GRPO steps."""
    j = job(dtype, lora, steps)
    key = Identity.generate().private_key
    store = ChunkStore(root / "chunks", keep_versions=2)
    engine = TorchEngine(spec)
    if lora:
        trainer, _ = LoraTrainer.build(j, spec, root / "job")
        assert isinstance(trainer, LoraTrainer)
        pub: Publisher = AdapterPublisher(key, "b", store, j.anchor_every, trainer.base,
                                          trainer.shape)  # fmt: skip
        ref = adapter_ref(trainer.shape, trainer.base_digest, False)
        engine.load_adapter(trainer.base, trainer.published_state(), ref)
    else:
        trainer, _ = Trainer.build(j, spec, root / "job")
        pub = Publisher(key, "b", store, j.anchor_every)
        engine.load_state(trainer.published_state())
    pub.publish(trainer.published_state(), 0)
    sizes = []
    for v in range(1, steps + 1):
        trainer.learner.step(groups(engine, spec, 4, seed=10 * v, version=v - 1))
        state = trainer.published_state()
        sizes.append(pub.publish(state, v).payload_bytes)
        if lora:
            engine.load_adapter(None, state, ref)
        else:
            engine.load_state(state)
    return sum(sizes) / len(sizes)


def switch_and_load(spec: ModelSpec, make: type, repeats: int, root: Path) -> tuple[float, float]:
    """(median adapter switch s, median full model load s) for engine class ``make``."""
    j = job("float32", True, 1)
    trainer, _ = LoraTrainer.build(j, spec, root / "job")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    kw = {"threads": 1, "dtype": "float32"} if make is not TorchEngine else {"threads": 1}
    engine = make(spec, **kw)
    engine.load_adapter(trainer.base, trainer.published_state(), ref)
    adapters = [{n: t + 0.01 * (k + 1) for n, t in trainer.published_state().items()}
                for k in range(repeats)]  # fmt: skip
    switches = []
    for adapter in adapters:
        t0 = time.perf_counter()
        engine.load_adapter(None, adapter, ref)
        switches.append(time.perf_counter() - t0)
    engine.close()
    loads = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fresh = make(spec, **kw)
        fresh.load_state(trainer.base)
        loads.append(time.perf_counter() - t0)
        fresh.close()
    return median(switches), median(loads)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    spec = ModelSpec() if args.quick else ModelSpec(hidden=256, layers=4, heads=4)
    steps, repeats = (4, 5) if args.quick else (12, 15)
    torch.set_num_threads(1)
    result: dict[str, object] = {"model": f"tiny hidden {spec.hidden} layers {spec.layers}",
                                 "steps": steps}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for dtype in ("float32", "bfloat16"):
            full = patch_bytes(spec, dtype, False, steps, root / f"full-{dtype}")
            lora = patch_bytes(spec, dtype, True, steps, root / f"lora-{dtype}")
            ratio = lora / full
            say(f"{dtype}: adapter patch {lora:,.0f} B/version, full-weight patch {full:,.0f} B "
                f"-> {ratio:.4f}")  # fmt: skip
            result[f"lora_bytes_per_version_vs_full_patch_{dtype}"] = round(ratio, 5)
        result["lora_bytes_per_version_vs_full_patch"] = result[
            "lora_bytes_per_version_vs_full_patch_float32"
        ]
        engines: dict[str, type] = {"torch": TorchEngine}
        if importlib.util.find_spec("llama_cpp") is not None:
            from echo.node.engines.llamacpp_engine import LlamaCppEngine

            engines["llamacpp"] = LlamaCppEngine
        for name, make in engines.items():
            switch, load = switch_and_load(spec, make, repeats, root / f"engine-{name}")
            say(f"{name}: adapter switch {switch * 1e3:.2f} ms, model load {load * 1e3:.2f} ms "
                f"-> {switch / load:.3f}")  # fmt: skip
            result[f"adapter_switch_s_{name}"] = round(switch, 6)
            result[f"model_load_s_{name}"] = round(load, 6)
            result[f"switch_vs_load_{name}"] = round(switch / load, 4)
    emit(result)


if __name__ == "__main__":
    main()
