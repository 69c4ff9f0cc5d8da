"""Writing a policy state as a GGUF file for llama.cpp, patching it in place, and reading it back.

The GGUF is written directly with ``gguf.GGUFWriter`` (llama.cpp's bundled converter refuses the
in-memory byte tokenizer of the tiny model), for the Llama family only:

- ``llama``: ``LlamaForCausalLM`` (the tiny model, Llama 2/3-style checkpoints with default RoPE;
  optional attention biases). Q and K rows get the official converter's permutation, because
  transformers rotates halves of each head (``rotate_half``) where llama.cpp's ``llama`` graph
  rotates adjacent pairs.
- ``qwen2``: ``Qwen2ForCausalLM`` (Q/K/V biases). llama.cpp runs it with NEOX RoPE, the layout
  transformers uses, so nothing is permuted.

Matrices are stored in the precision they were published in (F32, F16 or BF16; ``dtype`` may
override it) and never quantized, so a weight patch stays exact. 1-D tensors (norms, biases) are
stored as F32 as the official converter does (llama.cpp multiplies them in F32); F32 holds every
F16/BF16 value exactly, and reading back checks that it still does.

:class:`GGUFFile` remembers where each tensor's bytes start in the file, so a new version is
applied by comparing the new bits with the file's and writing only the elements that changed
(:meth:`GGUFFile.update`, through ``numpy.memmap``), and :meth:`GGUFFile.read_state` rebuilds the
state from the file's bytes (undoing the permutation) so its digest is that of what llama.cpp
maps, not of what we meant to write.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from echo.models.spec import ModelSpec
from echo.models.weights import dtype_name

# ggml type ids (ggml.h) of the float types we write; nothing quantized.
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
_GGML_BY_DTYPE = {"float32": GGML_F32, "float16": GGML_F16, "bfloat16": GGML_BF16}
_DTYPE_BY_GGML = {v: k for k, v in _GGML_BY_DTYPE.items()}
_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Bit views: patches compare and write bit patterns (so -0.0 and NaNs are exact too).
_UINT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_TORCH_INT = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}
# general.file_type (llama_ftype): ALL_F32, MOSTLY_F16, MOSTLY_BF16.
_FILE_TYPE = {"float32": 0, "float16": 1, "bfloat16": 32}

# gguf token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 3, 4, 5, 6

# Elements compared and written per step by GGUFFile.update (bounds its temporary memory).
UPDATE_CHUNK = 1 << 22

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# Limits on what read_tensor_infos accepts: it parses files we wrote, but never trusts a length.
_MAX_TENSORS = 1 << 16
_MAX_KV = 1 << 16
_MAX_STRING = 1 << 20


# ---------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class LlamaLayout:
    """The hyper-parameters a Llama-family GGUF needs, from a :class:`ModelSpec` or HF config."""

    arch: Literal["llama", "qwen2"]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    o_bias: bool


def layout_of(model: ModelSpec | LlamaLayout | Any) -> LlamaLayout:
    """The :class:`LlamaLayout` of a :class:`ModelSpec` or a transformers ``PretrainedConfig``
    (a :class:`LlamaLayout` is returned as it is).

    Raises NotImplementedError for architectures or features this exporter does not write
    (model types other than llama/qwen2, RoPE scaling, MLP biases, sliding windows).
    """
    if isinstance(model, LlamaLayout):
        return model
    config = _config_of(model) if isinstance(model, ModelSpec) else model
    model_type = getattr(config, "model_type", None)
    if model_type not in ("llama", "qwen2"):
        raise NotImplementedError(
            f"GGUF export supports llama and qwen2 models, not {model_type!r}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported by the GGUF export")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "mlp_bias", False):
        raise NotImplementedError("MLP biases are not supported by the GGUF export")
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported by the GGUF export")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    return LlamaLayout(
        arch=model_type,
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        context_length=int(config.max_position_embeddings),
        rms_eps=float(config.rms_norm_eps),
        rope_theta=float(theta),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
    )


def _config_of(spec: ModelSpec) -> Any:
    """The transformers config of ``spec``: read from disk for ``hf``; for ``tiny`` the config
    ``build_model`` makes, built on the meta device so no weights are allocated."""
    if spec.kind == "hf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    from echo.models.spec import build_model

    with torch.device("meta"):
        return build_model(spec).config


@dataclass(frozen=True)
class TensorSlot:
    """Where one state tensor goes: its GGUF name, its (torch-order) shape, and the number of
    heads its rows are permuted over (None: not permuted)."""

    gguf_name: str
    shape: tuple[int, ...]
    permute_heads: int | None = None


def expected_tensors(layout: LlamaLayout) -> dict[str, TensorSlot]:
    """State name (transformers) -> :class:`TensorSlot`, for every tensor the state must hold."""
    h, hd, ff = layout.hidden, layout.head_dim, layout.intermediate
    q_rows, kv_rows = layout.heads * hd, layout.kv_heads * hd
    # Only the llama graph needs the rotate-half -> pairs permutation (see the module docstring).
    pq = layout.heads if layout.arch == "llama" else None
    pk = layout.kv_heads if layout.arch == "llama" else None
    out = {
        "model.embed_tokens.weight": TensorSlot("token_embd.weight", (layout.vocab, h)),
        "model.norm.weight": TensorSlot("output_norm.weight", (h,)),
    }
    if not layout.tied:
        out["lm_head.weight"] = TensorSlot("output.weight", (layout.vocab, h))
    for i in range(layout.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[p + "input_layernorm.weight"] = TensorSlot(b + "attn_norm.weight", (h,))
        out[p + "self_attn.q_proj.weight"] = TensorSlot(b + "attn_q.weight", (q_rows, h), pq)
        out[p + "self_attn.k_proj.weight"] = TensorSlot(b + "attn_k.weight", (kv_rows, h), pk)
        out[p + "self_attn.v_proj.weight"] = TensorSlot(b + "attn_v.weight", (kv_rows, h))
        out[p + "self_attn.o_proj.weight"] = TensorSlot(b + "attn_output.weight", (h, q_rows))
        if layout.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = TensorSlot(b + "attn_q.bias", (q_rows,), pq)
            out[p + "self_attn.k_proj.bias"] = TensorSlot(b + "attn_k.bias", (kv_rows,), pk)
            out[p + "self_attn.v_proj.bias"] = TensorSlot(b + "attn_v.bias", (kv_rows,))
        if layout.o_bias:
            out[p + "self_attn.o_proj.bias"] = TensorSlot(b + "attn_output.bias", (h,))
        out[p + "post_attention_layernorm.weight"] = TensorSlot(b + "ffn_norm.weight", (h,))
        out[p + "mlp.gate_proj.weight"] = TensorSlot(b + "ffn_gate.weight", (ff, h))
        out[p + "mlp.up_proj.weight"] = TensorSlot(b + "ffn_up.weight", (ff, h))
        out[p + "mlp.down_proj.weight"] = TensorSlot(b + "ffn_down.weight", (h, ff))
    return out


def check_state(layout: LlamaLayout, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSlot]:
    """Validate ``state`` against ``layout``; return :func:`expected_tensors`.

    Raises ValueError naming the first missing, unexpected, mis-shaped or non-float (F32/F16/BF16)
    tensor; nothing is written before this passes.
    """
    slots = expected_tensors(layout)
    for name in sorted(slots):
        if name not in state:
            raise ValueError(f"state is missing tensor {name!r}")
    for name in sorted(state):
        if name not in slots:
            raise ValueError(f"state has unexpected tensor {name!r}")
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != slots[name].shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {slots[name].shape}"
            )
        if dtype_name(t.dtype) not in _GGML_BY_DTYPE:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype_name(t.dtype)}; "
                f"GGUF export takes {sorted(_GGML_BY_DTYPE)}"
            )
    return slots


def storage_dtype(published: str, ndim: int, override: str | None) -> str:
    """The dtype a tensor is stored in: F32 for 1-D tensors, else ``override`` or as published."""
    if ndim <= 1:
        return "float32"
    return override or published


# ---------------------------------------------------------------------------------- the vocabulary


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata llama.cpp needs to load a model. Engines feed token ids, never text,
    so this only has to load cleanly and give the right special ids and vocabulary size."""

    model: Literal["gpt2", "llama"]
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    pre: str = "default"


