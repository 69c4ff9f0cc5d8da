"""The tokenizer metadata of a GGUF: what llama.cpp needs to load a model whose ids we feed.

Engines feed token ids, never text, so a :class:`GGUFVocab` only has to load cleanly and give the
right special ids and vocabulary size: :func:`byte_vocab` for the tiny model's byte tokenizer
(llama.cpp's bundled converter refuses it), :func:`hf_vocab` for a transformers tokenizer,
:func:`vocab_for` choosing between them for a spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from echo.models.spec import ModelSpec
from echo.node.engines.gguf_layout import layout_of

# gguf token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 3, 4, 5, 6


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
        bytes_to_unicode,
    )

    b2u = bytes_to_unicode()
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

