r"""The job that benchmarks/attack.py's swarm trains under attack, and its learner warm-up kept
between runs.

Scorer bombs only reach an interpreter through a scorer that has one, so the swarm
trains a reasoning-gym task whose scorer ``eval()``\ s the answer, with math-verify (sympy) as a
second reward term: every bomb goes through both kinds of hostile-input parser. The default,
``gym:binary_matrix`` at 3x3, is the eval-ing dataset with the shortest prompts (~320 tokens
without a system prompt; spiral_matrix ~800, string_insertion ~930): honest work per version
stays small enough that a 30 s phase holds a dozen versions. Completions may be 256 tokens, the
room a bomb gets (the tiny model's byte tokenizer: 255 bytes and EOS; a "1 MB string" does not
fit any lease: the protocol caps completions at 8192 tokens). The tiny model learns nothing
there (its rewards are all 0, and lr 1e-6 keeps the policy, and so the work per version, where
the warm-up left it), so what is measured is the swarm's throughput in versions per minute,
as for the addition job (``--task addition``, issue 13's job).

The learner's format warm-up of the job is kept between runs (:data:`WARMUP_CACHE`): only the
first run of a job spends it (about a minute).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from echo.tools.swarm import job_toml

# The attacked job: a gym task whose scorer eval()s (see the module doc), scored by the task and
# by math-verify. Parameters per dataset keep prompts and answers short.
GYM_PARAMS = {
    "binary_matrix": "min_n = 3, max_n = 3",
    "spiral_matrix": "max_n = 3",
    "string_insertion": "max_string_length = 8",
    "n_queens": "n = 4, max_remove = 2",
}
GYM_MAX_NEW_TOKENS = 256
GYM_JOB_TOML = """\
[job]
name = "attack"
steps = 100000
group_size = 8
batch_groups = 4
staleness = 2
anchor_every = 10
publish_dtype = "float32"

[job.model]
kind = "tiny"
hidden = 64
layers = 2
heads = 4

[job.task]
name = "{task}"
params = {{ system_prompt = "", max_new_tokens = {max_new_tokens}{params} }}

[[job.reward]]
kind = "task"

[[job.reward]]
kind = "math"

[job.grpo]
lr = 1e-6

[job.sampling]
max_new_tokens = {max_new_tokens}

[job.warmup]
steps = {warmup}

[job.eval]
every = 0
"""
# Format warm-up steps of the gym job: enough for the tiny model to close its answers with
# EOS (40 steps: 30 tokens per completion) rather than fill all 256 tokens (8x the work).
GYM_WARMUP = 40
# The learner caches its warm-up under ``<coordinator data dir>/cache`` (learner/trainer.py),
# keyed by everything that determines it; a run starts from the previous runs' copies and adds
# its own, so only the first run of a job spends the warm-up (about a minute on 2 busy cores).
WARMUP_CACHE = Path(tempfile.gettempdir()) / "echo-attack-warmup-cache"


def gym_job(task: str) -> str:
    """The attacked gym job's toml (see the module doc)."""
    dataset = task.removeprefix("gym:")
    params = GYM_PARAMS.get(dataset, "")
    return GYM_JOB_TOML.format(
        task=task,
        max_new_tokens=GYM_MAX_NEW_TOKENS,
        params=f", {params}" if params else "",
        warmup=GYM_WARMUP,
    )


def attack_job(task: str) -> str:
    """The attacked job's toml: :func:`gym_job` for a ``gym:<dataset>``, else the small job of
    ``task`` (say, ``addition``)."""
    if task.startswith("gym"):
        return gym_job(task)
    # lr 1e-6: the policy stays where the warm-up left it, so the work per version (the
    # completions' lengths, what re-scoring and verification cost) does not drift
    # between phases as the model learns (at lr 1e-3 one run went 153 -> 220
    # versions/min from its first unattacked phase to its last).
    return job_toml(
        "attack",
        task=task,
        steps=100000,
        group_size=8,
        batch_groups=4,
        warmup=5,
        eval_every=0,
        lr=1e-6,
    )


def restore_warmup(cache: Path) -> None:
    """Copy the previous runs' warm-ups into a coordinator's ``cache`` folder, before it starts."""
    cache.mkdir(parents=True, exist_ok=True)
    for cached in WARMUP_CACHE.glob("warmup-*.safetensors"):
        shutil.copy2(cached, cache / cached.name)


def keep_warmup(cache: Path) -> None:
    """Keep the warm-ups a run made in ``cache`` for the next runs (see :data:`WARMUP_CACHE`)."""
    WARMUP_CACHE.mkdir(exist_ok=True)
    for made in cache.glob("warmup-*.safetensors"):
        if not (WARMUP_CACHE / made.name).exists():
            shutil.copy2(made, WARMUP_CACHE / f".{made.name}.tmp")
            os.replace(WARMUP_CACHE / f".{made.name}.tmp", WARMUP_CACHE / made.name)