def byte_vocab() -> GGUFVocab:
    """The tiny model's byte vocabulary (``echo.models.tokenizer``) as GPT-2-style byte-level
    strings, so llama.cpp's token ids are ours."""
    from echo.models.tokenizer import (
        BOS_ID,
        EOS_ID,
        NUM_SPECIAL,
        PAD_ID,
        SPECIAL_TOKENS,
        _bytes_to_unicode,
    )

    b2u = _bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    types = [TOKEN_CONTROL] * NUM_SPECIAL + [TOKEN_NORMAL] * 256
    # llama.cpp refuses a gpt2 vocabulary without merges; this one never fires (specials are
    # never produced by the byte-level pre-tokenizer).
    return GGUFVocab(
        "gpt2",
        tokens,
        types,
        [f"{tokens[0]} {tokens[1]}"],
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
    )


def hf_vocab(tokenizer: Any, vocab_size: int, eos_id: int | None = None) -> GGUFVocab:
    """The vocabulary of a transformers tokenizer, padded to ``vocab_size`` embedding rows.

    Byte-level BPE tokenizers (Llama 3, Qwen2) become ``gpt2`` with their merges; SentencePiece
    ones with byte fallback (``<0x0A>`` present, Llama 2) become ``llama``. Raises ValueError when
    the EOS id is outside the embedding. Token ids beyond the embedding (tokenizers that add
    specials of their own) are left out: the model can neither read nor produce them.
    """
    vocab: dict[str, int] = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items() if 0 <= i < vocab_size}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    spm = "<0x0A>" in vocab
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif i in added:
            tokens.append(tok)
            special = getattr(added[i], "special", True)
            types.append(TOKEN_CONTROL if special else TOKEN_USER_DEFINED)
        elif spm and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            tokens.append(tok)
            types.append(TOKEN_BYTE)
        else:
            tokens.append(tok)
            types.append(TOKEN_NORMAL)
    eos = eos_id if eos_id is not None else tokenizer.eos_token_id
    if eos is not None and not 0 <= eos < vocab_size:
        raise ValueError(f"EOS id {eos} is outside the embedding of {vocab_size} rows")
    common = {
        "bos_id": _in_range(tokenizer.bos_token_id, vocab_size),
        "eos_id": eos,
        "pad_id": _in_range(tokenizer.pad_token_id, vocab_size),
    }
    if spm:
        return GGUFVocab("llama", tokens, types, scores=[0.0] * vocab_size, **common)
    merges: list[str] = []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        raw = json.loads(backend.to_str()).get("model", {}).get("merges") or []
        merges = [m if isinstance(m, str) else " ".join(m) for m in raw]
    if not merges:
        merges = [f"{tokens[0]} {tokens[1]}"]  # must not be empty; see byte_vocab
    return GGUFVocab("gpt2", tokens, types, merges, **common)


