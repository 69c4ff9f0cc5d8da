"""Network-free GRPO on one machine: the proof that the recipe learns.

The loop is the swarm's, without the swarm: TorchEngine samples groups (as a node would), the task
scores them (as the coordinator would), GRPOLearner steps, and the engine receives the new weights
through export_state / load_state every step (as a node receives a version).

    python -m echo.tools.grpo_local --steps 300 --task addition --max-operand 5
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from echo.learner.evaluate import greedy_accuracy
from echo.learner.grpo import GRPOConfig, GRPOLearner, TrainGroup
from echo.learner.warmup import warmup
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec, build_model, decode_completion, encode_prompt
from echo.models.weights import export_state, load_state
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.tasks import make_task
from echo.tasks.base import Task
from echo.tasks.scoring import has_advantage

# With skip_uniform, a step draws at most this many rounds of prompts for groups whose rewards
# differ, then trains on what it has filled up with uniform groups: a model that solves (or
# fails) every prompt would otherwise never step again.
MAX_DRAWS = 8


@dataclass
class LocalConfig:
    task: str = "addition"
    task_params: dict = field(default_factory=lambda: {"max_operand": 5})
    spec: ModelSpec = field(default_factory=lambda: ModelSpec(hidden=64, layers=2))
    steps: int = 400
    prompts_per_step: int = 16
    samples_per_prompt: int = 16
    seed: int = 0
    warmup_steps: int = 30  # short on purpose: long random-label warm-up teaches the model to
    # ignore the prompt (the labels do not depend on it), and GRPO then learns much slower
    warmup_lr: float = 3e-3
    cache_dir: str | None = str(Path.home() / ".cache" / "echo-swarm" / "warmup")
    threads: int | None = None
    temperature: float = 1.0
    lag: int = 0  # sample from the weights of this many versions ago (the swarm's staleness)
    # The gradient at the weights that sampled the batch, applied to the current ones (a delayed
    # gradient: every group would be on-policy where its gradient is taken, so the re-scoring
    # gate could always be fused into the step). An experiment: it learns worse (README).
    grad_at_sampler: bool = False
    # Dynamic sampling (DAPO): groups whose samples all got the same reward carry no advantage;
    # draw more prompts until the batch holds prompts_per_step groups that do (MAX_DRAWS rounds at
    # most). An experiment of the synchronous loop only; the README has the runs.
    skip_uniform: bool = False
    device: str = "cpu"  # the learner's and the engine's (auto, cpu, cuda, cuda:N, mps)
    eval_every: int = 50  # greedy accuracy on held-out prompts every this many steps (0: never)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


def run(
    cfg: LocalConfig,
    log: bool = True,
    on_step: Callable[[GRPOLearner, dict[str, float]], None] | None = None,
) -> tuple[list[dict[str, float]], float]:
    """Warm up, then GRPO for ``cfg.steps`` steps; returns per-step metrics and the final
    held-out greedy accuracy. ``on_step(learner, metrics)`` runs after every step, before the
    step's metrics are logged: a probe may read the learner and add figures to ``metrics``."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if cfg.spec.kind != "tiny":
        raise ValueError("grpo_local runs the tiny model (no tokenizer plumbing for hf here)")
    task = make_task(cfg.task, cfg.task_params)
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    model = build_model(cfg.spec, seed=cfg.seed).to(device)  # initialised on the CPU
    warmup(
        model, cfg.spec, task,
        steps=cfg.warmup_steps, lr=cfg.warmup_lr, seed=cfg.seed, cache_dir=cfg.cache_dir,
    )  # fmt: skip
    learner = GRPOLearner(model, cfg.grpo, cfg.temperature)
    engine = TorchEngine(cfg.spec, device=str(device))
    engine.load_state(export_state(learner.model))
    if log:
        acc = greedy_accuracy(learner.model, cfg.spec, task)
        print(f"warm-up done in {time.perf_counter() - t0:.1f}s, greedy accuracy {acc:.3f}")

    rng = random.Random(cfg.seed)
    history: list[dict[str, float]] = []
    published = [export_state(learner.model)]  # the last lag + 1 versions, oldest first
    t_start = time.perf_counter()
    params = SamplingParams(
        max_new_tokens=task.max_new_tokens, temperature=cfg.temperature, top_p=1.0
    )
    for step in range(cfg.steps):
        version = learner.version - min(cfg.lag, len(published) - 1)
        signal: list[TrainGroup] = []  # every group, unless skip_uniform sets some aside
        uniform: list[TrainGroup] = []
        sampled, gen_s = 0, 0.0
        for _ in range(MAX_DRAWS if cfg.skip_uniform else 1):
            drawn, took = _sample_groups(engine, task, cfg, params, rng, version)
            sampled, gen_s = sampled + len(drawn), gen_s + took
            for g in drawn:
                aside = cfg.skip_uniform and not has_advantage(g.rewards)
                (uniform if aside else signal).append(g)
            if len(signal) >= cfg.prompts_per_step:
                break
        groups = (signal + uniform)[: cfg.prompts_per_step]
        m = _delayed_step(learner, groups, published[0]) if cfg.grad_at_sampler else (
            learner.step(groups))
        # What a node gets: the published state, copied exactly into its own model (with a lag,
        # the state published that many versions ago, as a node that has not caught up holds).
        published = (published + [export_state(learner.model)])[-(cfg.lag + 1):]
        engine.load_state(published[0])
        m.update(step=step, gen_s=gen_s, tok_s=engine.tokens_per_s, groups_sampled=sampled,
                 elapsed=time.perf_counter() - t_start)  # fmt: skip
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            m["greedy"] = greedy_accuracy(learner.model, cfg.spec, task)
        if on_step is not None:
            on_step(learner, m)
        history.append(m)
        if log:
            greedy = f"  greedy {m['greedy']:.3f}" if "greedy" in m else ""
            print(
                f"step {step:4d}  reward {m['reward']:.3f}  mismatch {m['mismatch']:.1e}  "
                f"gen {gen_s * 1e3:5.1f}ms ({m['tok_s']:6.0f} tok/s)  "
                f"train {m['step_s'] * 1e3:5.1f}ms  t {m['elapsed']:5.1f}s{greedy}"
            )
    acc = greedy_accuracy(learner.model, cfg.spec, task)
    if log:
        first = sum(h["reward"] for h in history[:10]) / min(10, len(history))
        last = sum(h["reward"] for h in history[-10:]) / min(10, len(history))
        print(
            f"done: {cfg.steps} steps in {time.perf_counter() - t_start:.1f}s; sampled reward "
            f"first 10 steps {first:.3f} -> last 10 steps {last:.3f}; greedy accuracy {acc:.3f}"
        )
    return history, acc


