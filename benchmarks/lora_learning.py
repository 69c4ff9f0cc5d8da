"""LoRA learning under asynchrony: a LoRA swarm against the same LoRA recipe in one process.

Issue 28's ``lora_swarm_vs_sync``. One recipe -- the tiny model (hidden 64, 2 layers) warmed up
30 steps, ``a+b=`` with operands below 5, a rank-4 adapter (alpha 8) on q, v, up and down
projections, lr 5e-3, 4 groups of 8 per version -- runs as:

- ``sync``: on-policy GRPO in this process: the learner's own :class:`~echo.learner.lora.
  LoraTrainer` (same base, same adapter initialisation, same optimizer), a torch engine serving
  each new adapter as a node would (base loaded once, adapter switched), groups sampled and
  scored as ``tools/grpo_local.py`` samples them; the baseline, measured in the same run;
- ``swarm``: a real local swarm (coordinator, learner, a torch node and a llama.cpp node where
  installed; ``tools/local_swarm.py``) of the same job, at the job's default staleness (2).

Per seed (model initialisation and warm-up; the swarm's sampling seeds are random by design):
the held-out greedy accuracy at the last version (``Trainer.evaluate``: the same function, the
job's 256 held-out prompts, in both). ``lora_swarm_vs_sync`` is the swarm's mean over the
synchronous one's.

    python benchmarks/lora_learning.py            # 3 seeds, 40 versions (~10 min on 2 cores)
    python benchmarks/lora_learning.py --quick    # 1 seed, 4 versions, torch node (about a minute)

On the tiny recipe a run either leaves the plateau of giving the commonest sum within its budget
or does not (benchmarks/learning.py), so a few seeds give a coarse ratio; the per-seed figures
are printed and kept in the JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from echo.learner.lora import LoraTrainer, adapter_ref
from echo.models.spec import ModelSpec
from echo.node.engines.base import SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.protocol.jobspec import load_job_toml
from echo.tasks import make_task
from echo.tools.bench import emit, parse_args, say
from echo.tools.grpo_local import LocalConfig, _Codec, _sample_groups
from echo.tools.swarm import job_toml

GROUP_SIZE, BATCH_GROUPS, LR, WARMUP = 8, 4, 5e-3, 30
LORA_TABLE = """
[job.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj", "up_proj", "down_proj"]
"""


def recipe(steps: int, seed: int) -> str:
    """The job file both configurations run."""
    return (
        job_toml("lora-bench", steps=steps, group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS,
                 anchor_every=10, warmup=WARMUP, lr=LR, eval_every=steps, seed=seed)
        + LORA_TABLE
    )  # fmt: skip


def run_sync(steps: int, seed: int, root: Path) -> dict:
    """The synchronous LoRA baseline in this process; its first and last held-out accuracy."""
    spec = load_job_toml(recipe(steps, seed))
    model_spec = ModelSpec.from_dict(spec.model_spec_dict())
    t0 = time.perf_counter()
    trainer, _ = LoraTrainer.build(spec, model_spec, root)
    assert isinstance(trainer, LoraTrainer)
    first = trainer.evaluate(force=True)["eval_accuracy"]
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    engine = TorchEngine(model_spec)
    engine.load_adapter(trainer.base, trainer.published_state(), ref)
    task = make_task(spec.task.name, dict(spec.task.params))
    cfg = LocalConfig(spec=model_spec, prompts_per_step=BATCH_GROUPS,
                      samples_per_prompt=GROUP_SIZE, seed=seed)  # fmt: skip
    codec = _Codec(model_spec, task, "auto")
    params = SamplingParams(max_new_tokens=spec.sampling.max_new_tokens,
                            temperature=spec.sampling.temperature, top_p=1.0)  # fmt: skip
    rng = random.Random(seed)
    for _ in range(steps):
        groups, _ = _sample_groups(engine, codec, cfg, params, rng, trainer.version)
        trainer.learner.step(groups)
        engine.load_adapter(None, trainer.published_state(), ref)  # a switch, as on a node
    last = trainer.evaluate(force=True)["eval_accuracy"]
    return {"eval_first": first, "eval_last": last, "wall_s": time.perf_counter() - t0}


def run_swarm(steps: int, seed: int, engines: list[str], out: Path) -> dict:
    """One local swarm of the recipe (real processes); its first and last held-out accuracy."""
    job = out.parent / f"{out.name}-job.toml"
    job.write_text(recipe(steps, seed))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "echo.tools.local_swarm", "--out", str(out), "--quiet",
         "--nodes", str(len(engines)), "--engines", ",".join(engines), "--job", str(job),
         "--timeout", str(max(300, 10 * steps))],
        capture_output=True, text=True,
    )  # fmt: skip
    summary = out / "summary.json"
    if not summary.exists():
        raise RuntimeError(f"swarm failed ({proc.returncode}): {proc.stdout[-2000:]}")
    s = json.loads(summary.read_text())
    if s["status"] != "done":
        raise RuntimeError(f"swarm ended {s['status']}: {proc.stdout[-2000:]}")
    return {"eval_first": s["eval_first"], "eval_last": s["eval_last"],
            "wall_s": time.perf_counter() - t0}  # fmt: skip


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps, seeds = (4, [0]) if args.quick else (40, [0, 1, 2])
    engines = ["torch"]
    if not args.quick and importlib.util.find_spec("llama_cpp") is not None:
        engines.append("llamacpp")
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"sync": [], "swarm": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in seeds:
            sync = run_sync(steps, seed, root / f"sync-{seed}")
            swarm = run_swarm(steps, seed, engines, root / f"swarm-{seed}")
            for name, r in (("sync", sync), ("swarm", swarm)):
                runs[name].append(r)
                say(f"seed {seed} {name:5s}: held-out accuracy {r['eval_first']:.3f} -> "
                    f"{r['eval_last']:.3f} in {r['wall_s']:.0f} s")  # fmt: skip
    mean = {k: statistics.fmean(r["eval_last"] for r in v) for k, v in runs.items()}
    ratio = mean["swarm"] / mean["sync"] if mean["sync"] > 0 else None
    say(f"final accuracy: swarm {mean['swarm']:.3f}, sync {mean['sync']:.3f} -> "
        f"{ratio if ratio is None else round(ratio, 3)}")  # fmt: skip
    emit({
        "lora_swarm_vs_sync": None if ratio is None else round(ratio, 4),
        "eval_last_swarm": [round(r["eval_last"], 4) for r in runs["swarm"]],
        "eval_last_sync": [round(r["eval_last"], 4) for r in runs["sync"]],
        "eval_first": [round(r["eval_first"], 4) for r in runs["sync"]],
        "steps": steps, "seeds": seeds, "engines": engines, "quick": args.quick,
    })  # fmt: skip


if __name__ == "__main__":
    main()
