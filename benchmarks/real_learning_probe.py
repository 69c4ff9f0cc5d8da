"""Cheap candidates for the real-learning task: sampled success at temperature 1, greedy accuracy.

For one candidate (system prompt, new-token budget, which word problems), SmolLM2-135M-Instruct
as benchmarks/real_learning.py loads it samples ``--groups`` training prompts x ``--group``
completions at temperature 1 (from bf16 weights, as a job publishes them) and answers
``--eval-prompts`` held-out prompts greedily; both graded by the dataset task (math-verify). A
GRPO group carries signal only when its samples differ in reward, so the figure that decides
whether a recipe can learn in a few dozen versions is the sampled success rate and the share
of groups with mixed rewards, not the greedy accuracy alone
(docs/results/2026-12-07-real-learning.md has the runs).

    python benchmarks/real_learning_probe.py --system solve --max-new 48 --ops add,sub
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

try:
    from benchmarks import word_problems
except ModuleNotFoundError:
    import word_problems

SYSTEMS = {
    "sentence": "Answer in one short sentence that ends with the number.",
    "short": "Reply with only the final answer, as <answer>N</answer>.",
    "solve": "Solve the problem. End with the final answer as <answer>N</answer>.",
    "number": "Answer with just the number.",
    "first": "Give the answer first, as a single number, then stop.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="short", help=f"one of {sorted(SYSTEMS)} or a text")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--ops", default="add,sub,mul,div", help="word_problems makers to keep")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--match", choices=["math", "exact", "number"], default="math",
                    help="the dataset task's scorer: math-verify, the last line, the last number")
    ap.add_argument("--examples", type=int, default=3, help="sample completions to print")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from echo.learner.evaluate import greedy_accuracy
    from echo.models.prompts import PromptRenderer
    from echo.models.spec import build_model, decode_completion, load_tokenizer, use_chat_template
    from echo.models.weights import export_state
    from echo.node.engines.base import GenRequest, SamplingParams
    from echo.node.engines.torch_engine import TorchEngine
    from echo.tasks import make_task
    from echo.tools.grpo_local import model_spec

    ops = args.ops.split(",")
    path = Path("runs/probe-data") / f"word_problems-{'-'.join(ops)}.jsonl"
    word_problems.write(path, ops=ops)
    system = SYSTEMS.get(args.system, args.system)
    task = make_task("dataset", {"path": str(path.resolve()), "eval_fraction": 0.2,
                                 "system_prompt": system, "max_new_tokens": args.max_new,
                                 "match": args.match})
    spec = model_spec("smollm2")
    tok = load_tokenizer(spec)
    render = PromptRenderer(spec, task, tok, use_chat_template(spec, tok, "auto"))
    model = build_model(spec, seed=0)
    engine = TorchEngine(spec)
    engine.load_state(export_state(model, "bfloat16"))
    t0 = time.perf_counter()
    reqs = [GenRequest(render.ids(i), args.group, SamplingParams(
        max_new_tokens=args.max_new, temperature=args.temperature, top_p=1.0,
        seed=args.seed * 1000 + i))
        for i in range(args.groups)]  # fmt: skip
    out = engine.generate(reqs)
    texts = [[decode_completion(spec, c.token_ids, tok) for c in cs] for cs in out]
    rewards = [[task.reward(i, t) for t in ts] for i, ts in enumerate(texts)]
    lens = [len(c.token_ids) for cs in out for c in cs]
    gen_s = time.perf_counter() - t0
    flat = [r for g in rewards for r in g]
    t1 = time.perf_counter()
    greedy = greedy_accuracy(model, spec, task, args.eval_prompts, tok, "auto")
    print(json.dumps({
        "system": args.system, "match": args.match, "max_new": args.max_new, "ops": ops,
        "temperature": args.temperature,
        "sampled": statistics.fmean(flat), "mixed_groups": sum(len(set(g)) > 1 for g in rewards)
        / len(rewards), "greedy": greedy, "len_mean": statistics.fmean(lens),
        "cut_share": sum(n >= args.max_new for n in lens) / len(lens),
        "gen_s": round(gen_s), "eval_s": round(time.perf_counter() - t1),
        "examples": [[task.answer(i), t, r] for i in range(len(texts))
                     for t, r in zip(texts[i], rewards[i], strict=True)][:args.examples],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
