"""Learning under asynchrony: the swarm against a synchronous trainer of the same recipe.

One recipe (the tiny model, ``a+b=`` with operands below 5, 16 groups of 16 per step, the job's
default GRPO settings, the same number of versions and so the same rollouts trained) runs as:

- ``sync``: on-policy GRPO in one process (``tools/grpo_local.py``'s loop), the baseline;
- ``torch/S``: a real local swarm (coordinator, learner and three node processes on loopback,
  as ``scripts/demo`` runs them) of torch nodes at staleness S;
- ``mixed/S``: the same with llama.cpp nodes beside the torch ones (and a vLLM node with
  ``--vllm``, when ``.venv-vllm`` exists; every configuration then uses the 2-head model vLLM's
  CPU attention needs, so that all compare the same model).

S bounds how old a trained group may be; how old they are depends on how far ahead of the
learner the coordinator keeps groups (2 batches by default, whatever S is) and on whether the
nodes outpace the learner enough to fill that buffer. With the default, groups on loopback were
at most about 1 version old at every S (the runs before 2026-12-05 measured S = 2 and 4 that
way: the same experiment as S = 1). So each swarm at S may keep S + 1 batches ahead
(``local_swarm.py --buffer-batches``, the coordinator's ``buffer_groups``), and the table prints
the staleness each configuration reached (the mean and the most of the learner's per-version
figures); ``--default-buffer`` keeps the default. On 2 cores, where the learner and the nodes
share the CPU, the buffer rarely fills: groups at S = 4 were 0.7-0.9 versions old on average.
``tools/grpo_local.py --lag N`` trains at a fixed staleness N.

Per configuration, over seeds (model initialisation and warm-up; the swarm's sampling seeds are
random by design): the held-out greedy accuracy at the end (``echo.learner.evaluate``, the same
function in both), reward per rollout consumed (the mean of each version's trained-batch reward,
the area under the curve), collapses (10 versions in a row with mean reward under 0.02 after the
reward first passed 0.1) and wall time. The baseline is measured in the same run.

    python benchmarks/learning.py            # 5 seeds, S = 1, 2, 4, torch and mixed (hours)
    python benchmarks/learning.py --quick    # 2 seeds, S = 2, torch and mixed (~20 min on 2 cores)
    python benchmarks/learning.py --out DIR  # keep each run in DIR; run again to go on from there
    python benchmarks/learning.py --skip-uniform  # dynamic sampling in every configuration
    python benchmarks/learning.py --skip-uniform --kl-coef 0.2 --steps 300 --seeds 10  # README
    python benchmarks/learning.py ... --lr 7e-4  # another learning rate in every configuration

With ``--skip-uniform`` groups whose samples all scored the same are not trained on (the job's
``skip_uniform_groups``; ``grpo_local``'s flag for the baseline), and the reward column reads the
trained batches, which leave those out: it is higher than the sampled reward. ``--kl-coef K``
adds the job's KL term to the starting policy (``kl_coef``) in every configuration: without it
a run stops where the prompts whose answer no other prompt shares (``0+0``, ``4+4``) have lost
all mass on it, which is where most of the spread between seeds came from (README).

Every finished run is kept under ``--out`` (a new dated folder by default): ``sync-seed<N>.json``
for the baseline, ``<engines>-S<S>-seed<N>/summary.json`` for a swarm. Run again with the same
``--out`` and the runs already there are read back instead of made again, so that a run of hours
cut short loses one run at most; the folder's ``recipe.json`` must match the arguments.

The JSON line: ``swarm_vs_sync`` (the worst swarm configuration's mean final accuracy over the
synchronous one's), ``mixed_vs_torch`` (the worst staleness's mixed over torch), and
``collapses_total`` over every swarm and synchronous run. Each ratio comes with a 90% bootstrap
interval (``*_interval``: runs resampled within each configuration): on this recipe one run either
leaves the plateau of always giving the commonest sum (greedy accuracy 0.19) within its budget or
does not, so a mean over a few seeds moves by a tenth with one run, and the interval says whether
a ratio under 1 is a difference or that coin. ``late_dip_rate_sync`` and ``late_dip_rate_swarm``:
the share of held-out evaluations in the last third of the runs (every 10 versions, the baseline's
too) that read more than 0.05 under the best the run had reached, the recipe's late oscillation
that decides where a run's last evaluation lands; a swarm that learned worse late would show it.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from echo.protocol.jobspec import GRPOParams
from echo.tools.bench import emit, parse_args, say
from echo.tools.curves import DIP_DEPTH, EVAL_EVERY, LATE_FROM

ROOT = Path(__file__).resolve().parent.parent

# A collapse: this many versions in a row under COLLAPSE_REWARD once the reward has passed
# COLLAPSE_AFTER (before that, a low reward is a slow start, not a collapse).
COLLAPSE_RUN = 10
COLLAPSE_REWARD = 0.02
COLLAPSE_AFTER = 0.1
# Bootstrap resamples for the intervals of the ratios (a second at most) and their coverage.
BOOTSTRAP_DRAWS = 4000
INTERVAL = 0.90
# The recipe's learning rate (the job's default, GRPOParams.lr), unless --lr says otherwise.
LR = GRPOParams.model_fields["lr"].default
# What folders made before recipe.json recorded the lr ran at: the default until 2026-12-05.
LR_BEFORE_RECORDED = 1e-3


def late_dips(curve: list[list[float]], steps: int) -> tuple[int, int]:
    """Of a run's held-out evaluations (``[version, accuracy]`` pairs) from LATE_FROM of its
    ``steps`` on: how many there were, and how many read more than DIP_DEPTH under the best
    accuracy the run had reached before them (an answer it had and lost)."""
    evals = dips = 0
    best = 0.0
    for version, acc in curve:
        if version >= round(LATE_FROM * steps):
            evals += 1
            dips += acc < best - DIP_DEPTH
        best = max(best, acc)
    return evals, dips


def collapses(rewards: list[float]) -> int:
    """Count maximal runs of at least COLLAPSE_RUN versions under COLLAPSE_REWARD that start
    after the reward first exceeded COLLAPSE_AFTER."""
    count, run, armed = 0, 0, False
    for r in rewards:
        armed = armed or r > COLLAPSE_AFTER
        if armed and r < COLLAPSE_REWARD:
            run += 1
            if run == COLLAPSE_RUN:
                count += 1
        else:
            run = 0
    return count


def run_sync(
    seed: int,
    steps: int,
    heads: int,
    out: Path,
    skip_uniform: bool = False,
    kl_coef: float = 0.0,
    lr: float = LR,
) -> dict:
    """The synchronous baseline in this process, or the one kept in ``out`` (a JSON file)."""
    kept = json.loads(out.read_text()) if out.exists() else None
    if kept is not None and "eval_curve" in kept:  # runs made before the curve was kept: again
        return kept
    from echo.learner.algorithm.grpo import GRPOConfig
    from echo.models.spec import ModelSpec
    from echo.tools.grpo_local import LocalConfig, run

    t0 = time.perf_counter()
    # Greedy evaluation draws no random numbers: the curve leaves the run as it was.
    cfg = LocalConfig(seed=seed, steps=steps, threads=1, eval_every=EVAL_EVERY,
                      spec=ModelSpec(hidden=64, layers=2, heads=heads), skip_uniform=skip_uniform,
                      grpo=GRPOConfig(kl_coef=kl_coef, lr=lr))
    history, final = run(cfg, log=False)
    rewards = [h["reward"] for h in history]
    curve = [[h["step"] + 1, h["greedy"]] for h in history if "greedy" in h]
    result = {"eval_last": final, "rewards": rewards, "wall_s": time.perf_counter() - t0,
              "eval_curve": curve}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)  # whole or absent: a run cut short is made again
    return result


def run_swarm(
    seed: int,
    steps: int,
    staleness: int,
    engines: str,
    out: Path,
    skip_uniform: bool = False,
    buffer_batches: int = 0,
    kl_coef: float = 0.0,
    lr: float = LR,
) -> dict:
    """One local swarm (real processes) through tools/local_swarm.py; its summary, read back
    from ``out`` when a finished run is kept there (a run cut short is made again, afresh)."""
    summary_path = out / "summary.json"
    kept = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if kept is not None and kept.get("status") == "done" and "bench_wall_s" in kept:
        return _swarm_result(kept, kept["bench_wall_s"])
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "echo.tools.local_swarm", "--quiet",
           "--engines", engines, "--staleness", str(staleness), "--steps", str(steps),
           "--seed", str(seed), "--out", str(out), "--timeout", str(max(600, 6 * steps))]
    cmd += ["--skip-uniform"] if skip_uniform else []
    cmd += ["--buffer-batches", str(buffer_batches)] if buffer_batches else []
    cmd += ["--kl-coef", str(kl_coef)] if kl_coef else []
    cmd += ["--lr", str(lr)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    said = proc.stdout[-4000:] + proc.stderr[-4000:]
    if out.exists():
        (out / "local_swarm.log").write_text(proc.stdout + proc.stderr)
    if not summary_path.exists():
        raise RuntimeError(f"swarm run failed (exit {proc.returncode}): {said}")
    s = json.loads(summary_path.read_text())
    if s["status"] != "done":
        raise RuntimeError(f"swarm run ended {s['status']}; logs in {out}: {said}")
    s["bench_wall_s"] = wall  # marks the run as finished for this benchmark
    tmp = summary_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(s))
    tmp.replace(summary_path)
    return _swarm_result(s, wall)


def _swarm_result(s: dict, wall: float) -> dict:
    steps = [v for v in s["learner_by_version"] if v["version"] > 0]
    return {"eval_last": s["eval_last"], "eval_first": s["eval_first"],
            "rewards": [v["reward"] for v in steps], "wall_s": wall,
            "eval_curve": [[e["version"], e["accuracy"]] for e in s["eval_by_version"]],
            # How stale the trained groups were (the learner's figures per version): what the
            # run exercised, which S only bounds.
            "staleness_mean": statistics.fmean(v["staleness_mean"] for v in steps),
            "staleness_max": max(v["staleness_max"] for v in steps)}


def check_recipe(out: Path, recipe: dict) -> None:
    """Write ``recipe`` to ``out/recipe.json``, or exit if the folder holds another recipe's runs
    (they would not compare)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recipe.json"
    if path.exists():
        kept = json.loads(path.read_text())
        kept.setdefault("lr", LR_BEFORE_RECORDED)
        if kept != recipe:
            sys.exit(f"{out} holds runs of another recipe ({kept}, here {recipe}): "
                     "choose another --out")
    else:
        path.write_text(json.dumps(recipe))


