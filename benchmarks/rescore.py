"""Re-scoring (verification step 5) against the learner's own step, on the learner's device.

Two figures of what re-scoring costs the learner (tiny model, groups of 16 sampled by a torch
engine on the CPU, as a node samples them):

- ``bench_rescore``: the step with and without the fused gate (groups from the current weights
  are judged from the step's own forward), and the separate prefill a batch from an older
  version needs (``rescore_fraction_stale``);
- ``bench_pipeline``: that prefill as the learner pays it at S = 2, through the real
  ``Trainer``, with groups arriving in parts and re-scored while the learner waits
  (``rescore_fraction_blended``).

    python benchmarks/rescore.py [--quick] [--device cuda]

``benchmarks/verify.py`` runs these after steps 1-4; this file runs them alone, with what a
learner machine has installed (no libp2p).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner, TrainGroup
from echo.learner.rescoring.rescore import Rescorer, token_stats
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec, build_model, decode_completion, encode_prompt
from echo.models.tokenizer import EOS_ID
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.protocol import messages as m
from echo.tasks.registry import make_task
from echo.tools.bench import emit, median, parse_args, say

GROUP = 16
MAX_NEW = 8


def bench_rescore(batch_groups: int, reps: int, device: str = "cpu") -> dict[str, float]:
    """Learner step time with and without the fused re-scoring gate (groups sampled from the
    current weights), and the separate prefill that groups from older versions need."""
    torch.set_num_threads(1)
    spec = ModelSpec()
    task = make_task("addition", {"max_operand": 5})
    learner = GRPOLearner(build_model(spec, seed=0).to(device), GRPOConfig())
    engine = TorchEngine(spec, threads=1)
    rescorer = Rescorer(spec, keep=3, temperature=1.0, device=device)
    plain_s, fused_s, prefill_s = [], [], []
    for r in range(2 * reps):
        state = export_state(learner.model)
        engine.load_state(state)
        rescorer.remember(learner.version, state)
        reqs = [GenRequest(encode_prompt(spec, task.prompt(r * 100 + i)), GROUP,
                           SamplingParams(max_new_tokens=MAX_NEW, seed=r * 100 + i))
                for i in range(batch_groups)]
        groups = []
        for i, comps in enumerate(engine.generate(reqs)):
            groups.append(TrainGroup(
                reqs[i].prompt_ids, [c.token_ids for c in comps], [c.logprobs for c in comps],
                [task.reward(r * 100 + i, decode_completion(spec, c.token_ids[:-1]))
                 for c in comps], version=learner.version))
        finish = [["stop" if c[-1] == EOS_ID else "length" for c in g.completions]
                  for g in groups]
        t0 = time.perf_counter()
        verdicts = rescorer.check(groups, finish)
        prefill_s.append(time.perf_counter() - t0)
        assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
        fused = r % 2 == 1
        gated: list = []

        def gate(stats, groups=groups, finish=finish, gated=gated) -> list[bool]:
            out = [rescorer.judge(g, f, "torch", *st).ok
                   for g, f, st in zip(groups, finish, stats, strict=True)]
            gated.extend(out)
            return out

        t0 = time.perf_counter()
        learner.step(groups, gate=gate if fused else None, gate_stats=token_stats)
        (fused_s if fused else plain_s).append(time.perf_counter() - t0)
        assert not fused or (len(gated) == len(groups) and all(gated))
    step = median(plain_s)
    return {"learner_step_s": step, "learner_step_fused_s": median(fused_s),
            "rescore_fraction": max(0.0, median(fused_s) - step) / step,
            "rescore_prefill_s": median(prefill_s),
            "rescore_fraction_stale": median(prefill_s) / step}


def bench_pipeline(
    batch_groups: int, arrivals: int, reps: int, device: str = "cpu"
) -> dict[str, float]:
    """Re-scoring as the learner pays it at S = 2, through the real ``Trainer``.

    Every group of a batch is one version old (what the local swarms showed at S = 2: nodes
    sample the newest version while the learner trains on the one before, mean staleness
    0.75-1.0). Groups reach the learner in ``arrivals`` parts (nodes submit the leases they
    generated together); the learner re-scores each part while it waits for the next
    (``Trainer.prescore``), and the last part inside the step. The blended cost is the
    re-scoring on the step's critical path over the step without it; ``..._unpipelined`` is the
    same batch with every group re-scored inside the step, as before pre-scoring.
    """
    from echo.learner.trainer import Trainer
    from echo.protocol.jobspec import JobSpec

    torch.set_num_threads(1)
    spec = ModelSpec()
    job = JobSpec(name="bench", staleness=2, batch_groups=batch_groups, group_size=GROUP)
    task = make_task("addition", {"max_operand": 5})
    engine = TorchEngine(spec, threads=1)
    trainers = {
        mode: Trainer(job, spec, GRPOLearner(build_model(spec, seed=0).to(device), job.grpo), task)
        for mode in ("pipelined", "unpipelined")
    }
    critical = {mode: [] for mode in trainers}
    steps = {mode: [] for mode in trainers}
    for r in range(reps + 1):
        for mode, tr in trainers.items():
            sampled_from = export_state(tr.learner.model)  # version v: nodes sample from it
            tr.remember(tr.version, sampled_from)
            engine.load_state(sampled_from)
            # ... while the learner steps on to v + 1 with a batch of its own.
            tr.train(make_batch(engine, spec, task, tr.version, batch_groups, seed=r + 1000))
            batch = make_batch(engine, spec, task, tr.version - 1, batch_groups, seed=r)
            part = -(-batch_groups // arrivals)
            if mode == "pipelined":
                for at in range(0, batch_groups - part, part):
                    tr.prescore(batch[at : at + part])
            res = tr.train(batch)
            assert res.metrics["rejected"] == 0, res.metrics
            if r:  # the first round warms up
                critical[mode].append(res.metrics["rescore_s"])
                steps[mode].append(res.metrics["step_s"])
    step = median(steps["pipelined"] + steps["unpipelined"])
    return {"rescore_fraction_blended": median(critical["pipelined"]) / step,
            "rescore_fraction_blended_unpipelined": median(critical["unpipelined"]) / step,
            "pipeline_step_s": step, "arrivals": float(arrivals)}


def make_batch(engine: TorchEngine, spec: ModelSpec, task, version: int, n: int,
               seed: int) -> list[m.TrainingGroup]:
    """``n`` honest groups sampled by ``engine`` as a node would, as the coordinator ships them."""
    reqs = [GenRequest(encode_prompt(spec, task.prompt(seed * 100 + i)), GROUP,
                       SamplingParams(max_new_tokens=MAX_NEW, seed=seed * 100 + i))
            for i in range(n)]
    out = []
    for i, comps in enumerate(engine.generate(reqs)):
        pid = seed * 100 + i
        out.append(m.TrainingGroup(
            rollout_id=f"r{seed}-{version}-{i}", node_id="node", prompt_id=pid,
            prompt_tokens=list(reqs[i].prompt_ids), version=version, engine="torch",
            rewards=[task.reward(pid, decode_completion(spec, c.token_ids[:-1])) for c in comps],
            completions=[m.TrainingCompletion(
                token_ids=list(c.token_ids), logprobs=np.float32(c.logprobs).tolist(),
                finish_reason=c.finish_reason) for c in comps]))
    return out


def run(quick: bool, device: str) -> dict[str, float]:
    """Both figures, said as they come; their JSON fields."""
    reps = 5 if quick else 20
    say(f"re-scoring vs learner step on {device}, batch of 8 groups x {GROUP}, {reps} reps ...")
    r = bench_rescore(8, reps, device)
    say(f"  learner step {r['learner_step_s'] * 1e3:.1f} ms; with the fused re-scoring gate "
        f"{r['learner_step_fused_s'] * 1e3:.1f} ms = {r['rescore_fraction']:.1%} extra "
        f"(groups from the current weights)")
    say(f"  groups from older versions need a prefill: {r['rescore_prefill_s'] * 1e3:.1f} ms = "
        f"{r['rescore_fraction_stale']:.1%} of the step")
    say(f"re-scoring at S = 2 as the learner pays it: batch of 16 groups x {GROUP}, all one "
        f"version old, arriving in 4 parts ...")
    p = bench_pipeline(16, 4, reps, device)
    say(f"  on the step's critical path: {p['rescore_fraction_blended']:.1%} of the step "
        f"(every group re-scored inside the step: "
        f"{p['rescore_fraction_blended_unpipelined']:.1%})")
    return {**r, **p}


def add_device_option(ap) -> None:
    """``--device``: the learner's, for these figures (``benchmarks/verify.py`` takes it too)."""
    ap.add_argument("--device", default="cpu",
                    help="the learner's device (auto, cpu, cuda, cuda:N, mps); nodes: the CPU")


def main() -> None:
    args = parse_args(__doc__, setup=add_device_option)
    device = str(resolve_device(args.device))
    emit({**run(args.quick, device), "quick": args.quick, "device": device})


if __name__ == "__main__":
    main()
