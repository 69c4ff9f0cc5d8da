"""``echo-job export --merged`` of a LoRA job: the adapter folded into the base by peft's
``merge_and_unload``, written as a Hugging Face folder that ``transformers`` loads and that
computes what base + adapter computes (the learner's own model), greedy output included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo.learner.checkpoints import checkpoint
from echo.learner.exports.export import ExportError
from echo.learner.exports.lora_merge import export_merged
from echo.learner.lora import LoraTrainer, adapter_ref
from echo.models.lora import lora_digest
from echo.models.spec import encode_prompt
from echo.node.engines.torch_engine import TorchEngine
from tests.learner.test_lora import SPEC, TASK, groups_from, lora_job


def test_a_merged_export_loads_with_transformers_and_computes_as_base_and_adapter(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    job = lora_job()
    trainer, _ = LoraTrainer.build(job, SPEC, tmp_path / "job")
    assert isinstance(trainer, LoraTrainer)
    engine = TorchEngine(SPEC)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    engine.load_adapter(trainer.base, trainer.published_state(), ref)
    for step in range(3):  # move the adapter well away from B = 0
        trainer.learner.step(groups_from(engine, 3, seed=11 + step, version=step))
        engine.load_adapter(None, trainer.published_state(), ref)
    checkpoint.save(tmp_path / "job" / "checkpoints", trainer.make_checkpoint(0, b""))
    digest = lora_digest(trainer.base_digest, trainer.published_state())
    files = export_merged(tmp_path / "job", job, 3, digest, tmp_path / "out")
    assert "model.safetensors" in files and "config.json" in files
    assert not any("adapter" in f for f in files)  # a plain model: nothing of peft's

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    learner = trainer.learner.model.eval()
    gap = 0.0
    for seed in range(4):
        ids = torch.tensor([encode_prompt(SPEC, TASK.prompt(40 + seed))])
        with torch.no_grad():
            want = torch.log_softmax(learner(input_ids=ids).logits, -1)
            got = torch.log_softmax(merged(input_ids=ids).logits, -1)
            gap = max(gap, (got - want).abs().max().item())
            # Greedy decoding, token for token, as base + adapter decodes.
            a = merged.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            b = learner.generate(input_ids=ids, max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        assert a.tolist() == b.tolist(), seed
    print(f"merged export vs base + adapter: max |log-prob gap| {gap:.2e}")
    assert gap < 1e-5
    # The base alone is another function: the merge is what makes the export agree.
    base_only = TorchEngine(SPEC)
    base_only.load_state(trainer.base)
    ids = torch.tensor([encode_prompt(SPEC, TASK.prompt(40))])
    with torch.no_grad():
        base_lp = torch.log_softmax(base_only.model(input_ids=ids).logits, -1)
        merged_lp = torch.log_softmax(merged(input_ids=ids).logits, -1)
    assert (base_lp - merged_lp).abs().max().item() > 100 * max(gap, 1e-7)

    # A digest the learner did not sign: refused, nothing written.
    with pytest.raises(ExportError, match="does not hold the adapter"):
        export_merged(tmp_path / "job", job, 3, "0" * 64, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(FileExistsError):
        export_merged(tmp_path / "job", job, 3, digest, tmp_path / "out")


def test_merged_is_refused_for_a_full_weight_job(tmp_path: Path) -> None:
    from echo.protocol.jobspec import parse_job

    job = parse_job({"name": "full", "warmup": {"steps": 0}})
    with pytest.raises(ExportError, match="LoRA job"):
        export_merged(tmp_path, job, 0, "0" * 64, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_echo_job_export_merged_through_the_coordinator(tmp_path: Path) -> None:
    import time

    import trio
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from echo.coordinator.api.job_cli import app as job_cli
    from echo.learner.lora import AdapterPublisher
    from echo.p2p.chunkstore import ChunkStore
    from echo.p2p.identity import Identity
    from echo.protocol import ids
    from echo.protocol import messages as m
    from tests.conftest import run_with_coordinator, submit_job
    from tests.learner.test_lora import LORA

    async def body(coord, client) -> None:
        job_id = submit_job(coord, lora=LORA, warmup={"steps": 2})
        job = lora_job(warmup={"steps": 2})
        job_dir = coord.job_dir(job_id)
        trainer, _ = LoraTrainer.build(job, SPEC, job_dir)
        assert isinstance(trainer, LoraTrainer)
        engine = TorchEngine(SPEC)
        ref = adapter_ref(trainer.shape, trainer.base_digest, False)
        engine.load_adapter(trainer.base, trainer.published_state(), ref)
        ident = Identity.load_or_create(job_dir / "learner.key")
        pub = AdapterPublisher(ident.private_key, job_id, ChunkStore(tmp_path / "chunks"), 4,
                               trainer.base, trainer.shape)  # fmt: skip
        lc = await client(ident)
        hello = m.LearnerHello(job_id=job_id, peer_id=str(lc.host.peer_id), addrs=[],
                               timestamp=time.time())  # fmt: skip
        await lc.call(ids.PROTO_LEARNER_HELLO, lc.seal(hello))
        for version in (0, 1):
            if version:
                trainer.learner.step(groups_from(engine, 3, seed=21, version=0))
                checkpoint.save(job_dir / "checkpoints", trainer.make_checkpoint(0, b""))
            env = pub.publish(trainer.published_state(), version).envelope
            report = m.StepReport(job_id=job_id, version=version, manifest=env, trained=[])
            ack = m.decode(m.StepAck, await lc.call(ids.PROTO_LEARNER_REPORT, lc.seal(report)))
            assert ack.ok, ack.message
        base = ["--url", coord.http_addrs[0], "--token", "test-token"]

        def cli(*args: str):
            r = CliRunner().invoke(job_cli, ["export", *args, *base])
            r.text = " ".join(r.output.split())
            return r

        r = await trio.to_thread.run_sync(cli, job_id, str(tmp_path / "merged"), "--merged")
        assert r.exit_code == 0, r.output
        r = await trio.to_thread.run_sync(cli, job_id, str(tmp_path / "adapter"))
        assert r.exit_code == 0, r.output
        assert (tmp_path / "adapter" / "adapter_config.json").exists()
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        ids_ = torch.tensor([encode_prompt(SPEC, TASK.prompt(5))])
        with torch.no_grad():
            want = torch.log_softmax(trainer.learner.model(input_ids=ids_).logits, -1)
            got = torch.log_softmax(merged(input_ids=ids_).logits, -1)
        assert (got - want).abs().max().item() < 1e-5

    run_with_coordinator(tmp_path / "coord", body)
