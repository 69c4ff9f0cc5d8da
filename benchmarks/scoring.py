"""What the scoring sandbox costs: groups scored in it against the same scorers in-process.

The coordinator scores every completion in a job's sandbox (``echo.tasks.sandbox``: a child
forked from a confined zygote per group, frames over a socket) instead of calling the reward in
its own process. For each workload this times, on the same groups of honest completions, the
job's reward called in this process (``JobReward``, the baseline: what the coordinator did before
the sandbox) and ``Sandbox.score``, one call per group, and prints the ratio. It also times how
long a zygote takes to start (paid once per job, and again after a kill only for the zygote,
never for a child).

Workloads: ``addition`` (the demo's task: exact match, so nearly all of the sandbox's cost is its
own), ``gym:basic_arithmetic`` (reasoning-gym's scorer) and ``dataset`` with math-verify and a
format bonus (GSM8K-style). Groups of 16; ``--quick``: fewer groups.

JSON: ``sandbox_vs_inprocess_<workload>`` (seconds per group in the sandbox over in-process),
``sandbox_ms_per_group_<workload>``, ``zygote_start_s_<workload>``.
"""

from __future__ import annotations

import time
from pathlib import Path

from echo.tasks.registry import make_task
from echo.tasks.sandbox import Recipe, Sandbox
from echo.tasks.scoring import JobReward, RewardTerm
from echo.tools.bench import emit, median, parse_args, say

ROOT = Path(__file__).resolve().parent.parent
GROUP = 16
WORKLOADS = {
    "addition": Recipe("addition", {"max_operand": 50}),
    "gym": Recipe("gym:basic_arithmetic", {}),
    "math": Recipe(
        "dataset",
        {"path": str(ROOT / "tests" / "data" / "gsm8k_mini.jsonl")},
        (RewardTerm("math"), RewardTerm("format", weight=0.1)),
    ),
}


def groups(recipe: Recipe, n: int) -> list[tuple[int, list[str]]]:
    """``n`` groups of honest-looking completions: half right answers, half near misses."""
    task = make_task(recipe.task, recipe.params)
    out = []
    for g in range(n):
        pid = g % 40
        answer = task.answer(pid)
        texts = [
            f"Let me think.\n<answer>{answer}</answer>" if i % 2 else f"<answer>{answer}1</answer>"
            for i in range(GROUP)
        ]
        out.append((pid, texts))
    return out


def bench(name: str, recipe: Recipe, n: int) -> dict[str, float]:
    work = groups(recipe, n)
    task = make_task(recipe.task, recipe.params)
    reward = JobReward(task, recipe.rewards)
    reward(work[0][0], work[0][1][0])  # imports and caches, as the sandbox's warm-up does
    inproc = []
    for pid, texts in work:
        t0 = time.perf_counter()
        for t in texts:
            reward.detailed(pid, t)
        inproc.append(time.perf_counter() - t0)
    with Sandbox(recipe) as sandbox:
        t0 = time.perf_counter()
        sandbox.start()
        start = time.perf_counter() - t0
        boxed = []
        for pid, texts in work:
            context = task.scoring_context(pid)
            t0 = time.perf_counter()
            scores = sandbox.score(pid, texts, context)
            boxed.append(time.perf_counter() - t0)
            expected = [reward(pid, t) for t in texts]
            if [s.value for s in scores] != expected:
                raise SystemExit(f"{name}: the sandbox scored {scores} where {expected}")
    per_in, per_box = median(inproc), median(boxed)
    say(
        f"{name:9s} in-process {per_in * 1e3:7.2f} ms/group  sandbox {per_box * 1e3:7.2f} "
        f"ms/group  ratio {per_box / per_in:6.1f}  zygote start {start:.2f} s"
    )
    return {
        f"sandbox_vs_inprocess_{name}": round(per_box / per_in, 2),
        f"sandbox_ms_per_group_{name}": round(per_box * 1e3, 2),
        f"zygote_start_s_{name}": round(start, 2),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 60 if args.quick else 400
    result: dict[str, float] = {"groups": n, "group_size": GROUP}
    for name, recipe in WORKLOADS.items():
        result.update(bench(name, recipe, n))
    emit(result)


if __name__ == "__main__":
    main()
