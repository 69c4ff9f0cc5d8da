"""Answer swings under staleness: how often the converged policy's answer to a problem jumps.

The swarm trains on groups sampled from older weights. Near convergence that costs stability,
not speed: one version of lag multiplies how often the policy's probability of the right answer
to one of the 25 ``a+b=`` problems moves by more than SWING in a single step, and a swing the
last evaluation catches is a run that ends short of where it was (the README's "Answers lost
late in a run"). This benchmark measures it in one process, deterministically, without the
swarm: ``tools/grpo_local.py``'s loop at a fixed lag (the engine samples from the weights of
``lag`` versions ago, as a node that has not caught up does), with the learning benchmark's
recipe (dynamic sampling, ``kl_coef`` 0.2).

After every step the probe scores each problem's right answer (its tokens and the end of text)
under the learner's weights. Per run, counted from SETTLED_FROM of the run on:

- swings: (step, problem) pairs whose answer probability moved by more than SWING;
- zigzags: swings followed at once by one back the other way (a delayed correction overshooting);
- late dips: held-out evaluations (every 10 steps) more than 0.05 under the run's best so far.

The on-policy run (lag 0) is the baseline, measured in the same run. ``--grpo`` sets GRPO
fields for every run (``--grpo '{"betas": [0.95, 0.99]}'``), to try a remedy against it.

    python benchmarks/stability.py --quick   # lags 0 and 1, one seed, 300 steps (about 1 min)
    python benchmarks/stability.py           # lags 0, 1, 2, seeds 0-2, 500 steps (~8 min)

The JSON line: ``swings_per_100_steps`` and ``late_dips`` by lag, ``swing_ratio_lag1`` (lag 1's
swings over lag 0's), the final accuracies and, per run, the step at which held-out accuracy
first reached REACHED (what a remedy costs in speed).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from echo.learner.algorithm.grpo import GRPOConfig
from echo.tools.bench import emit, parse_args, say
from echo.tools.curves import DIP_DEPTH, EVAL_EVERY

ROOT = Path(__file__).resolve().parent.parent

# A move of an answer's probability this large in one step: the right answer going from
# certain to one sample in seven wrong, or back.
SWING = 0.15
# Swings are counted from this share of the run on: before it the policy is still learning, and
# large moves are the learning itself.
SETTLED_FROM = 0.5
# The speed a remedy may cost: the first evaluation at this held-out accuracy.
REACHED = 0.9
# The learning benchmark's recipe, before the --grpo fields.
KL_COEF = 0.2


def run_one(seed: int, lag: int, steps: int, grpo: GRPOConfig) -> dict:
    """One grpo_local run at ``lag``; its per-step answer probabilities and evaluations."""
    from echo.learner.algorithm.grpo import GRPOLearner, TrainGroup
    from echo.models.spec import ModelSpec, encode_prompt
    from echo.models.tokenizer import EOS_ID, encode
    from echo.tools.grpo_local import LocalConfig, run

    spec = ModelSpec(hidden=64, layers=2, heads=4)
    cfg = LocalConfig(seed=seed, steps=steps, threads=1, eval_every=EVAL_EVERY, spec=spec,
                      skip_uniform=True, lag=lag, grpo=grpo)
    operands = range(cfg.task_params["max_operand"])  # the addition task's 25 problems
    problems = [(a, b) for a in operands for b in operands]
    probe = [
        TrainGroup(encode_prompt(spec, f"{a}+{b}="), [ans], [[0.0] * len(ans)], [0.0])
        for a, b in problems
        for ans in [encode(str(a + b)) + [EOS_ID]]
    ]
    answer_p: list[list[float]] = []

    def on_step(learner: GRPOLearner, metrics: dict[str, float]) -> None:
        scored = learner.score(probe)
        answer_p.append([math.exp(sum(lp[0])) for lp in scored])

    history, final = run(cfg, log=False, on_step=on_step)
    curve = [(h["step"] + 1, h["greedy"]) for h in history if "greedy" in h]
    return {"seed": seed, "lag": lag, "answer_p": answer_p, "curve": curve, "final": final}


def swings(answer_p: list[list[float]], start: int) -> tuple[int, int]:
    """Swings and zigzags (see the module docstring) from step ``start`` on."""
    moves = zigzags = 0
    for t in range(max(start, 1), len(answer_p)):
        for i, p in enumerate(answer_p[t]):
            d = p - answer_p[t - 1][i]
            if abs(d) <= SWING:
                continue
            moves += 1
            if t + 1 < len(answer_p):
                back = answer_p[t + 1][i] - p
                zigzags += abs(back) > SWING and back * d < 0
    return moves, zigzags


def late_dips(curve: list[tuple[int, float]], start: int) -> int:
    """Evaluations from step ``start`` on that read more than DIP_DEPTH under the best before."""
    best, dips = 0.0, 0
    for step, acc in curve:
        dips += step > start and acc < best - DIP_DEPTH
        best = max(best, acc)
    return dips


def reached(curve: list[tuple[int, float]]) -> int | None:
    """The step of the first evaluation at REACHED or above (None: never)."""
    return next((step for step, acc in curve if acc >= REACHED), None)


def grpo_config(fields: object) -> GRPOConfig:
    """The recipe's GRPO table with ``--grpo``'s fields over it; exits with the offending field
    named when they are not a valid table: caught here, before any run starts, not in a
    worker's traceback."""
    from pydantic import ValidationError

    if not isinstance(fields, dict):
        raise SystemExit(f"--grpo must be a JSON object of GRPO fields, not {fields!r}")
    try:
        return GRPOConfig(**{"kl_coef": KL_COEF, **fields})
    except ValidationError as e:
        raise SystemExit(f"--grpo: {e}") from None


