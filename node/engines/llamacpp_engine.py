"""The llama.cpp engine (llama-cpp-python): CPU and Apple nodes, weights in a GGUF patched in place.

Weights. :meth:`LlamaCppEngine.load_state` writes the state as a GGUF
(:mod:`echo.node.engines.gguf_export`, published precision, never quantized). When a new version
has the same layout, only the elements whose bits changed are written into the existing file
(``numpy.memmap``), then the model is reloaded: llama.cpp maps the file (mmap, no repacking, no GPU
offload by default), so a reload costs milliseconds and the pages it computes on are the file's.
:meth:`LlamaCppEngine.state_digest` reads the weights back from those bytes, undoing the Q/K
permutation, so a wrong write shows up as a digest mismatch instead of a silently wrong model.

Generation. The engine checks requests against the vocabulary and the context, grows the KV
cells per sequence to the longest request, chooses a unified KV cache or one stream per sequence
from the call's shape (``UNIFIED_MAX_CELLS``), and hands the batch to
:mod:`echo.node.engines.llamacpp_decode`, which drives llama.cpp's C API (``llama_batch`` /
``llama_decode``) through :mod:`echo.node.engines.llamacpp_context`: each prompt prefilled once,
its KV cells copied to the group's other samples, then one batch per step. The engine samples
itself (:mod:`echo.node.engines.llamacpp_sampler`): temperature, top-p and a per-sample random
stream, reporting ``log_softmax(logits / temperature)`` of the sampled token over the full
vocabulary before top-p truncation (the convention of :mod:`echo.node.engines.base`). Token ids
go in and out directly; llama.cpp's tokenizer is never used.

LoRA adapters are :mod:`echo.node.engines.llamacpp_lora`'s: the engine holds one and delegates.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echo.models.spec import ModelSpec, eos_token_id
from echo.models.weights import state_digest as digest_of
from echo.node.engines.base import Completion, Engine, GenRequest
from echo.node.engines.gguf_export import write_gguf
from echo.node.engines.gguf_file import GGUFFile
from echo.node.engines.gguf_layout import GGUFLayout, check_state, expected_tensors, layout_of
from echo.node.engines.gguf_vocab import GGUFVocab, vocab_for
from echo.node.engines.llamacpp_context import (
    KV_PAD,
    KV_TYPES,
    LlamaContext,
    maps_shared,
    pad_cells,
    route_llama_log,
)
from echo.node.engines.llamacpp_decode import decode_groups, unified_cells
from echo.node.engines.llamacpp_lora import LlamaLora
from echo.node.engines.scratch_dirs import make_scratch_dir
from echo.node.engines.step_threads import StepThreads


@dataclass
class LoadStats:
    """What the last :meth:`LlamaCppEngine.load_state` did and how long it took."""

    full_write: bool = False
    live: bool = False
    changed: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.write_seconds + self.load_seconds


class LlamaCppEngine(Engine):
    """llama.cpp on the CPU (or Apple GPU with ``gpu_layers``), weights from :meth:`load_state`.

    One concept: the policy llama.cpp computes with -- its GGUF written or patched in place,
    loaded (or followed live), read back for the digest -- and the requests it may take.
    Decoding a batch (:mod:`~echo.node.engines.llamacpp_decode`), llama.cpp's handles
    (:mod:`~echo.node.engines.llamacpp_context`) and LoRA adapters
    (:mod:`~echo.node.engines.llamacpp_lora`) are their own modules'.

    - ``threads``: llama.cpp threads (default: one below ``SMALL_MODEL_PARAMS`` parameters, else
      all cores).
    - ``workdir``: where the GGUF lives (default: a private temporary directory, removed by
      :meth:`close`).
    - ``dtype``: storage dtype of matrices (default: as published, which keeps the digest exact;
      a lossy cast makes the digest differ, truthfully). BF16 matrices make llama.cpp round
      activations to BF16, so ``dtype="float32"`` buys log-prob parity with the learner for twice
      the memory.
    - ``seq_len``: KV cells per sequence to start with (rounded up to a multiple of 256, as
      llama.cpp does); a request that needs more grows it (a new context), up to the model's
      context length (or ``seq_len`` if larger).
    - ``max_seqs``: samples decoded together.
    - ``adapt_threads``: with ``threads`` > 1, each decode step runs on 1 thread or on
      ``threads``, whichever the last steps' times say is faster now
      (:mod:`~echo.node.engines.step_threads`: on a machine whose cores are busy, 1 thread
      decoded a small model several times faster than 2); False: always ``threads``.
    - ``kv_dtype`` (float32 or float16) and ``flash_attn``: the defaults (F32 cache, no flash
      attention) keep log-probs within ~1e-5 of transformers; float16 + flash attention is
      faster and within ~1e-2.
    - ``kv_unified``: one KV buffer shared by all sequences (True) or one stream each (False);
      None (the default) chooses per call: unified when the cells it would hold
      (:func:`~echo.node.engines.llamacpp_decode.unified_cells`) are at most
      ``UNIFIED_MAX_CELLS``, remaking the context when the choice changes.
    - ``live_patch``: apply same-layout versions without reloading, where the shared mapping can
      be verified (see :meth:`load_state`).
    - ``gpu_layers`` > 0 offloads layers, after which :meth:`state_digest` covers the file, not
      the GPU copy.
    - ``verbose``: llama.cpp's full log on stderr (default: its errors only).

    Generation starts only after the first :meth:`load_state`. Not thread-safe.
    """

    name = "llamacpp"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        threads: int | None = None,
        workdir: str | os.PathLike[str] | None = None,
        dtype: str | None = None,
        seq_len: int | None = None,
        max_seqs: int = 32,
        adapt_threads: bool = True,
        kv_dtype: str = "float32",
        flash_attn: bool = False,
        kv_unified: bool | None = None,
        gpu_layers: int = 0,
        vocab: GGUFVocab | None = None,
        live_patch: bool = False,
        verbose: bool = False,
    ) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise RuntimeError(
                "the llamacpp engine needs llama-cpp-python: pip install 'echo-swarm[llamacpp]'"
            ) from exc
        if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
        if kv_dtype not in KV_TYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_TYPES)}, not {kv_dtype!r}")
        max_parallel = int(llama_cpp.llama_max_parallel_sequences())
        if not 1 <= max_seqs <= max_parallel:
            raise ValueError(f"max_seqs must be in [1, {max_parallel}], not {max_seqs}")
        self._ll = llama_cpp
        route_llama_log(llama_cpp, verbose)
        self.spec = spec
        self.layout = layout_of(spec)
        self.vocab = vocab if vocab is not None else vocab_for(spec)
        self.vocab_size = self.layout.vocab
        self.eos_id = eos_token_id(spec)
        self.dtype = dtype
        self.threads = threads or _default_threads(self.layout)
        self.max_seq_len = max(self.layout.context_length, seq_len or 0)
        self.seq_len = pad_cells(seq_len or min(self.max_seq_len, KV_PAD))
        self.max_seqs = max_seqs
        self.step_threads = StepThreads(self.threads, adapt=adapt_threads)
        self.kv_dtype = kv_dtype
        self.flash_attn = flash_attn
        self.kv_unified = kv_unified
        self.gpu_layers = gpu_layers
        self.live_patch = live_patch
        self._live = False
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else make_scratch_dir()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.gguf_path = self.workdir / "policy.gguf"
        self._file: GGUFFile | None = None
        self._lora: LlamaLora | None = None  # the LoRA adapters served on the base GGUF
        self._llama = LlamaContext(
            llama_cpp,
            vocab_size=self.vocab_size,
            threads=self.threads,
            max_seqs=max_seqs,
            kv_dtype=kv_dtype,
            flash_attn=flash_attn,
            kv_unified=bool(kv_unified),
            gpu_layers=gpu_layers,
        )
        self.last_stats: dict[str, float] = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
        self.last_load = LoadStats()

    # -- weights ------------------------------------------------------------------------------

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Make ``state`` the engine's weights: patch the GGUF in place when the layout is
        unchanged (only changed elements are written), otherwise write it anew; then reload.
        With ``live_patch`` and a verified shared mapping (see :meth:`_mapped_live`) an in-place
        patch skips the reload: the loaded model computes on the patched pages directly.

        Raises ValueError for a state that does not match the model (nothing changes then),
        RuntimeError when llama.cpp cannot load the result (the engine then holds no model
        until the next successful call), OSError when the file cannot be written.
        """
        check_state(self.layout, state)
        if self._lora is not None:  # a full-weight version: no adapter computes on it
            self._lora.drop()
        stats = LoadStats()
        t0 = time.perf_counter()
        held = self._file
        if held is not None and self._live and self._llama.model is not None and held.fits(state):
            try:
                up = held.update(state)
            except BaseException:
                self._unload()  # the mapped weights may be half updated: never generate on them
                self._file = None
                raise
            stats.changed, stats.bytes_written, stats.live = up.changed, up.bytes_written, True
            stats.write_seconds = time.perf_counter() - t0
            self.last_load = stats
            return
        self._unload()  # never change the file under a model that is not known to follow it
        try:
            if self._file is not None and self._file.fits(state):
                up = self._file.update(state)
                stats.changed, stats.bytes_written = up.changed, up.bytes_written
            else:
                self._file = None
                self._file = write_gguf(
                    self.layout, state, self.gguf_path, vocab=self.vocab, dtype=self.dtype
                )
                stats.full_write = True
                stats.bytes_written = self.gguf_path.stat().st_size
        except BaseException:
            # A failed in-place write may leave the file half updated: rewrite it next time.
            self._file = None
            raise
        t1 = time.perf_counter()
        expected = sum(e.count for e in self._file.entries.values())
        expected += sum(int(values.size) for _, values in self.layout.constants)
        self._llama.load(self.gguf_path, expected, self.seq_len)
        self._live = self._mapped_live()
        stats.write_seconds, stats.load_seconds = t1 - t0, time.perf_counter() - t1
        self.last_load = stats

    def _mapped_live(self) -> bool:
        """Whether writes into the GGUF are the weights the loaded model computes on: llama.cpp
        maps it MAP_SHARED (:func:`maps_shared`), on the CPU with no repacked copies. The KV
        cache of old weights is dropped by every generate call anyway."""
        if not self.live_patch or self.gpu_layers or self._llama.model is None:
            return False
        return maps_shared(self.gguf_path)

    def state_digest(self) -> str:
        """Digest of the weights read back from the GGUF llama.cpp has mapped (unpermuted, in the
        published dtypes), with the LoRA adapter's read back from its GGUF where one is set;
        RuntimeError before the first :meth:`load_state`."""
        if self._lora is not None and self._lora.active:
            return self._lora.served_digest()
        return digest_of(self.held_state())

    def holds_base(self, base_digest: str) -> bool:
        return self._lora is not None and self._lora.holds_base(base_digest)

    def load_adapter(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> None:
        """Serve a LoRA adapter as a GGUF adapter beside the untouched base GGUF
        (:mod:`echo.node.engines.llamacpp_lora`): the base loads once, adapters switch on the
        running context."""
        if self._lora is None:
            self._lora = LlamaLora(self)
        self.lora_served = self._lora.load(base, adapter, ref)

    def held_state(self) -> dict[str, torch.Tensor]:
        """The state as read back from the GGUF (what :meth:`state_digest` hashes);
        RuntimeError before the first :meth:`load_state`."""
        if self._file is None or self._llama.model is None:
            raise RuntimeError("the llamacpp engine holds no weights yet: call load_state first")
        return self._file.read_state()

    def _unload(self) -> None:
        self._llama.unload()
        self._live = False

    def close(self) -> None:
        """Free llama.cpp's model and context and remove a temporary workdir. Idempotent."""
        self._unload()
        self._file = None
        if self._own_workdir and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __del__(self) -> None:
        # Interpreter shutdown may have torn down llama_cpp already.
        with contextlib.suppress(Exception):
            self.close()

    # -- generation ---------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Sample every request's ``n`` completions (see the module docstring).

        Raises ValueError for prompt ids outside the vocabulary or a prompt + ``max_new_tokens``
        longer than the model's context (``max_seq_len``), RuntimeError before the first
        :meth:`load_state` or when llama.cpp fails to decode.
        """
        if not requests:
            return []
        if self._llama.ctx is None:
            raise RuntimeError("the llamacpp engine holds no weights yet: call load_state first")
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"prompt token id outside [0, {self.vocab_size})")
            if len(r.prompt_ids) + r.params.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(r.prompt_ids)}) + max_new_tokens ({r.params.max_new_tokens}) "
                    f"exceeds the model's context of {self.max_seq_len} tokens"
                )
        need = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        unified = self.unified_for(requests)
        if need > self.seq_len or unified != self._llama.kv_unified:
            self.seq_len = max(self.seq_len, pad_cells(need))
            self._llama.make_context(self.seq_len, unified)
        start = time.perf_counter()
        result = decode_groups(
            self._ll, self._llama, requests, self.max_seqs, self.eos_id, self.step_threads
        )
        seconds = time.perf_counter() - start
        n_tokens = sum(len(c.token_ids) for group in result for c in group)
        self.last_stats = {
            "tokens": n_tokens,
            "seconds": seconds,
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
        }
        return result

    def unified_for(self, requests: list[GenRequest]) -> bool:
        """Whether ``requests`` decode on a unified KV cache (see ``kv_unified``)."""
        if self.kv_unified is not None:
            return self.kv_unified
        return unified_cells(requests, self.max_seqs) <= UNIFIED_MAX_CELLS


# Largest unified_cells for which generate uses a unified KV cache. Every token of a unified cache
# attends over all its cells (other sequences' masked), so its cost grows with this count; per-
# sequence streams instead pay when samples end at different steps. SmolLM2, 1 thread, tokens per
# CPU second unified / streams (docs/results/2026-12-07-engines-best.md): samples ending at EOS
# 1.18-1.45 at 416-2752 cells; every sample run to max_new_tokens 1.04-1.11 up to 416 cells,
# ~1.0 at 928, 0.89-0.93 at 1216-1824, 0.80-0.84 at 2752-3424. Sampling ends at EOS, so the
# cut sits above the largest shape measured to gain; a real run's 32 x (112 + 256) holds ~8,600.
UNIFIED_MAX_CELLS = 3072


# Below this many parameters llama.cpp runs on one thread by default (see _default_threads).
SMALL_MODEL_PARAMS = 100_000_000


def _default_threads(layout: GGUFLayout) -> int:
    """One thread for small models, else every core. A decode step of a small model is a few
    hundred tiny ops, each ended by a spinning barrier across ggml's threads: threading gains
    little there, and on a busy machine (other processes on the cores) one descheduled thread
    stalls the rest. Measured on the tiny model on a loaded 2-core machine: ~11k tokens/s on one
    thread, ~0.9k on two."""
    params = sum(math.prod(slot.shape) for slot in expected_tensors(layout).values())
    return 1 if params < SMALL_MODEL_PARAMS else os.cpu_count() or 1