def _sample_groups(
    engine: TorchEngine,
    task: Task,
    cfg: LocalConfig,
    params: SamplingParams,
    rng: random.Random,
    version: int,
) -> tuple[list[TrainGroup], float]:
    """One round of ``cfg.prompts_per_step`` fresh prompts, sampled and scored; the groups and
    the seconds the engine took."""
    prompt_ids = [rng.randrange(10**9) for _ in range(cfg.prompts_per_step)]
    reqs = [
        GenRequest(
            encode_prompt(cfg.spec, task.prompt(pid)),
            cfg.samples_per_prompt,
            SamplingParams(**{**asdict(params), "seed": rng.randrange(1 << 62)}),
        )
        for pid in prompt_ids
    ]
    t_gen = time.perf_counter()
    out = engine.generate(reqs)
    gen_s = time.perf_counter() - t_gen
    groups = [
        TrainGroup(
            prompt_ids=r.prompt_ids,
            completions=[c.token_ids for c in cs],
            behaviour_logprobs=[c.logprobs for c in cs],
            rewards=[task.reward(pid, decode_completion(cfg.spec, c.token_ids)) for c in cs],
            version=version,
        )
        for pid, r, cs in zip(prompt_ids, reqs, out, strict=True)
    ]
    return groups, gen_s


def _delayed_step(
    learner: GRPOLearner, groups: list[TrainGroup], sampler: dict[str, torch.Tensor]
) -> dict[str, float]:
    """One step whose gradient is taken at ``sampler`` (the weights the groups were sampled
    from) and applied by the optimizer to the learner's current weights."""
    current = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    load_state(learner.model, sampler)
    opt_step = learner.opt.step

    def restore_then_step(*args, **kwargs):
        with torch.no_grad():
            for n, p in learner.model.named_parameters():
                p.copy_(current[n])
        return opt_step(*args, **kwargs)

    learner.opt.step = restore_then_step  # type: ignore[method-assign]
    try:
        return learner.step(groups)
    finally:
        learner.opt.step = opt_step  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=LocalConfig.steps)
    ap.add_argument("--task", default="addition")
    ap.add_argument("--max-operand", type=int, default=5, help="addition only")
    ap.add_argument("--lr", type=float, default=GRPOConfig.model_fields["lr"].default)
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="KL term to the starting policy (the job's [job.grpo] kl_coef)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=0,
                    help="sample from the weights of this many versions ago (swarm staleness)")
    ap.add_argument("--grad-at-sampler", action="store_true",
                    help="experiment: take the gradient at the sampling weights (delayed gradient)")
    ap.add_argument("--skip-uniform", action="store_true",
                    help="experiment: draw more prompts instead of training on groups whose "
                         "rewards are all equal (dynamic sampling)")
    ap.add_argument("--eval-every", type=int, default=LocalConfig.eval_every,
                    help="held-out greedy accuracy every this many steps (0: at the end only)")
    ap.add_argument("--warmup-steps", type=int, default=LocalConfig.warmup_steps)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps")
    ap.add_argument("--no-cache", action="store_true", help="do not read or write the warm-up")
    args = ap.parse_args()
    cfg = LocalConfig(
        task=args.task,
        task_params={"max_operand": args.max_operand} if args.task == "addition" else {},
        spec=ModelSpec(hidden=args.hidden, layers=args.layers),
        steps=args.steps,
        seed=args.seed,
        lag=args.lag,
        grad_at_sampler=args.grad_at_sampler,
        skip_uniform=args.skip_uniform,
        warmup_steps=args.warmup_steps,
        threads=args.threads,
        device=args.device,
        eval_every=args.eval_every,
        grpo=GRPOConfig(lr=args.lr, kl_coef=args.kl_coef),
    )
    if args.no_cache:
        cfg.cache_dir = None
    run(cfg)


if __name__ == "__main__":
    main()
