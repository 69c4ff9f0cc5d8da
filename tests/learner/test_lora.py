"""LoRA jobs (``[job.lora]``): the spec, the learner that trains the adapter alone, versions that
are adapters (signed, hash-checked, patched losslessly), the torch engine serving them exactly,
and the coordinator refusing a node that samples from the base alone or a stale adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo.learner.algorithm.grpo import TrainGroup
from echo.learner.checkpoints import checkpoint
from echo.learner.lora import (
    AdapterInitError,
    AdapterPublisher,
    LoraTrainer,
    adapter_ref,
    write_peft_folder,
)
from echo.learner.rescoring.rescore import MISMATCH_THRESHOLDS
from echo.models.lora import lora_digest
from echo.models.spec import ModelSpec, encode_prompt
from echo.models.weights import state_digest
from echo.node.adapter_sync import AdapterError, decode_adapter_version, load_into_engine
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.identity import Identity
from echo.protocol.jobspec import JobSpec, SpecError, parse_job
from echo.protocol.manifest import verify_manifest
from echo.tasks import make_task

SPEC = ModelSpec()
TASK = make_task("addition", {"max_operand": 20})
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_job(**over) -> JobSpec:
    fields = {
        "name": "t",
        "warmup": {"steps": 2},
        "grpo": {"lr": 2e-2},
        "staleness": 2,
        "anchor_every": 3,
        "lora": LORA,
        **over,
    }
    return parse_job(fields)


def groups_from(engine: TorchEngine, n: int, seed: int, version: int) -> list[TrainGroup]:
    reqs = [
        GenRequest(
            encode_prompt(SPEC, TASK.prompt(seed + i)),
            4,
            SamplingParams(max_new_tokens=TASK.max_new_tokens, seed=seed + i),
        )
        for i in range(n)
    ]
    return [
        TrainGroup(
            r.prompt_ids,
            [c.token_ids for c in comps],
            [c.logprobs for c in comps],
            # A spread of rewards whatever was sampled: every group carries a gradient.
            [float(j % 2) for j in range(len(comps))],
            version,
        )
        for r, comps in zip(reqs, engine.generate(reqs), strict=True)
    ]


def mean_gap(groups: list[TrainGroup], scored: list[list[list[float]]]) -> float:
    reported = torch.tensor([x for g in groups for lp in g.behaviour_logprobs for x in lp])
    learner = torch.tensor([x for g in scored for c in g for x in c])
    return float((reported - learner).abs().mean())


# -- the job spec -----------------------------------------------------------------------------


def test_the_lora_table_is_validated_with_clear_errors() -> None:
    spec = lora_job()
    assert spec.lora is not None and spec.lora.rank == 4 and spec.lora.dropout == 0
    assert parse_job({"name": "t"}).lora is None
    bad = [
        ({"rank": 0, "alpha": 8}, "lora.rank"),
        ({"alpha": 8}, "lora.rank: Field required"),
        ({"rank": 4, "alpha": 8, "dropout": 0.1}, "dropout must be 0"),
        ({"rank": 4, "alpha": 8, "target_modules": ["attn"]}, "'attn' is not one of"),
        ({"rank": 4, "alpha": 8, "target_modules": []}, "lora.target_modules"),
        ({"rank": 4, "alpha": 8, "target_modules": ["q_proj", "q_proj"]}, "twice"),
        ({"rank": 4, "alpha": 8, "rnak": 2}, "lora.rnak: unknown key"),
        ({"rank": 4, "alpha": -1}, "lora.alpha"),
    ]
    for table, message in bad:
        with pytest.raises(SpecError, match=message):
            parse_job({"name": "t", "lora": table})


# -- the learner ------------------------------------------------------------------------------


def test_the_learner_trains_the_adapter_alone_and_checkpoints_only_it(tmp_path: Path) -> None:
    job = lora_job()
    trainer, ckpt = LoraTrainer.build(job, SPEC, tmp_path / "job")
    assert ckpt is None and isinstance(trainer, LoraTrainer)
    model = trainer.learner.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    optimized = {id(p) for g in trainer.learner.opt.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if n in trainable}
    base_before = {n: t.clone() for n, t in trainer.base.items()}
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()
                     if not p.requires_grad}  # fmt: skip
    adapter_before = trainer.published_state()

    engine = TorchEngine(SPEC)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    for step in range(3):
        engine.load_adapter(trainer.base, trainer.published_state(), ref)
        trainer.learner.step(groups_from(engine, 3, seed=10 * step, version=trainer.version))

    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), n  # the base never moves, bit for bit
    assert all(torch.equal(trainer.base[n], base_before[n]) for n in base_before)
    after = trainer.published_state()
    assert any(not torch.equal(after[n], adapter_before[n]) for n in after)
    # Optimizer state exists for the adapter's parameters only.
    state_ids = set(trainer.learner.opt.state_dict()["state"])
    assert len(state_ids) == len(trainable)

    saved = trainer.make_checkpoint(0, b"report")
    assert set(saved.model_state) == set(after)  # the adapter alone, nothing of the base
    checkpoint.save(tmp_path / "job" / "checkpoints", saved)
    again, ckpt = LoraTrainer.build(job, SPEC, tmp_path / "job")
    assert ckpt is not None and again.version == 3
    assert isinstance(again, LoraTrainer) and again.base_digest == trainer.base_digest
    restored = again.published_state()
    assert all(torch.equal(restored[n], after[n]) for n in after)
    moments = again.learner.opt.state_dict()["state"]
    assert len(moments) == len(trainable)


def test_an_init_folder_must_fit_the_job(tmp_path: Path) -> None:
    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "a")
    assert isinstance(trainer, LoraTrainer)
    adapter = {n: torch.full_like(t, 0.01) for n, t in trainer.published_state().items()}
    write_peft_folder(tmp_path / "init", adapter, trainer.shape)
    started, _ = LoraTrainer.build(lora_job(lora={**LORA, "init": str(tmp_path / "init")}),
                                   SPEC, tmp_path / "b")  # fmt: skip
    assert all(torch.equal(started.published_state()[n], adapter[n]) for n in adapter)
    with pytest.raises(AdapterInitError, match="the job asks for"):
        LoraTrainer.build(lora_job(lora={**LORA, "rank": 8, "init": str(tmp_path / "init")}),
                          SPEC, tmp_path / "c")  # fmt: skip
    with pytest.raises(AdapterInitError, match="not a peft adapter folder"):
        LoraTrainer.build(lora_job(lora={**LORA, "init": str(tmp_path / "none")}),
                          SPEC, tmp_path / "d")  # fmt: skip


# -- versions are adapters --------------------------------------------------------------------


def test_adapter_versions_round_trip_through_signed_manifests(tmp_path: Path) -> None:
    job = lora_job()
    trainer, _ = LoraTrainer.build(job, SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    key = Identity.generate()
    store = ChunkStore(tmp_path / "chunks", keep_versions=2)
    pub = AdapterPublisher(key.private_key, "job1", store, job.anchor_every, trainer.base,
                           trainer.shape)  # fmt: skip
    engine = TorchEngine(SPEC)
    held_base, held_digest, adapter = None, "", None
    manifests = {}
    for v in range(5):
        if v:
            ref = adapter_ref(trainer.shape, trainer.base_digest, False)
            engine.load_adapter(trainer.base, trainer.published_state(), ref)
            trainer.learner.step(groups_from(engine, 2, seed=v, version=v - 1))
        published = pub.publish(trainer.published_state(), v)
        man = manifests[v] = verify_manifest(published.envelope, key.public_key_bytes, "job1", v)
        assert man.adapter is not None and man.adapter.base_digest == trainer.base_digest
        assert man.adapter.carries_base == (v == 0)
        assert man.kind == ("anchor" if v % job.anchor_every == 0 else "patch")
        payload = b"".join(store.get(c.sha256) for c in man.chunks)
        got_base, adapter = decode_adapter_version(man, payload, held_digest, adapter)
        if v == 0:
            assert got_base is not None and state_digest(got_base) == trainer.base_digest
            held_base, held_digest = got_base, man.adapter.base_digest
        else:
            assert got_base is None
            # Only the adapter travels: far smaller than the base.
            assert published.payload_bytes * 20 < sum(
                t.numel() * t.element_size() for t in trainer.base.values()
            )
        want = trainer.published_state()
        assert all(torch.equal(adapter[n], want[n]) for n in want)
        assert man.state_digest == lora_digest(trainer.base_digest, want)
    assert 0 in store.versions()  # the base stays for late joiners, past two anchors

    # A stale adapter, the base alone, another base, a tampered payload: all refused.
    assert held_base is not None
    last = verify_manifest(published.envelope, key.public_key_bytes, "job1", 4)
    payload = b"".join(store.get(c.sha256) for c in last.chunks)
    with pytest.raises(AdapterError, match="needs the adapter"):
        decode_adapter_version(last, payload, held_digest, None)
    anchor = manifests[3]
    assert anchor.kind == "anchor" and not anchor.adapter.carries_base
    anchor_payload = b"".join(store.get(c.sha256) for c in anchor.chunks)
    assert decode_adapter_version(anchor, anchor_payload, held_digest, None)[1]
    with pytest.raises(AdapterError, match="this node holds none"):
        decode_adapter_version(anchor, anchor_payload, "", None)
    with pytest.raises(AdapterError, match="is an adapter of base"):
        decode_adapter_version(anchor, anchor_payload, "0" * 64, None)
    flipped = anchor_payload[:-1] + bytes([anchor_payload[-1] ^ 1])
    with pytest.raises(AdapterError, match="tensor hashes"):
        decode_adapter_version(anchor, flipped, held_digest, None)
    with pytest.raises(AdapterError, match="corrupt"):
        decode_adapter_version(last, payload[:-1] + bytes([payload[-1] ^ 1]), held_digest,
                               adapter)  # fmt: skip


def test_the_torch_engine_serves_adapters_exactly_and_reports_what_it_holds(
    tmp_path: Path,
) -> None:
    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    engine = TorchEngine(SPEC)
    engine.load_adapter(trainer.base, trainer.published_state(), ref)
    for step in range(3):  # move the adapter well away from B = 0
        trainer.learner.step(groups_from(engine, 3, seed=100 + step, version=trainer.version))
        engine.load_adapter(None, trainer.published_state(), ref)  # a switch: no base sent
    adapter = trainer.published_state()
    served = lora_digest(trainer.base_digest, adapter)
    assert engine.lora_served == served == engine.state_digest()

    groups = groups_from(engine, 4, seed=300, version=trainer.version)
    gap = mean_gap(groups, trainer.learner.score(groups))
    print(f"torch engine with the adapter vs the learner: mean |log-prob gap| {gap:.2e}")
    assert gap < MISMATCH_THRESHOLDS["torch"]

    # The base alone samples another function, and says so in its digest.
    base_only = TorchEngine(SPEC)
    base_only.load_state(trainer.base)
    base_groups = groups_from(base_only, 4, seed=300, version=trainer.version)
    assert mean_gap(base_groups, trainer.learner.score(base_groups)) > 10 * gap
    assert lora_digest(trainer.base_digest, None) != served
    # A node's check after loading: the engine must serve the version's digest.
    stale = {n: t.clone() for n, t in adapter.items()}
    next(iter(stale.values())).add_(1.0)
    with pytest.raises(AdapterError, match="serves digest"):
        load_into_engine(engine, ref, trainer.base, stale, served)
    load_into_engine(engine, ref, trainer.base, adapter, served)
    with pytest.raises(ValueError, match="does not hold base"):
        TorchEngine(SPEC).load_adapter(None, adapter, ref)
    # Back to a full-weight job: the plain model again.
    engine.load_state(trainer.base)
    assert engine.state_digest() == trainer.base_digest and engine.lora_served == ""


def test_an_exported_adapter_loads_with_peft_and_computes_as_the_learner(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from echo.learner.exports.export import ExportError, export_version
    from echo.models.spec import build_model
    from echo.models.weights import load_state

    job = lora_job()
    trainer, _ = LoraTrainer.build(job, SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    engine = TorchEngine(SPEC)
    engine.load_adapter(trainer.base, trainer.published_state(), adapter_ref(
        trainer.shape, trainer.base_digest, False))  # fmt: skip
    trainer.learner.step(groups_from(engine, 3, seed=7, version=0))
    checkpoint.save(tmp_path / "job" / "checkpoints", trainer.make_checkpoint(0, b""))
    digest = lora_digest(trainer.base_digest, trainer.published_state())
    files = export_version(tmp_path / "job", job, 1, digest, tmp_path / "out")
    assert files == ["adapter_config.json", "adapter_model.safetensors"]

    base = build_model(SPEC)
    load_state(base, load_file(str(tmp_path / "job" / "lora_base.safetensors")))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "out")).eval()
    ids = torch.tensor([encode_prompt(SPEC, TASK.prompt(3))])
    with torch.no_grad():
        want = trainer.learner.model(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    with pytest.raises(ExportError, match="does not hold the adapter"):
        export_version(tmp_path / "job", job, 1, "0" * 64, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    with pytest.raises(ExportError, match="no checkpoint of version 5"):
        export_version(tmp_path / "job", job, 5, digest, tmp_path / "out3")
