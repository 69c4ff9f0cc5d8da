"""What the FSDP2 learner's tests share (the full-weights and the LoRA ones): running the worker
under torchrun, the single learner's reference runs the sharded ones are compared with, and the
checks of a run that resumed from a checkpoint.

The reference runs are the same for both: batches A (3 groups of v0, judged in the step), B (3
of v0, re-scored, one made up; 2 of v1) and C (1 group of v1: one rank's share of the step and of
the re-scoring is empty); and, for the restarts, A then D (3 groups of v1) and C. After a restart
at v1 the learner holds no weights of v0 (its groups are unscorable, for the single learner
too), so the run a restart must reproduce goes on with v1's groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from echo.protocol import codec
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec

WORKER = Path(__file__).with_name("fsdp_worker.py")

# (trainer, published state, version, seeds, seed of the made-up group or -1) -> the groups
Sampler = Callable[[Any, dict, int, range, int], list[m.TrainingGroup]]


def torchrun(nproc: int, *args: str | Path, timeout: float = 300) -> None:
    """Run the worker under torchrun; fail the test with its output if it fails."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def job_dir(root: Path, name: str, job: JobSpec) -> Path:
    """A new job folder ``root/jobs/name`` holding ``job`` (the warm-up cache, ``root/cache``,
    is shared by every job under ``root``)."""
    d = root / "jobs" / name
    d.mkdir(parents=True)
    (d / "job.json").write_text(job.model_dump_json())
    return d


def verdicts(result: Any) -> list[list]:
    return [[v.rollout_id, v.ok, v.reason] for v in result.verdicts]


def read_batches(path: Path) -> list[list[m.TrainingGroup]]:
    return [
        [m.decode(m.TrainingGroup, g, max_bytes=1 << 26) for g in b]
        for b in codec.unpackb(path.read_bytes(), max_bytes=1 << 28)
    ]


def reference_runs(root: Path, job: JobSpec, build: Callable[[Path], Any], sample: Sampler) -> dict:
    """The single learner (``build(job folder)`` makes one) through A, B, C and, restarted, A,
    D, C (see the module docstring), sampling with ``sample``. The batches are written under
    ``root/batches`` as the worker reads them: ``abc``, ``a`` and ``dc``."""
    trainer = build(job_dir(root, "single", job))
    s0 = trainer.published_state()
    a = sample(trainer, s0, 0, range(0, 3), -1)
    ra = trainer.train(a)
    s1 = trainer.published_state()
    trainer.remember(1, s1)
    b = sample(trainer, s0, 0, range(10, 13), 11) + sample(trainer, s1, 1, range(20, 22), -1)
    rb = trainer.train(b)
    s2 = trainer.published_state()
    trainer.remember(2, s2)
    c = sample(trainer, s1, 1, range(30, 31), -1)
    rc = trainer.train(c)
    again = build(job_dir(root, "single-again", job))
    again.train(a)
    again.remember(1, again.published_state())
    d = sample(trainer, s1, 1, range(40, 43), -1)
    rd = again.train(d)
    again.remember(2, again.published_state())
    rc2 = again.train(c)
    batches = root / "batches"
    batches.mkdir()
    for name, bs in (("abc", [a, b, c]), ("a", [a]), ("dc", [d, c])):
        (batches / name).write_bytes(codec.packb([[m.encode(g) for g in x] for x in bs]))
    return {
        "root": root,
        "job": job,
        "batches": batches,
        "groups": {"a": a, "b": b, "c": c, "d": d},
        "trainer": trainer,
        "start": s0,
        "state": trainer.published_state(),
        "states": [s1, s2, trainer.published_state()],  # after A, B and C
        "results": [ra, rb, rc],
        "restart_state": again.published_state(),
        "restart_results": [rd, rc2],
    }


def one_thread() -> Iterator[None]:
    """Compute on one thread while the generator is suspended (a module's autouse fixture):
    the single learner the ranks are held to must sum as each rank does, and the worker runs
    on one thread (``torch.set_num_threads(1)``); a matrix product split over threads may sum
    in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def single_in_parts(
    trainer: Any, steps: list[tuple[list[m.TrainingGroup], int]]
) -> tuple[list[Any], list[dict]]:
    """``trainer`` (a single learner's) trained on each batch of ``steps`` in its number of
    parts (``GRPOLearner.parts``: the arithmetic of that many ranks), each version remembered
    as the learner does; the step results and the state published after each step."""
    results, states = [], []
    for batch, parts in steps:
        trainer.learner.parts = parts
        results.append(trainer.train(batch))
        states.append(trainer.published_state())
        trainer.remember(trainer.version, states[-1])
    return results, states


def max_diff(state: dict, want: dict) -> float:
    """max |state - want| over every element of the same tensors."""
    assert state.keys() == want.keys()
    return max(float((state[k] - want[k]).abs().max()) for k in want)


def resumed_run(ref: dict, out: Path, trained: bool = True) -> dict:
    """The published state after the worker's run into ``out`` that resumed at v1 and trained
    D and C, checked against the reference's restart run: the same verdicts (and, if
    ``trained``, the same groups trained) at every step."""
    got = json.loads((out / "results.json").read_text())
    assert got["resumed"] == 1 and got["version"] == 3
    for step, want in zip(got["steps"], ref["restart_results"], strict=True):
        assert step["verdicts"] == verdicts(want)
        if trained:
            assert step["trained"] == want.trained
    return load_file(str(out / "state.safetensors"))


def restart_at_v1(ref: dict, name: str, nproc: int) -> Path:
    """A new job whose ``nproc`` ranks trained A and checkpointed v1 (DCP); its folder."""
    root = ref["root"]
    job = job_dir(root, name, ref["job"])
    torchrun(nproc, job, ref["batches"] / "a", root / f"out-{name}", "--save-at", "1")
    meta = json.loads((job / "checkpoints" / "v00000001" / "meta.json").read_text())
    assert meta["format"] == "dcp"
    return job


def single_resumes(ref: dict, trainer: Any, ckpt: Any) -> dict:
    """The single learner ``trainer``, built on a job checkpointed at v1 (``ckpt``), trains D
    and C as the reference's restart run did; its published state."""
    assert ckpt is not None and ckpt.version == 1 and ckpt.report == b"v1"
    trainer.remember(1, trainer.published_state())
    for batch, want in zip(
        read_batches(ref["batches"] / "dc"), ref["restart_results"], strict=True
    ):
        assert verdicts(trainer.train(batch)) == verdicts(want)
        trainer.remember(trainer.version, trainer.published_state())
    return trainer.published_state()


def single_checkpoint_at_v1(ref: dict, name: str, build: Callable[[Path], Any]) -> Path:
    """A new job whose single learner trained A and checkpointed v1; its folder."""
    job = job_dir(ref["root"], name, ref["job"])
    trainer = build(job)
    trainer.train(read_batches(ref["batches"] / "a")[0])
    trainer.save_checkpoint(job / "checkpoints", 0, b"v1")
    return job
