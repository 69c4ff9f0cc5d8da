"""The learner on a device other than the CPU: resolution of device names everywhere, and, where
torch sees a CUDA GPU, the policy, the re-scorer, checkpoints and the torch engine on it.

The CUDA tests are skipped on machines without one (CI's); ``scripts/gpu_check.sh`` runs them on
a GPU machine. Their tolerances are those of fp32 on two kinds of hardware: equal up to
summation order, far inside the re-scoring thresholds (``MISMATCH_THRESHOLDS``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from echo.coordinator.config import CoordinatorConfig
from echo.learner.algorithm.grpo import GRPOLearner, TrainGroup
from echo.learner.checkpoints import checkpoint
from echo.learner.rescoring.prefill import completion_logits
from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.learner.trainer import Trainer
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec, build_model, decode_completion, encode_prompt
from echo.models.tokenizer import EOS_ID, PAD_ID
from echo.models.weights import export_state
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec
from echo.tasks import make_task

SPEC = ModelSpec()
# Operands up to 99: prompts of 4 to 6 tokens, so batches are padded (left in the engine and the
# prefill's prompt pass, right in the step), the path where a GPU's kernels differ most.
TASK = make_task("addition", {"max_operand": 100})
# The accelerator the device tests run on; ECHO_TEST_DEVICE=cpu runs their logic anywhere (the
# CPU against itself), =mps on a Mac.
DEVICE = os.environ.get("ECHO_TEST_DEVICE", "cuda")
cuda = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="torch sees no CUDA GPU"
)


# -- names (every machine) --------------------------------------------------------------------


def test_device_names_resolve_or_say_why_not() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="not 'gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    else:
        with pytest.raises(ValueError, match="numbered from 0"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_the_coordinator_config_checks_and_passes_the_learner_device(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="learner.device"):
        CoordinatorConfig.model_validate({"learner": {"device": "gpu0"}})
    cfg = CoordinatorConfig.model_validate({"learner": {"device": "cuda:1"}})
    assert cfg.learner.device == "cuda:1"
    assert CoordinatorConfig().learner.device == "auto"


# -- CUDA -------------------------------------------------------------------------------------


def groups_from(engine: TorchEngine, n: int, seed: int, version: int = 0) -> list[TrainGroup]:
    reqs = [
        GenRequest(
            encode_prompt(SPEC, TASK.prompt(seed + i)),
            8,
            SamplingParams(max_new_tokens=TASK.max_new_tokens, seed=seed + i),
        )
        for i in range(n)
    ]
    return [
        TrainGroup(
            r.prompt_ids,
            [c.token_ids for c in comps],
            [c.logprobs for c in comps],
            [TASK.reward(seed + i, decode_completion(SPEC, c.token_ids)) for c in comps],
            version,
        )
        for i, (r, comps) in enumerate(zip(reqs, engine.generate(reqs), strict=True))
    ]


def flat(scores: list[list[list[float]]]) -> torch.Tensor:
    out = torch.tensor([x for g in scores for c in g for x in c])
    assert bool(out.isfinite().all())
    return out


def test_the_test_batches_are_padded() -> None:
    engine = TorchEngine(SPEC, threads=1)
    lengths = {len(g.prompt_ids) for g in groups_from(engine, 12, seed=0)}
    assert len(lengths) > 1, lengths


@cuda
def test_a_step_on_cuda_matches_the_step_on_the_cpu() -> None:
    cpu = GRPOLearner(build_model(SPEC, seed=5))
    gpu = GRPOLearner(build_model(SPEC, seed=5).to(DEVICE))
    engine = TorchEngine(SPEC, threads=1)
    engine.load_state(export_state(cpu.model))
    groups = groups_from(engine, 6, seed=100)
    assert (flat(gpu.score(groups)) - flat(cpu.score(groups))).abs().max() < 1e-4
    mc, mg = cpu.step(groups), gpu.step(groups)
    assert mg["loss"] == pytest.approx(mc["loss"], abs=1e-4)
    assert mg["mismatch"] < MISMATCH_THRESHOLDS["torch"]
    # AdamW's first step moves every weight by about lr whatever its gradient's size, so
    # compare what the weights compute, not the weights.
    assert (flat(gpu.score(groups)) - flat(cpu.score(groups))).abs().max() < 1e-3


@cuda
def test_the_prefill_on_cuda_matches_the_whole_sequence_forward() -> None:
    model = build_model(SPEC, seed=2).to(DEVICE).eval()
    engine = TorchEngine(SPEC, threads=1)
    engine.load_state(export_state(model))
    groups = groups_from(engine, 5, seed=300)
    whole = flat(GRPOLearner(model).score(groups))
    with torch.no_grad():
        logits, tokens = completion_logits(
            model, [g.prompt_ids for g in groups], [g.completions for g in groups], PAD_ID
        )
    shared = torch.log_softmax(logits.float(), -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (shared.cpu() - whole).abs().max() < 1e-5


def wire_batch(engine: TorchEngine, version: int, n: int, seed: int) -> list[m.TrainingGroup]:
    """``n`` groups sampled by ``engine`` as a node reports them for ``version``."""
    return [
        m.TrainingGroup(
            rollout_id=f"r{seed}-{i}", node_id="n", prompt_id=seed + i,
            prompt_tokens=list(g.prompt_ids), version=version, engine="torch",
            rewards=g.rewards,
            completions=[
                m.TrainingCompletion(token_ids=list(c), logprobs=np.float32(lp).tolist(),
                                     finish_reason="stop" if c[-1] == EOS_ID else "length")
                for c, lp in zip(g.completions, g.behaviour_logprobs, strict=True)
            ],
        )
        for i, g in enumerate(groups_from(engine, n, seed))
    ]  # fmt: skip


@cuda
def test_a_cuda_learner_passes_honest_cpu_nodes_and_restarts_on_the_cpu(tmp_path: Path) -> None:
    job = JobSpec(name="t", staleness=2)
    trainer, ckpt = Trainer.build(job, SPEC, tmp_path / "job", DEVICE)
    assert ckpt is None and trainer.learner.device.type == resolve_device(DEVICE).type
    assert next(trainer.rescorer.model.parameters()).device.type == resolve_device(DEVICE).type
    engine = TorchEngine(SPEC, threads=1)  # a node on a CPU
    stale: list[m.TrainingGroup] = []
    for step in range(3):
        v = trainer.version
        state = trainer.published_state()
        assert all(t.device.type == "cpu" for t in state.values())
        engine.load_state(state)
        # Groups of the current version are judged from the step's own forward; those of the
        # version before are re-scored by a prefill under its weights.
        fresh = wire_batch(engine, v, 3, seed=100 * step)
        res = trainer.train(stale + fresh)
        assert res.metrics["rejected"] == 0, [x for x in res.verdicts if not x.ok]
        assert res.metrics["rescored_in_step"] == len(stale)
        assert max(x.stats["mismatch"] for x in res.verdicts) < MISMATCH_THRESHOLDS["torch"]
        trainer.remember(trainer.version, trainer.published_state())
        stale = wire_batch(engine, v, 2, seed=100 * step + 50)  # sampled from v, trained at v+1

    # What the learner process checkpoints (learner/service.py), then a restart on the CPU.
    save_like_the_learner(tmp_path / "job", trainer)
    kept = checkpoint.latest(tmp_path / "job" / "checkpoints")
    assert kept is not None
    assert all(t.device.type == "cpu" for t in kept.model_state.values())
    assert all(
        t.device.type == "cpu"
        for st in kept.optim_state["state"].values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    again, ckpt = Trainer.build(job, SPEC, tmp_path / "job", "cpu")
    assert ckpt is not None and again.version == trainer.version == 3
    for a, b in zip(
        again.learner.model.parameters(), trainer.learner.model.parameters(), strict=True
    ):
        assert torch.equal(a, b.cpu())
    # It goes on from there: the optimizer's moments came along to the CPU.
    again.remember(again.version, again.published_state())
    engine.load_state(again.published_state())
    res = again.train(wire_batch(engine, again.version, 3, seed=900))
    assert res.metrics["rejected"] == 0 and again.version == 4


@cuda
def test_a_cpu_checkpoint_restarts_on_the_device(tmp_path: Path) -> None:
    job = JobSpec(name="t", staleness=2)
    cpu, _ = Trainer.build(job, SPEC, tmp_path / "job", "cpu")
    engine = TorchEngine(SPEC, threads=1)
    engine.load_state(cpu.published_state())
    cpu.train(wire_batch(engine, 0, 3, seed=1))
    save_like_the_learner(tmp_path / "job", cpu)
    dev, ckpt = Trainer.build(job, SPEC, tmp_path / "job", DEVICE)
    assert ckpt is not None and dev.version == 1
    assert dev.learner.device.type == resolve_device(DEVICE).type
    dev.remember(1, dev.published_state())
    engine.load_state(dev.published_state())
    res = dev.train(wire_batch(engine, 1, 3, seed=2))
    assert res.metrics["rejected"] == 0 and dev.version == 2


def save_like_the_learner(job_dir: Path, trainer: Trainer) -> None:
    """The checkpoint learner/service.py writes after a step."""
    checkpoint.save(job_dir / "checkpoints", trainer.make_checkpoint(0, b""))


@cuda
def test_the_torch_engine_on_cuda_agrees_with_a_cpu_learner() -> None:
    learner = GRPOLearner(build_model(SPEC, seed=7))
    engine = TorchEngine(SPEC, device=DEVICE)
    engine.load_state(export_state(learner.model))
    groups = groups_from(engine, 6, seed=500)
    reported = torch.tensor([x for g in groups for lp in g.behaviour_logprobs for x in lp])
    gap = float((reported - flat(learner.score(groups))).abs().mean())
    print(f"torch engine on {DEVICE} vs the CPU learner: mean |log-prob gap| {gap:.2e}")
    kind = resolve_device(DEVICE).type
    assert gap < MISMATCH_THRESHOLDS["torch" if kind == "cpu" else f"torch-{kind}"], gap
