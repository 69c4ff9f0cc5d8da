"""Export: a version the real learner published, as a Hugging Face folder that
``AutoModelForCausalLM.from_pretrained`` loads with the published tensors bit for bit (the tiny
model and a small pretrained-style model built here from a config), its errors, and the whole
path through the coordinator's HTTP API and ``echo-job export``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from echo.coordinator.api.job_cli import app as job_cli
from echo.learner.exports.export import (
    ExportError,
    export_version,
    read_back,
    write_weights,
)
from echo.learner.exports.staging import staged_folder
from echo.learner.service import Learner
from echo.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, byte_tokenizer
from echo.models.weights import to_bits
from echo.p2p.identity import Identity
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.jobspec import parse_job
from tests.conftest import run_with_coordinator

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


def job_dir_for(tmp: Path, **over) -> Path:
    spec = parse_job(
        {
            "name": "exp",
            "publish_dtype": "bfloat16",
            "task": {"name": "addition", "params": {"max_operand": 5}},
            "warmup": {"steps": 0},
            **over,
        }
    )
    d = tmp / "jobs" / "exp-1"
    d.mkdir(parents=True)
    (d / "job.json").write_text(spec.model_dump_json())
    return d


def learner_at(job_dir: Path) -> Learner:
    learner = Learner(job_dir, "exp-1", "/ip4/127.0.0.1/tcp/1", torch.get_num_threads())
    learner.build()
    return learner


def publish_next(learner: Learner, seed: int) -> tuple[dict[str, torch.Tensor], bytes]:
    """Move the weights (as an optimizer step would) and publish them as the next version;
    returns the published state and the signed report."""
    model = learner.trainer.learner.model
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    learner.trainer.learner.version += 1
    learner.version = learner.trainer.version
    state = learner.trainer.published_state()
    return state, learner._publish([], [], {"reward": 0.5, "tokens": 100.0, "step_s": 0.1})


def report_digest(sealed: bytes, learner: Learner) -> str:
    key = learner.identity.public_key_bytes
    rep = signing.open_record(sealed, m.StepReport, expected_signer=key)[1]
    return signing.open_record(rep.manifest, m.Manifest, expected_signer=key)[1].state_digest


def assert_loads_bit_for_bit(folder: Path, published: dict[str, torch.Tensor]) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    loaded = model.state_dict()
    for name, t in published.items():
        assert loaded[name].dtype == t.dtype, name
    got = to_bits({n: loaded[n] for n in published})
    want = to_bits(published)
    assert all((got[n] == want[n]).all() for n in want)


def test_the_tiny_model_exports_bit_for_bit_with_its_byte_tokenizer(tmp_path: Path) -> None:
    learner = learner_at(job_dir_for(tmp_path))
    _, sealed0 = publish_next(learner, 0)
    state, sealed = publish_next(learner, 1)
    out = tmp_path / "out"
    spec = learner.spec
    files = export_version(learner.job_dir, spec, 2, report_digest(sealed, learner), out)
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(files)
    assert_loads_bit_for_bit(out, state)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("1+2=").input_ids == byte_tokenizer()("1+2=").input_ids
    # The checkpoint of version 1 does not hold version 2's state: refused, not exported wrong.
    with pytest.raises(ExportError, match="does not hold the state"):
        export_version(learner.job_dir, spec, 1, report_digest(sealed, learner), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    publish_next(learner, 2)  # v3: the learner keeps v2 and v3
    with pytest.raises(ExportError, match=r"version 1 is not kept .*kept: v2, v3"):
        export_version(learner.job_dir, spec, 1, report_digest(sealed0, learner), tmp_path / "y")
    with pytest.raises(FileExistsError):
        export_version(learner.job_dir, spec, 2, report_digest(sealed, learner), out)


def small_pretrained(folder: Path) -> Path:
    """A small Llama-architecture checkpoint with tied embeddings and a chat template, as a
    researcher's pretrained model folder looks (built from a config, no download)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def test_a_pretrained_model_exports_with_tied_weights_and_its_chat_template(tmp_path) -> None:
    path = small_pretrained(tmp_path / "pretrained")
    learner = learner_at(job_dir_for(tmp_path, model={"kind": "hf", "path": str(path)}))
    assert learner.spec.warmup.steps == 0  # the default for a pretrained model
    state, sealed = publish_next(learner, 3)
    assert "lm_head.weight" not in state  # tied: published once, as the embedding
    out = tmp_path / "out"
    export_version(learner.job_dir, learner.spec, 1, report_digest(sealed, learner), out)
    assert_loads_bit_for_bit(out, state)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|user|>hi\n"