def summarize(runs: list[dict], steps: int) -> dict:
    accs = [r["eval_last"] for r in runs]
    late = [late_dips(r["eval_curve"], steps) for r in runs]
    return {
        "late_evals": sum(n for n, _ in late),
        "late_dips": sum(d for _, d in late),
        "late_dip_rate": sum(d for _, d in late) / max(1, sum(n for n, _ in late)),
        "eval_last_mean": statistics.fmean(accs),
        "eval_last_min": min(accs),
        "eval_last": accs,
        "reward_per_rollout": statistics.fmean(statistics.fmean(r["rewards"]) for r in runs),
        "collapses": sum(collapses(r["rewards"]) for r in runs),
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs),
        # Absent for the synchronous baseline, whose groups are all fresh.
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in runs),
        "staleness_max": max(r.get("staleness_max", 0) for r in runs),
    }


def ratio_interval(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float]:
    """The INTERVAL percentile bootstrap interval of mean(num) / mean(den), resampling the runs
    of each side on their own (they are independent runs); a fixed seed, so a rerun over the
    same runs prints the same interval."""
    rng = random.Random(seed)
    draws = sorted(
        statistics.fmean(rng.choices(num, k=len(num)))
        / max(statistics.fmean(rng.choices(den, k=len(den))), 1e-9)
        for _ in range(BOOTSTRAP_DRAWS)
    )
    tail = (1 - INTERVAL) / 2
    return draws[int(tail * BOOTSTRAP_DRAWS)], draws[int((1 - tail) * BOOTSTRAP_DRAWS) - 1]


