"""The learner's per-rank memory estimate (``echo.learner.memory``, ``echo-job plan``): parameter
counts equal the models torch builds, sharding divides the training state as FSDP2 does, and a
learner that cannot fit is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from echo.coordinator.api.job_cli import _print_learner_memory
from echo.learner import memory
from echo.models.lora import LoraShape, inject
from echo.models.spec import ModelSpec, build_model
from echo.protocol.jobspec import parse_job

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize(
    "fields",
    [{}, {"hidden": 96, "layers": 3, "heads": 6, "kv_heads": 2, "tie_embeddings": True}],
)
def test_the_shape_counts_the_parameters_torch_builds(fields: dict) -> None:
    spec = ModelSpec(**fields)
    model = build_model(spec)
    shape = memory.shape_of(spec.model_dump(exclude_none=True))
    assert shape.params() == sum(p.numel() for p in model.parameters())
    inject(model, LoraShape(4, 8.0, tuple(LORA["target_modules"])))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory.lora_params(shape, 4, LORA["target_modules"]) == trained


def test_a_hugging_face_folder_is_sized_from_its_config(tmp_path: Path) -> None:
    config = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
              "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = memory.shape_of({"kind": "hf", "path": str(tmp_path)})
    assert shape.params() == 134_515_008  # SmolLM2-135M's published count
    with pytest.raises(ValueError, match="cannot size the model"):
        memory.shape_of({"kind": "hf", "path": str(tmp_path / "missing")})


def test_fsdp2_divides_the_training_state_by_the_ranks() -> None:
    job = parse_job({"name": "t", "batch_groups": 8})
    model, fields = job.model_spec_dict(), job.model_dump(mode="json")
    single = memory.estimate(model, fields)
    two = memory.estimate(model, fields, "fsdp2", 2)
    p = single.params
    assert single.state_bytes == 16 * p and single.gathered_bytes == 0
    assert two.state_bytes == 16 * ((p + 1) // 2)
    assert two.activations_bytes * 2 == single.activations_bytes  # half the groups each
    assert two.compute_dtype == "float32"
    gpu = memory.estimate(model, fields, "fsdp2", 2, "cuda")
    assert gpu.compute_dtype == "bfloat16" and gpu.activations_bytes < two.activations_bytes
    assert gpu.state_bytes == two.state_bytes  # fp32 masters, grads and moments either way
    lora = parse_job({"name": "t", "lora": LORA, "grpo": {"kl_coef": 0.1}})
    est = memory.estimate(lora.model_spec_dict(), lora.model_dump(mode="json"), "fsdp2", 2)
    assert est.trained_params < est.params // 10 and est.reference_bytes == est.weights_bytes
    with pytest.raises(ValueError, match="needs backend"):
        memory.estimate(model, fields, "single", 2)
    # Activation checkpointing keeps each layer's input and one layer's activations; the
    # logits and everything else are the same.
    ac = memory.estimate(model, fields, "fsdp2", 2, checkpoint_layers=True)
    shape = memory.shape_of(model)
    per_layer = 10 * shape.hidden + 4 * shape.intermediate + 2 * shape.kv_dim
    tokens = two.tokens_per_rank
    layers_part = tokens * shape.layers * per_layer * 4
    assert ac.activations_bytes == two.activations_bytes - layers_part + tokens * (
        shape.layers * shape.hidden + per_layer
    ) * 4
    assert ac.activations_bytes < two.activations_bytes and ac.state_bytes == two.state_bytes
    with pytest.raises(ValueError, match="activation_checkpointing needs"):
        memory.estimate(model, fields, "single", 1, checkpoint_layers=True)


def test_a_learner_that_cannot_fit_is_refused_with_its_reason(capsys) -> None:
    job = parse_job({"name": "t"})
    seven_b = memory.Shape(4096, 32, 32, 8, 14336, 128256, False)  # Llama-3-8B-like
    need = memory.estimate(job.model_spec_dict(), job.model_dump(mode="json"), "fsdp2", 8,
                           "cuda", shape=seven_b)  # fmt: skip
    assert 16 * seven_b.params() // 8 <= need.state_bytes <= 16 * seven_b.params() // 8 + 64
    why = memory.misfit(need, 10 * 10**9)
    assert why is not None and "8 learner rank(s)" in why
    assert memory.misfit(need, 80 * 10**9) is None and memory.misfit(need, 0) is None
    planned = memory.plan(job.model_dump(mode="json"), "fsdp2", 2, "cpu")
    assert planned["fits"] and planned["available_per_rank_bytes"] > 0
    assert _print_learner_memory(planned)
    assert not _print_learner_memory({**planned, "fits": False, "misfit": why})
    out = capsys.readouterr().out
    assert "does not fit" in out and "weights" in out and "activations" in out


def test_the_estimate_matches_the_state_a_trainer_holds(tmp_path: Path) -> None:
    from echo.learner.trainer import Trainer

    job = parse_job({"name": "t", "warmup": {"steps": 0}})
    trainer, _ = Trainer.build(job, ModelSpec(), tmp_path / "job", "cpu")
    model, opt = trainer.learner.model, trainer.learner.opt
    for p in model.parameters():  # a step's gradients and moments, without a batch
        p.grad = torch.zeros_like(p)
    opt.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim())
    assert memory.estimate(job.model_spec_dict(), job.model_dump(mode="json")).state_bytes == held