def main() -> None:
    def setup(ap):
        ap.add_argument("--seeds", type=int, default=None, help="seeds per lag")
        ap.add_argument("--steps", type=int, default=None, help="steps per run")
        ap.add_argument("--lags", type=int, nargs="+", default=None)
        ap.add_argument("--grpo", type=json.loads, default={},
                        help="GRPO fields for every run, as JSON (e.g. '{\"lr\": 5e-4}')")

    args = parse_args(__doc__.splitlines()[0], setup=setup)
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (300 if args.quick else 500)
    lags = args.lags or ([0, 1] if args.quick else [0, 1, 2])
    if 0 not in lags:
        raise SystemExit("--lags must include 0: the on-policy run is the baseline")
    grpo = grpo_config(args.grpo)
    start = round(SETTLED_FROM * steps)
    jobs = [(s, lag) for lag in lags for s in range(seeds)]
    say(f"{len(jobs)} runs of {steps} steps (lags {lags}, seeds 0-{seeds - 1}), "
        f"grpo {args.grpo or 'defaults'}; swings counted from step {start}")
    by_lag: dict[int, list[dict]] = {lag: [] for lag in lags}
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(run_one, s, lag, steps, grpo) for s, lag in jobs]
        for f in futures:
            r = f.result()
            moves, zz = swings(r["answer_p"], start)
            row = {"seed": r["seed"], "swings": moves, "zigzags": zz, "final": r["final"],
                   "late_dips": late_dips(r["curve"], start), "reached": reached(r["curve"])}
            by_lag[r["lag"]].append(row)
            say(f"lag {r['lag']} seed {r['seed']}: {moves} swings, {zz} zigzags, "
                f"{row['late_dips']} late dips, final accuracy {r['final']:.3f}, "
                f"{REACHED} first at step {row['reached']}")
    per100 = {lag: 100 * sum(r["swings"] for r in rows) / (len(rows) * (steps - start))
              for lag, rows in by_lag.items()}
    say(f"{'lag':>4} {'swings/100 steps':>17} {'zigzags':>8} {'late dips':>10} {'final':>6}")
    for lag, rows in by_lag.items():
        say(f"{lag:>4} {per100[lag]:>17.1f} {sum(r['zigzags'] for r in rows):>8} "
            f"{sum(r['late_dips'] for r in rows):>10} "
            f"{sum(r['final'] for r in rows) / len(rows):>6.3f}")
    result = {
        "steps": steps, "seeds": seeds, "grpo": args.grpo,
        "swings_per_100_steps": {str(k): round(v, 2) for k, v in per100.items()},
        "late_dips": {str(k): sum(r["late_dips"] for r in v) for k, v in by_lag.items()},
        "final_accuracy": {str(k): round(sum(r["final"] for r in v) / len(v), 3)
                           for k, v in by_lag.items()},
        "reached_at": {str(k): [r["reached"] for r in v] for k, v in by_lag.items()},
    }
    if 1 in per100:
        result["swing_ratio_lag1"] = round(per100[1] / max(per100[0], 1e-9), 2)
    emit(result)


if __name__ == "__main__":
    main()