def main() -> None:
    def setup(ap) -> None:
        ap.add_argument("--seeds", type=int, default=None, help="seeds per configuration")
        ap.add_argument("--steps", type=int, default=200, help="versions per run")
        ap.add_argument("--staleness", type=int, nargs="+", default=None)
        ap.add_argument("--configs", nargs="+", default=["torch", "mixed"],
                        choices=["torch", "mixed"], help="swarm engine sets")
        ap.add_argument("--vllm", action="store_true", help="a vLLM node in the mixed swarms")
        ap.add_argument("--skip-uniform", action="store_true",
                        help="dynamic sampling everywhere: no training on groups whose rewards "
                             "are all equal (the job's skip_uniform_groups, grpo_local's flag)")
        ap.add_argument("--kl-coef", type=float, default=0.0,
                        help="the KL term to the starting policy everywhere (the job's "
                             "kl_coef, grpo_local's --kl-coef)")
        ap.add_argument("--lr", type=float, default=LR,
                        help="learning rate in every configuration (the job's [job.grpo] lr)")
        ap.add_argument("--default-buffer", action="store_true",
                        help="leave the coordinator's buffer at its default of 2 batches, where "
                             "trained groups stay about 1 version old at every S (the runs "
                             "before 2026-12-05); by default a swarm at S may keep S + 1 "
                             "batches ahead of the learner, so its groups can reach the "
                             "staleness S allows")
        ap.add_argument("--out", type=Path, default=None,
                        help="folder for the runs; an existing one is gone on from "
                             "(default: runs/learning/<date-time>)")

    args = parse_args(__doc__, setup=setup)
    seeds = args.seeds or (2 if args.quick else 5)
    stalenesses = args.staleness or ([2] if args.quick else [1, 2, 4])
    mixed = "llamacpp,torch,vllm" if args.vllm else "llamacpp,torch"
    heads = 2 if args.vllm else 4
    if args.vllm and "mixed" in args.configs:
        say("note: --vllm gives every configuration the 2-head model (vLLM on CPU needs it);"
            " the swarm's job template must match")
    results: dict[str, dict] = {}
    out = args.out or ROOT / "runs" / "learning" / time.strftime("%Y%m%d-%H%M%S")
    recipe = {"steps": args.steps, "heads": heads, "mixed": mixed}
    if args.skip_uniform:  # only when set: folders of the plain recipe stay readable
        recipe["skip_uniform"] = True
    if args.kl_coef:  # likewise
        recipe["kl_coef"] = args.kl_coef
    recipe["lr"] = args.lr  # a folder made before this was recorded ran at LR_BEFORE_RECORDED
    if not args.default_buffer:  # likewise: folders made before the option stay readable
        recipe["buffer_batches"] = "S+1"
    check_recipe(out, recipe)
    say(f"runs kept in {out}")

    say(f"sync baseline: {seeds} seeds x {args.steps} steps")
    runs = []
    for seed in range(seeds):
        runs.append(run_sync(seed, args.steps, heads, out / f"sync-seed{seed}.json",
                             args.skip_uniform, args.kl_coef, args.lr))
        say(f"  seed {seed}: final greedy accuracy {runs[-1]['eval_last']:.3f}, "
            f"{runs[-1]['wall_s']:.0f} s")
    results["sync"] = summarize(runs, args.steps)

    for engines in args.configs:
        for s in stalenesses:
            name = f"{engines}/S{s}"
            say(f"{name}: {seeds} seeds x {args.steps} versions")
            runs = []
            for seed in range(seeds):
                r = run_swarm(seed, args.steps, s, mixed if engines == "mixed" else "torch",
                              out / f"{engines}-S{s}-seed{seed}", args.skip_uniform,
                              0 if args.default_buffer else s + 1, args.kl_coef, args.lr)
                runs.append(r)
                say(f"  seed {seed}: final greedy accuracy {r['eval_last']:.3f} "
                    f"(from {r['eval_first']:.3f}), collapses {collapses(r['rewards'])}, "
                    f"groups {r['staleness_mean']:.2f} versions old (max "
                    f"{r['staleness_max']:.0f}), {r['wall_s']:.0f} s")
            results[name] = summarize(runs, args.steps)

    base = results["sync"]["eval_last_mean"]
    say("")
    sync_accs = results["sync"]["eval_last"]
    interval = {
        k: ratio_interval(v["eval_last"], sync_accs) for k, v in results.items() if k != "sync"
    }
    pct = f"{INTERVAL:.0%}"
    say(f"{'configuration':<14} {'final acc':>9} {'min':>6} {'vs sync':>8} {pct + ' interval':>14} "
        f"{'reward/rollout':>14} {'collapses':>9} {'late dips':>9} {'staleness':>9} {'wall s':>7}")
    for name, r in results.items():
        span = "-" if name == "sync" else "{:.2f}-{:.2f}".format(*interval[name])
        say(f"{name:<14} {r['eval_last_mean']:9.3f} {r['eval_last_min']:6.3f} "
            f"{r['eval_last_mean'] / base:8.2f} {span:>14} "
            f"{r['reward_per_rollout']:14.3f} {r['collapses']:9d} {r['late_dip_rate']:9.2f} "
            f"{'{:.2f}/{:.0f}'.format(r['staleness_mean'], r['staleness_max']):>9} "
            f"{r['wall_s_mean']:7.0f}")
    swarm = {k: v for k, v in results.items() if k != "sync"}
    ratio = {k: v["eval_last_mean"] / base for k, v in swarm.items()}
    worst = min(ratio, key=ratio.__getitem__) if ratio else None
    pairs = {f"S{s}": (results[f"mixed/S{s}"], results[f"torch/S{s}"]) for s in stalenesses
             if f"mixed/S{s}" in results and f"torch/S{s}" in results}
    by_s = {s: (m["eval_last_mean"] / t["eval_last_mean"],
                ratio_interval(m["eval_last"], t["eval_last"]))
            for s, (m, t) in pairs.items()}
    for s, (r, (lo, hi)) in by_s.items():
        say(f"mixed over torch at {s}: {r:.2f} ({pct} interval {lo:.2f}-{hi:.2f})")
    worst_s = min(by_s, key=lambda k: by_s[k][0]) if by_s else None
    emit({
        "swarm_vs_sync": ratio[worst] if worst else None,
        "swarm_vs_sync_interval": interval[worst] if worst else None,
        "swarm_vs_sync_by_config": ratio,
        "mixed_vs_torch": by_s[worst_s][0] if worst_s else None,
        "mixed_vs_torch_interval": by_s[worst_s][1] if worst_s else None,
        "mixed_vs_torch_by_staleness": {k: v[0] for k, v in by_s.items()},
        "collapses_total": sum(r["collapses"] for r in results.values()),
        "late_dip_rate_sync": results["sync"]["late_dip_rate"],
        "late_dip_rate_swarm": sum(v["late_dips"] for v in swarm.values())
        / max(1, sum(v["late_evals"] for v in swarm.values())),
        "sync_eval_last": base,
        "configs": results,
        "seeds": seeds,
        "steps": args.steps,
        "quick": args.quick,
    })


if __name__ == "__main__":
    main()
