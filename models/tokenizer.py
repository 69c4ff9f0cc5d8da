"""A byte-level tokenizer built in memory, so the tiny model needs no files and no hub.

Token id = byte value + 3; ids 0-2 are the specials ``<pad> <s> </s>``. Two implementations agree:

- :func:`byte_tokenizer` returns a ``PreTrainedTokenizerFast`` (a ``tokenizers`` BPE over the 256
  byte symbols with no merges, ByteLevel pre-tokenizer without regex), for code that wants the
  transformers interface.
- :func:`encode` / :func:`decode` are plain Python over bytes, for the hot paths (nodes, rewards).

Text never turns into special tokens: the string ``"</s>"`` in a prompt is five bytes, so user text
cannot inject an EOS (``split_special_tokens=True`` on the fast tokenizer does the same).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3
VOCAB_SIZE = 256 + NUM_SPECIAL
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` shifted by 3, optionally after BOS (what the fast tokenizer gives
    with and without ``add_special_tokens``)."""
    ids = [b + NUM_SPECIAL for b in text.encode("utf-8")]
    return [BOS_ID, *ids] if add_bos else ids


def decode(ids: list[int]) -> str:
    """Text of ``ids``, dropping specials (and any id outside the vocabulary); invalid UTF-8 becomes
    U+FFFD, as the fast tokenizer's ByteLevel decoder does."""
    data = bytes(i - NUM_SPECIAL for i in ids if NUM_SPECIAL <= i < VOCAB_SIZE)
    return data.decode("utf-8", errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet ByteLevel works in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The transformers tokenizer of the byte vocabulary (adds BOS by default; pads left)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    b2u = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({b2u[b]: b + NUM_SPECIAL for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: every byte is its own token anyway, and a split would only cost time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        split_special_tokens=True,
        padding_side="left",
    )