def _in_range(token_id: int | None, vocab_size: int) -> int | None:
    return token_id if token_id is not None and 0 <= token_id < vocab_size else None


def vocab_for(spec: ModelSpec) -> GGUFVocab:
    """The GGUF vocabulary of a spec: :func:`byte_vocab` for ``tiny``, else the checkpoint's."""
    if spec.kind == "tiny":
        vocab = byte_vocab()
        if spec.vocab > len(vocab.tokens):
            n = len(vocab.tokens)
            pad = [f"[PAD{i}]" for i in range(n, spec.vocab)]
            return GGUFVocab(
                vocab.model,
                vocab.tokens + pad,
                vocab.types + [TOKEN_UNUSED] * len(pad),
                vocab.merges,
                bos_id=vocab.bos_id,
                eos_id=vocab.eos_id,
                pad_id=vocab.pad_id,
            )
        return vocab
    from echo.models.spec import eos_token_id, load_tokenizer

    return hf_vocab(load_tokenizer(spec), layout_of(spec).vocab, eos_token_id(spec))


# ------------------------------------------------------------------------------ tensors <-> bits


def _bits_of(t: torch.Tensor) -> np.ndarray:
    """The raw bits of ``t`` as a flat unsigned-int array (no copy for a contiguous CPU tensor)."""
    name = dtype_name(t.dtype)
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(_TORCH_INT[name]).numpy().view(_UINT[name])


