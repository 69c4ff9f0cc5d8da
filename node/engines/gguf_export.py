"""Writing a policy state as a GGUF file for llama.cpp.

The GGUF is written with gguf-py's ``GGUFWriter`` from the in-memory state (llama.cpp's
``convert_hf_to_gguf.py`` is not shipped in any installed package, reads checkpoints from disk and
refuses the tiny model's in-memory byte tokenizer); tensor names come from gguf-py's
``TensorNameMap``, and shapes, transforms, storage precisions and per-architecture
hyper-parameters from :mod:`echo.node.engines.gguf_layout` and its table
:mod:`echo.node.engines.gguf_arch`; the tokenizer metadata from
:mod:`echo.node.engines.gguf_vocab`. :func:`write_gguf` returns the
:class:`~echo.node.engines.gguf_file.GGUFFile` that later versions are patched into in place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo.models.spec import ModelSpec
from echo.models.weights import dtype_name
from echo.node.engines.gguf_file import Entry, GGUFFile, file_bits, read_tensor_infos
from echo.node.engines.gguf_layout import (
    GGML_BY_DTYPE,
    GGUFLayout,
    check_state,
    layout_of,
    storage_dtype,
)
from echo.node.engines.gguf_vocab import GGUFVocab, vocab_for

# general.file_type (llama_ftype): ALL_F32, MOSTLY_F16, MOSTLY_BF16.
_FILE_TYPE = {"float32": 0, "float16": 1, "bfloat16": 32}


def write_gguf(
    model: ModelSpec | GGUFLayout | Any,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    vocab: GGUFVocab | None = None,
    dtype: str | None = None,
    name: str = "echo-policy",
) -> GGUFFile:
    """Write ``state`` (an ``echo.models.weights`` state of ``model``) as a llama.cpp GGUF.

    ``model`` is a :class:`ModelSpec`, a transformers config or a :class:`GGUFLayout`;
    ``vocab`` defaults to :func:`vocab_for` (required unless ``model`` is a spec). ``dtype``
    overrides the storage dtype of matrices (default: as published). The file is written beside
    ``path`` and renamed over it, so a reader never sees half a file. Raises ValueError for a
    state that does not match the model (before writing anything),
    :class:`~echo.node.engines.gguf_arch.UnsupportedArchitecture` (a NotImplementedError) for
    models llama.cpp cannot run exactly.
    """
    import gguf

    if dtype is not None and dtype not in GGML_BY_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(GGML_BY_DTYPE)}, not {dtype!r}")
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
    w.add_key_length(layout.head_dim)
    w.add_value_length(layout.head_dim)
    w.add_rope_dimension_count(layout.rope_dims)
    for method, value in layout.extra:
        getattr(w, method)(value)

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
    for const_name, values in layout.constants:
        w.add_tensor(const_name, values)
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
            or info.ggml_type != GGML_BY_DTYPE[fd]
        ):
            raise ValueError(f"{path}: tensor {slot.gguf_name!r} was not written as expected")
        entries[hf_name] = Entry(slot, fd, info.offset, int(np.prod(slot.shape)))
    if len(infos) != len(entries) + len(layout.constants):
        want = len(entries) + len(layout.constants)
        raise ValueError(f"{path} holds {len(infos)} tensors, expected {want}")
    return GGUFFile(path, layout, entries, published, dtype, state)


def _gguf_order(gguf_name: str) -> tuple[int, str]:
    """Converter order: embeddings, then blocks by index, then output (reads nicely in dumps)."""
    if gguf_name.startswith("blk."):
        return (1 + int(gguf_name.split(".")[1]), gguf_name)
    return (0 if gguf_name.startswith("token_embd") else 1 << 30, gguf_name)