def test_echo_job_export_through_the_coordinator(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = coord.submit_job(
            parse_job(
                {
                    "name": "cli",
                    "publish_dtype": "bfloat16",
                    "warmup": {"steps": 0},
                    "task": {"name": "addition", "params": {"max_operand": 5}},
                }
            )
        )
        job_dir = coord.job_dir(job_id)
        learner = Learner(job_dir, job_id, coord.multiaddrs[0], torch.get_num_threads())
        await trio.to_thread.run_sync(learner.build)
        lc = await client(Identity.load_or_create(job_dir / "learner.key"))
        hello = m.LearnerHello(job_id=job_id, peer_id=str(lc.host.peer_id), addrs=[], timestamp=0.0)
        await lc.call(ids.PROTO_LEARNER_HELLO, lc.seal(hello))
        states = []
        for seed in (5, 6):  # v0 (base) and v1, each reported as the learner reports them
            if not states:
                state, sealed = learner.trainer.published_state(), learner._publish([], [], {})
            else:
                state, sealed = publish_next(learner, seed)
            ack = m.decode(m.StepAck, await lc.call(ids.PROTO_LEARNER_REPORT, sealed))
            assert ack.ok, ack.message
            states.append(state)
        base = ["--url", coord.http_addrs[0], "--token", "test-token"]

        def cli(*args: str):
            r = CliRunner().invoke(job_cli, ["export", *args, *base])
            r.text = " ".join(r.output.split())  # rich wraps lines at the terminal's width
            return r

        out = tmp_path / "exported"
        r = await trio.to_thread.run_sync(cli, job_id, str(out))
        assert r.exit_code == 0, r.output
        assert_loads_bit_for_bit(out, states[1])  # default: the newest version
        r = await trio.to_thread.run_sync(cli, job_id, str(tmp_path / "v0"), "--version", "0")
        assert r.exit_code == 0, r.output
        assert_loads_bit_for_bit(tmp_path / "v0", states[0])
        # Clear errors: a folder that is not empty, an unknown job, a version never published.
        r = await trio.to_thread.run_sync(cli, job_id, str(out))
        assert r.exit_code == 2 and "not an empty folder" in r.text
        r = await trio.to_thread.run_sync(cli, "nope", str(tmp_path / "a"))
        assert r.exit_code == 1 and "no such job" in r.text
        r = await trio.to_thread.run_sync(cli, job_id, str(tmp_path / "b"), "--version", "7")
        assert r.exit_code == 1 and "has no version 7" in r.text
        r = await trio.to_thread.run_sync(cli, job_id, str(tmp_path / "c"), "--merged")
        assert r.exit_code == 1 and "is not a LoRA job" in r.text

    run_with_coordinator(tmp_path, body)


def test_a_staged_export_is_complete_or_absent(tmp_path: Path) -> None:
    out = tmp_path / "exports" / "v3"
    with pytest.raises(ExportError, match="half written"), staged_folder(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        raise ExportError("half written")
    assert not out.exists() and list(out.parent.iterdir()) == []
    with staged_folder(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in out.parent.iterdir()] == ["v3"]
    assert (out / "config.json").read_text() == "{}"


def test_read_back_finds_a_tensor_changed_on_disk(tmp_path: Path) -> None:
    state = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.bfloat16)}
    write_weights(state, tmp_path, None)
    read_back(state, tmp_path)
    raw = (tmp_path / "model.safetensors").read_bytes()
    # The last byte is in the last tensor's data ("b", sorted after "a").
    (tmp_path / "model.safetensors").write_bytes(raw[:-1] + bytes([raw[-1] ^ 0x01]))
    with pytest.raises(ExportError, match="tensor 'b' was not written as published"):
        read_back(state, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(ExportError, match=r"missing from the written files: \['c'\]"):
        read_back({**state, "c": torch.zeros(1)}, tmp_path)
