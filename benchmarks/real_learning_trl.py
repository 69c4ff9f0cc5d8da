"""The ``trl`` way of benchmarks/real_learning.py: TRL's ``GRPOTrainer`` on the same recipe.

TRL is the reference researchers know, so it is set to the project's recipe rather than its own
defaults: the same prompts in the same order (prompt ids 0, 1, 2, ... of the task, rendered with
the model's chat template and the task's system prompt, not shuffled), groups of the recipe's
size, one optimizer step per batch of ``prompts x group`` completions (one generation per step,
one iteration: on-policy), the token-mean loss over the batch (``loss_type = "dapo"``, the
learner's), group-normalised advantages, clip 0.2, no KL term, AdamW at the recipe's lr with
the job's betas (0.9, 0.99), no weight decay, gradient norm clipped at 1, a constant learning
rate, sampling at the recipe's temperature with neither top-k nor top-p. Rewards are the task's
own scorer on the decoded completion. Held-out accuracy is
:func:`echo.learner.evaluate.greedy_accuracy` on the trainer's model, the function the other two
ways use.

What differs, and stays different: TRL samples from its float32 weights (the swarm's nodes and
the sync baseline sample from the bf16 weights a real job publishes), with ``transformers``'
``generate``; the project's dual clip of negative advantages never binds on-policy.

TRL is optional (the ``bench`` extra): :func:`trl_missing` says why it cannot run here.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from typing import Any


def trl_missing() -> str | None:
    """Why TRL's GRPOTrainer cannot run in this environment, or None when it can."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install 'echo-swarm[bench]')"
    try:
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as exc:  # an incompatible install fails at import: say how
        return f"trl does not import here: {type(exc).__name__}: {exc}"
    return None


def run_trl(recipe: dict[str, Any], seed: int, spec: Any, task: Any) -> dict[str, Any]:
    """Train ``spec``'s model on ``task`` with GRPOTrainer for ``recipe["steps"]`` steps; the
    held-out accuracy before, every ``eval_every`` steps and after, the per-step mean reward,
    and the wall time (model load and evaluations included, as in the other ways)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from echo.learner.evaluate import greedy_accuracy
    from echo.models.spec import load_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tok = load_tokenizer(spec)
    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
    n_eval, chat = recipe["eval_prompts"], recipe["chat"]
    first = greedy_accuracy(model, spec, task, n_eval, tok, chat)
    curve: list[list[float]] = [[0, first]]
    prompts, group, steps = recipe["prompts"], recipe["group"], recipe["steps"]

    def row(pid: int) -> dict[str, Any]:
        system = task.system_prompt(pid)
        msgs = [{"role": "system", "content": system}] if system else []
        return {"prompt": [*msgs, {"role": "user", "content": task.prompt(pid)}], "pid": pid}

    data = Dataset.from_list([row(pid) for pid in range(steps * prompts)])

    def reward(completions: list, pid: list[int], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(int(p), t) for p, t in zip(pid, texts, strict=True)]

    rewards: list[float] = []

    class Probe(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any):
            every = recipe["eval_every"]
            if every and state.global_step % every == 0 and state.global_step < steps:
                acc = greedy_accuracy(kw["model"], spec, task, n_eval, tok, chat)
                curve.append([state.global_step, acc])

    with tempfile.TemporaryDirectory(prefix="trl-") as tmp:
        cfg = GRPOConfig(
            output_dir=tmp,
            max_steps=steps,
            per_device_train_batch_size=prompts * group,
            gradient_accumulation_steps=1,
            num_generations=group,
            steps_per_generation=1,  # one generation per optimizer step (it sets the batch)
            num_iterations=1,
            max_completion_length=recipe["max_new"],
            temperature=recipe["temperature"],
            top_p=1.0,
            top_k=0,
            learning_rate=recipe["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            shuffle_dataset=False,
            use_cpu=True,
            gradient_checkpointing=False,  # TRL's default is on; the other ways keep activations
            bf16=False,
            seed=seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=cfg,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Probe()],
        )
        trainer.train()
        last = greedy_accuracy(trainer.model, spec, task, n_eval, tok, chat)
    curve.append([steps, last])
    return {
        "eval_first": first,
        "eval_last": last,
        "eval_curve": curve,
        "rewards": rewards,
        "wall_s": time.perf_counter() - t0,
    }
