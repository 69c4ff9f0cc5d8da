"""echo.models: byte tokenizer, ModelSpec, and the published weight state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from echo.models import weights as W
from echo.models.spec import (
    ModelSpec,
    build_model,
    decode_completion,
    encode_prompt,
    eos_token_id,
    load_tokenizer,
)
from echo.models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    byte_tokenizer,
    decode,
    encode,
)

TEXTS = ["", "3+4=", "rev abc=", "héllo wörld ✓ 𝄞", " \n\t spaces ", "</s><s><pad>", "\x00\xff"]


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_model(ModelSpec(), seed=0)


# -- tokenizer ------------------------------------------------------------------------------


def test_byte_ids() -> None:
    assert (PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE) == (0, 1, 2, 259)
    assert encode("A") == [ord("A") + 3]
    assert encode("A", add_bos=True) == [BOS_ID, ord("A") + 3]
    assert decode([BOS_ID, ord("A") + 3, EOS_ID, PAD_ID]) == "A"


@pytest.mark.parametrize("text", TEXTS)
def test_fast_tokenizer_agrees_with_pure_functions(text: str) -> None:
    tok = byte_tokenizer()
    assert len(tok) == VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok(text, add_special_tokens=False).input_ids == encode(text)
    assert tok(text).input_ids == encode(text, add_bos=True)
    ids = encode(text, add_bos=True) + [EOS_ID]
    assert tok.decode(ids, skip_special_tokens=True) == decode(ids) == text


def test_special_strings_are_plain_bytes() -> None:
    # User text can never inject an EOS.
    assert EOS_ID not in encode("</s>")
    assert EOS_ID not in byte_tokenizer()("</s>").input_ids


def test_invalid_utf8_decodes_with_replacement() -> None:
    ids = [0xFF + 3, 0xFE + 3, ord("a") + 3]
    assert decode(ids) == "\ufffd\ufffda"
    assert byte_tokenizer().decode(ids) == decode(ids)


# -- spec -----------------------------------------------------------------------------------


def test_spec_roundtrip_and_strictness() -> None:
    spec = ModelSpec(hidden=32, layers=1, heads=2, kv_heads=1)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    hf = {"kind": "hf", "path": "/x"}
    assert ModelSpec.from_dict(hf).to_dict() == hf
    with pytest.raises(ValueError, match="bogus"):
        ModelSpec.from_dict({"kind": "tiny", "bogus": 1})
    with pytest.raises(ValueError, match="path"):
        ModelSpec(kind="hf")
    with pytest.raises(ValueError, match="divide"):
        ModelSpec(hidden=30, heads=4)


def test_build_tiny_is_deterministic(tiny: torch.nn.Module) -> None:
    again = build_model(ModelSpec(), seed=0)
    other = build_model(ModelSpec(), seed=1)
    assert W.state_digest(W.export_state(again)) == W.state_digest(W.export_state(tiny))
    assert W.state_digest(W.export_state(other)) != W.state_digest(W.export_state(tiny))
    assert all(p.dtype == torch.float32 for p in tiny.parameters())
    cfg = tiny.config
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (259, 1, 2, 0)
    state = torch.random.get_rng_state()
    build_model(ModelSpec(), seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched


def test_tiny_helpers() -> None:
    spec = ModelSpec()
    assert eos_token_id(spec) == EOS_ID
    assert encode_prompt(spec, "1+2=") == encode("1+2=", add_bos=True)
    assert decode_completion(spec, encode("3") + [EOS_ID]) == "3"
    assert load_tokenizer(spec)("x").input_ids == [BOS_ID, ord("x") + 3]


def test_hf_spec_loads_local_checkpoint(tmp_path, tiny: torch.nn.Module) -> None:
    tiny.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    spec = ModelSpec(kind="hf", path=str(tmp_path))
    model = build_model(spec)
    assert W.state_digest(W.export_state(model)) == W.state_digest(W.export_state(tiny))
    assert eos_token_id(spec) == EOS_ID
    assert encode_prompt(spec, "ab", load_tokenizer(spec)) == encode("ab", add_bos=True)


# -- weights --------------------------------------------------------------------------------


def test_export_is_sorted_contiguous_cpu_and_detached(tiny: torch.nn.Module) -> None:
    state = W.export_state(tiny)
    assert list(state) == sorted(state)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in state.values())
    before = tiny.model.norm.weight.detach().clone()
    state["model.norm.weight"].add_(1.0)  # must not write through to the model
    assert torch.equal(tiny.model.norm.weight, before)
    for dtype in ("bfloat16", "float16"):
        assert {t.dtype for t in W.export_state(tiny, dtype).values()} == {W.DTYPES[dtype]}
    with pytest.raises(ValueError, match="int8"):
        W.export_state(tiny, "int8")


def test_tied_weights_exported_once() -> None:
    model = build_model(ModelSpec(tie_embeddings=True))
    state = W.export_state(model)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    other = build_model(ModelSpec(tie_embeddings=True), seed=1)
    W.load_state(other, state)
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_load_state_is_exact_and_checks_names(tiny: torch.nn.Module) -> None:
    state = W.export_state(tiny, "bfloat16")
    other = build_model(ModelSpec(), seed=1)
    W.load_state(other, state)
    assert W.state_digest(W.export_state(other, "bfloat16")) == W.state_digest(state)

    missing = dict(state)
    missing.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        W.load_state(other, missing)
    with pytest.raises(ValueError, match="extra.weight"):
        W.load_state(other, {**state, "extra.weight": torch.zeros(1)})
    bad = {**state, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        W.load_state(other, bad)


def test_bytes_roundtrip_and_limits(tiny: torch.nn.Module) -> None:
    state = W.export_state(tiny, "bfloat16")
    data = W.state_to_bytes(state)
    back = W.state_from_bytes(data)
    assert W.state_digests(back) == W.state_digests(state)
    assert W.state_digest(back) == W.state_digest(state)
    with pytest.raises(ValueError, match="more than 3"):
        W.state_from_bytes(data, max_tensors=3)
    for junk in (b"", b"\x01", data[:100], b"\xff" * 8 + data[8:], data[:8] + b"{bad" + data[12:]):
        with pytest.raises(ValueError):
            W.state_from_bytes(junk)


def test_digests_see_bits_dtype_and_shape() -> None:
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert W.tensor_digest(a) == W.tensor_digest(a.clone())
    assert W.tensor_digest(a) != W.tensor_digest(torch.tensor([1.0, 2.0]))
    nudged = a.view(torch.int16).clone()
    nudged[0] += 1  # one ulp: equal enough as floats, different bits
    assert W.tensor_digest(nudged.view(torch.bfloat16)) != W.tensor_digest(a)
    z = torch.zeros(4)
    assert W.state_digest({"x": z}) != W.state_digest({"x": z.reshape(2, 2)})
    assert W.state_digest({"x": z}) != W.state_digest({"y": z})
    meta, digests = W.state_meta({"x": z}), W.state_digests({"x": z})
    assert W.digest_entries(meta, digests) == W.state_digest({"x": z})


def test_bits_roundtrip(tiny: torch.nn.Module) -> None:
    for dtype, udtype in (("float32", np.uint32), ("bfloat16", np.uint16), ("float16", np.uint16)):
        state = W.export_state(tiny, dtype)
        bits = W.to_bits(state)
        assert all(b.dtype == udtype and b.ndim == 1 for b in bits.values())
        for like in (state, W.state_meta(state)):
            back = W.from_bits(bits, like=like)
            assert W.state_digest(back) == W.state_digest(state)
    bits = W.to_bits(state)
    with pytest.raises(ValueError, match="missing"):
        W.from_bits({k: v for k, v in bits.items() if k != "model.norm.weight"}, like=state)
    bits["model.norm.weight"] = bits["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match="model.norm.weight"):
        W.from_bits(bits, like=state)