def convert_bits(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``bits`` of dtype ``src`` as bits of dtype ``dst`` (the value cast, round to nearest even).

    Widening to float32 is done on the bits (exact, and faster than a float cast); narrowing goes
    through torch's cast. Returns ``bits`` itself when ``src == dst``.
    """
    if src == dst:
        return bits
    if src == "bfloat16" and dst == "float32":
        return bits.astype(np.uint32) << 16  # a bf16 is the top half of its float32
    if src == "float16" and dst == "float32":
        return bits.view(np.float16).astype(np.float32).view(np.uint32)
    if not bits.flags.writeable:  # torch.from_numpy wants writable memory (a read-only map)
        bits = bits.copy()
    size = np.dtype(_UINT[src]).itemsize
    t = torch.from_numpy(bits.view(np.dtype(f"int{size * 8}"))).view(_TORCH_DTYPE[src])
    return t.to(_TORCH_DTYPE[dst]).view(_TORCH_INT[dst]).numpy().view(_UINT[dst])


def _exact_narrowing(bits: np.ndarray, src: str, dst: str) -> np.ndarray | None:
    """``bits`` (dtype ``src``) as ``dst`` bits if every value survives the cast exactly, else
    None (how read-back detects stored values that are not representable as published)."""
    if src == "float32" and dst == "bfloat16":
        if np.any(bits & np.uint32(0xFFFF)):
            return None
        return (bits >> 16).astype(np.uint16)
    out = convert_bits(bits, src, dst)
    return out if np.array_equal(convert_bits(out, dst, src), bits) else None


def _permute_bits(bits: np.ndarray, slot: TensorSlot, inverse: bool = False) -> np.ndarray:
    """Apply (or with ``inverse`` undo) the Q/K row permutation of ``slot`` to flat row-major
    ``bits``: the official converter's permute(), rotate-half halves -> adjacent pairs."""
    if slot.permute_heads is None:
        return bits
    n = slot.permute_heads
    rows, rest = slot.shape[0], slot.shape[1:]
    split = (n, rows // n // 2, 2) if inverse else (n, 2, rows // n // 2)
    return np.ascontiguousarray(bits.reshape(*split, *rest).swapaxes(1, 2)).reshape(-1)


def file_bits(t: torch.Tensor, slot: TensorSlot, file_dtype: str) -> np.ndarray:
    """The flat bit pattern (unsigned ints) ``t`` has in the file: permuted, cast, row-major.

    May share memory with ``t`` (same dtype, not permuted): treat it as read-only."""
    bits = _permute_bits(_bits_of(t), slot)
    return convert_bits(bits, dtype_name(t.dtype), file_dtype)


def tensor_from_bits(bits: np.ndarray, slot: TensorSlot, dtype: str) -> torch.Tensor:
    """Inverse of :func:`file_bits` without the cast: flat file ``bits`` of ``dtype`` as a new
    tensor of that dtype with the state's shape, unpermuted."""
    flat = _permute_bits(np.asarray(bits), slot, inverse=True)
    size = np.dtype(_UINT[dtype]).itemsize
    signed = np.array(flat, copy=True).view(np.dtype(f"int{size * 8}"))
    return torch.from_numpy(signed).view(_TORCH_DTYPE[dtype]).reshape(slot.shape)


# ---------------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ggml dims (innermost first), ggml type, absolute byte offset."""

    dims: tuple[int, ...]
    ggml_type: int
    offset: int


def read_tensor_infos(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse a GGUF file's header, skip its metadata and return its tensor table with absolute
    data offsets. Raises ValueError on anything that is not a well-formed little-endian GGUF v2/v3
    (every count and length is bounded before it is used)."""
    with open(path, "rb") as f:
        data = f.read(24)
        if len(data) < 24 or data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", data[4:])
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise ValueError(f"{path}: {n_tensors} tensors / {n_kv} keys exceed the limits")
        reader = _Reader(f)
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = reader.string()
            vtype = reader.unpack("<I")
            value = reader.value(vtype)
            if key == "general.alignment":
                if not isinstance(value, int) or value <= 0 or value & (value - 1):
                    raise ValueError(f"{path}: bad general.alignment {value!r}")
                alignment = value
        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for _ in range(n_tensors):
            name = reader.string()
            n_dims = reader.unpack("<I")
            if not 1 <= n_dims <= 4:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(reader.unpack("<Q") for _ in range(n_dims))
            ggml_type, rel = reader.unpack("<I"), reader.unpack("<Q")
            infos[name] = (dims, ggml_type, rel)
        start = -(-f.tell() // alignment) * alignment
    return {n: TensorInfo(d, t, start + rel) for n, (d, t, rel) in infos.items()}


class _Reader:
    """Little-endian GGUF metadata reader over a file object (values it skips are discarded)."""

    _SCALARS = {
        0: "<B",
        1: "<b",
        2: "<H",
        3: "<h",
        4: "<I",
        5: "<i",
        6: "<f",
        7: "<?",
        10: "<Q",
        11: "<q",
        12: "<d",
    }

    def __init__(self, f: Any) -> None:
        self.f = f

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("GGUF file ends inside its header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise ValueError(f"GGUF string of {n} bytes exceeds the limit")
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("GGUF file ends inside a string")
        return data.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in self._SCALARS:
            return self.unpack(self._SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            sub, count = self.unpack("<I"), self.unpack("<Q")
            if count > 1 << 26:
                raise ValueError(f"GGUF array of {count} items exceeds the limit")
            if sub in self._SCALARS:
                size = struct.calcsize(self._SCALARS[sub]) * count
                self.f.seek(size, os.SEEK_CUR)  # arrays are only skipped
                return None
            for _ in range(count):
                self.value(sub)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")


@dataclass(frozen=True)
class Entry:
    """A state tensor's place in the file."""

    slot: TensorSlot
    file_dtype: str
    offset: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(_UINT[self.file_dtype]).itemsize


@dataclass
class UpdateStats:
    """What :meth:`GGUFFile.update` wrote: changed elements, their bytes, tensors touched."""

    changed: int = 0
    bytes_written: int = 0
    tensors: int = 0


class GGUFFile:
    """A GGUF written by :func:`write_gguf`: the path, the model layout, each state tensor's
    :class:`Entry`, and the dtype each tensor was published in (what digests are computed in)."""

    def __init__(
        self,
        path: Path,
        layout: LlamaLayout,
        entries: dict[str, Entry],
        published: dict[str, str],
        override: str | None,
    ) -> None:
        self.path = path
        self.layout = layout
        self.entries = entries
        self.published = published
        self.override = override

    def fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``state`` (already checked against the layout) can be written in place: every
        tensor would be stored in the dtype the file already holds it in."""
        if set(state) != set(self.entries):
            return False
        return all(
            storage_dtype(dtype_name(t.dtype), t.dim(), self.override) == self.entries[n].file_dtype
            for n, t in state.items()
        )

    def update(self, state: Mapping[str, torch.Tensor]) -> UpdateStats:
        """Write into the file only the elements of ``state`` whose bits differ from the file's.

        ``state`` must satisfy :meth:`fits` (ValueError otherwise). Tensors are compared in
        chunks of ``UPDATE_CHUNK`` elements, so the temporary memory stays small however large
        the embedding. Nothing is re-read here to confirm the write: :meth:`read_state` (the
        engine's digest) reads the file back and catches a wrong one.
        """
        if not self.fits(state):
            raise ValueError("state does not fit this GGUF file's layout; rewrite it instead")
        stats = UpdateStats()
        mm = np.memmap(self.path, dtype=np.uint8, mode="r+")
        try:
            for name in sorted(state):
                e = self.entries[name]
                src_dtype = dtype_name(state[name].dtype)
                src = _permute_bits(_bits_of(state[name]), e.slot)
                view = mm[e.offset : e.offset + e.nbytes].view(_UINT[e.file_dtype])
                changed = 0
                for lo in range(0, e.count, UPDATE_CHUNK):
                    hi = min(lo + UPDATE_CHUNK, e.count)
                    new = convert_bits(src[lo:hi], src_dtype, e.file_dtype)
                    dst = view[lo:hi]
                    diff = dst != new
                    n = int(np.count_nonzero(diff))
                    if n:
                        # Masked copy: pages without a changed element are never written.
                        np.copyto(dst, new, where=diff)
                        changed += n
                if changed:
                    stats.changed += changed
                    stats.bytes_written += changed * view.itemsize
                    stats.tensors += 1
            # No msync: llama.cpp maps the same page cache, so the bytes are visible to it now.
        finally:
            del mm
        self.published = {n: dtype_name(t.dtype) for n, t in state.items()}
        return stats

    def read_state(self) -> dict[str, torch.Tensor]:
        """The state as the file holds it: each tensor unpermuted and in its published dtype.

        A tensor whose stored values do not survive the cast to the published dtype exactly is
        returned in the stored dtype, so its digest differs from the learner's rather than
        hiding the difference.
        """
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        out: dict[str, torch.Tensor] = {}
        try:
            for name in sorted(self.entries):
                e = self.entries[name]
                bits = mm[e.offset : e.offset + e.nbytes].view(_UINT[e.file_dtype])
                want = self.published[name]
                if want != e.file_dtype:
                    narrow = _exact_narrowing(np.asarray(bits), e.file_dtype, want)
                    if narrow is not None:
                        out[name] = tensor_from_bits(narrow, e.slot, want)
                        continue
                out[name] = tensor_from_bits(bits, e.slot, e.file_dtype)
        finally:
            del mm
        return out


def write_gguf(
    model: ModelSpec | LlamaLayout | Any,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    vocab: GGUFVocab | None = None,
    dtype: str | None = None,
    name: str = "echo-policy",
) -> GGUFFile:
    """Write ``state`` (an ``echo.models.weights`` state of ``model``) as a llama.cpp GGUF.

    ``model`` is a :class:`ModelSpec`, a transformers config or a :class:`LlamaLayout`;
    ``vocab`` defaults to :func:`vocab_for` (required unless ``model`` is a spec). ``dtype``
    overrides the storage dtype of matrices (default: as published). The file is written beside
    ``path`` and renamed over it, so a reader never sees half a file. Raises ValueError for a
    state that does not match the model (before writing anything), NotImplementedError for
    unsupported architectures.
    """
    import gguf

    if dtype is not None and dtype not in _GGML_BY_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(_GGML_BY_DTYPE)}, not {dtype!r}")
    layout = layout_of(model)
    slots = check_state(layout, state)
    if vocab is None:
        if not isinstance(model, ModelSpec):
            raise ValueError("write_gguf needs vocab= unless given a ModelSpec")
        vocab = vocab_for(model)
    if len(vocab.tokens) != layout.vocab or len(vocab.types) != layout.vocab:
        raise ValueError(
            f"vocabulary has {len(vocab.tokens)} tokens, the embedding {layout.vocab} rows"
        )

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, layout.arch)
    arch = layout.arch
    w.add_name(name)
    w.add_context_length(layout.context_length)
    w.add_embedding_length(layout.hidden)
    w.add_block_count(layout.layers)
    w.add_feed_forward_length(layout.intermediate)
    w.add_head_count(layout.heads)
    w.add_head_count_kv(layout.kv_heads)
    w.add_rope_freq_base(layout.rope_theta)
    w.add_layer_norm_rms_eps(layout.rms_eps)
    w.add_vocab_size(layout.vocab)
    if layout.head_dim * layout.heads != layout.hidden:
        w.add_key_length(layout.head_dim)
        w.add_value_length(layout.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(layout.head_dim)

    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.model == "gpt2":
        w.add_token_merges(vocab.merges)
    for setter, tid in (
        (w.add_bos_token_id, vocab.bos_id),
        (w.add_eos_token_id, vocab.eos_id),
        (w.add_pad_token_id, vocab.pad_id),
    ):
        if tid is not None:
            setter(int(tid))
    # Engines pass token ids that already hold BOS; llama.cpp must never add one.
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    published = {n: dtype_name(t.dtype) for n, t in state.items()}
    file_dtypes: dict[str, str] = {}
    matrix_dtypes = set()
    for hf_name in sorted(state, key=lambda n: _gguf_order(slots[n].gguf_name)):
        slot = slots[hf_name]
        fd = storage_dtype(published[hf_name], len(slot.shape), dtype)
        file_dtypes[hf_name] = fd
        if len(slot.shape) > 1:
            matrix_dtypes.add(fd)
        bits = file_bits(state[hf_name], slot, fd).reshape(slot.shape)
        if fd == "float32":
            w.add_tensor(slot.gguf_name, bits.view(np.float32))
        elif fd == "float16":
            w.add_tensor(slot.gguf_name, bits.view(np.float16))
        else:
            w.add_tensor(slot.gguf_name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_file_type(_FILE_TYPE[matrix_dtypes.pop()] if len(matrix_dtypes) == 1 else 0)

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)

    infos = read_tensor_infos(path)
    entries: dict[str, Entry] = {}
    for hf_name, slot in slots.items():
        info = infos.get(slot.gguf_name)
        fd = file_dtypes[hf_name]
        if (
            info is None
            or info.dims != tuple(reversed(slot.shape))
            or info.ggml_type != _GGML_BY_DTYPE[fd]
        ):
            raise ValueError(f"{path}: tensor {slot.gguf_name!r} was not written as expected")
        entries[hf_name] = Entry(slot, fd, info.offset, int(np.prod(slot.shape)))
    if len(infos) != len(entries):
        raise ValueError(f"{path} holds {len(infos)} tensors, expected {len(entries)}")
    return GGUFFile(path, layout, entries, published, dtype)


def _gguf_order(gguf_name: str) -> tuple[int, str]:
    """Converter order: embeddings, then blocks by index, then output (reads nicely in dumps)."""
    if gguf_name.startswith("blk."):
        return (1 + int(gguf_name.split(".")[1]), gguf_name)
    return (0 if gguf_name.startswith("token_embd") else 1 << 30, gguf_name)
