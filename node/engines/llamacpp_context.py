"""llama.cpp's handles for one engine: the model mapped from a GGUF, a context, batched decoding.

:class:`LlamaContext` owns what llama-cpp-python's C API hands out: the model (mapped from the
engine's GGUF, no repacked copies, so the pages it computes on are the file's), a context of
``max_seqs`` sequences with its ``llama_batch`` (one KV stream per sequence, or one unified cache,
chosen per context build), and :meth:`LlamaContext.decode`, which feeds
``(sequence, token, position)`` items through ``llama_decode`` and returns the logits asked for.
It also routes llama.cpp's process-wide log (:func:`route_llama_log`) and tells whether the model
maps its file shared (:func:`maps_shared`), which in-place weight patches rely on.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np

# ggml_type ids for the KV cache.
KV_TYPES = {"float32": 0, "float16": 1}
# llama.cpp pads the KV cells of each sequence to a multiple of this.
KV_PAD = 256
# ggml_log_level of the bundled llama.cpp (NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5).
# llama-cpp-python 0.3.36's own log callback still maps the older numbering, which shows
# warnings as errors and hides errors, so the engine installs its own filter.
_LOG_ERROR, _LOG_CONT = 4, 5
_log = {"verbose": False, "last": 0}
_log_callback: Any = None


def route_llama_log(ll: Any, verbose: bool) -> None:
    """Send llama.cpp's log to stderr: everything when ``verbose``, else errors only. The
    setting is process-wide (llama.cpp has one log callback); the last engine built decides."""
    global _log_callback
    _log["verbose"] = verbose
    if _log_callback is not None:
        return

    @ll.llama_log_callback
    def callback(level: int, text: bytes, _user: Any) -> None:
        if level != _LOG_CONT:
            _log["last"] = level
        if _log["verbose"] or _log["last"] == _LOG_ERROR:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    _log_callback = callback  # llama.cpp keeps only the pointer: the object must stay alive
    ll.llama_log_set(callback, ctypes.c_void_p(0))


def pad_cells(cells: int) -> int:
    """``cells`` rounded up to the granularity llama.cpp gives each sequence."""
    return -(-cells // KV_PAD) * KV_PAD


def maps_shared(path: Path) -> bool:
    """Whether this process maps ``path`` MAP_SHARED (checked in ``/proc/self/maps``, so Linux
    only; False where that cannot be read): writes into the file are then the mapped pages."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    target = str(path.resolve())
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5] == target and parts[1].endswith("s"):
            return True
    return False


class LlamaContext:
    """The model, context and batch of one engine (see the module docstring). Not thread-safe.

    Settings are the engine's (see :class:`~echo.node.engines.llamacpp_engine.LlamaCppEngine`);
    ``ll`` is the imported ``llama_cpp`` module.
    """

    _backend_ready = False  # llama_backend_init runs once per process

    def __init__(
        self,
        ll: Any,
        *,
        vocab_size: int,
        threads: int,
        max_seqs: int,
        kv_dtype: str,
        flash_attn: bool,
        kv_unified: bool,
        gpu_layers: int,
    ) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        self.threads = threads
        self.max_seqs = max_seqs
        self.kv_dtype = kv_dtype
        self.flash_attn = flash_attn
        self.kv_unified = kv_unified
        self.gpu_layers = gpu_layers
        self.model: Any = None
        self.ctx: Any = None
        self._batch: Any = None
        self._batch_size = 0
        self.threads_now = threads
        # The LoRA adapter set on the context (llama.cpp frees it with the model), kept across
        # a context that is made anew.
        self.adapter: Any = None
        if not LlamaContext._backend_ready:
            ll.llama_backend_init()
            LlamaContext._backend_ready = True

    def load(self, path: Path, n_params: int, seq_len: int) -> None:
        """Map the GGUF at ``path`` and make a context of ``seq_len`` cells per sequence.

        Raises RuntimeError when llama.cpp cannot load the file, counts other than ``n_params``
        parameters in it, or cannot make a context; no model is held then.
        """
        ll = self._ll
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = self.gpu_layers
        mparams.load_mode = ll.LLAMA_LOAD_MODE_MMAP
        # No repacked copies: the weights computed on must be the file's pages (see the digest).
        mparams.use_extra_bufts = False
        model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.model = model
        loaded = int(ll.llama_model_n_params(model))
        if loaded != n_params:
            self.unload()
            raise RuntimeError(f"llama.cpp loaded {loaded} parameters, the GGUF holds {n_params}")
        self.make_context(seq_len)

    def make_context(self, seq_len: int, kv_unified: bool | None = None) -> None:
        """(Re)create the context and batch for ``max_seqs`` sequences of ``seq_len`` tokens,
        with a unified KV cache or not (None: as the last build); RuntimeError (and the model
        unloaded) when llama.cpp cannot."""
        ll = self._ll
        self._free_context()
        if kv_unified is not None:
            self.kv_unified = kv_unified
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = seq_len * self.max_seqs
        cparams.n_seq_max = self.max_seqs
        cparams.n_batch = max(512, self.max_seqs)
        cparams.n_ubatch = cparams.n_batch
        # Only the last prompt token of each group and one token per sample per step need
        # logits: bounding the outputs keeps the logits buffer small for large vocabularies.
        cparams.n_outputs_max = self.max_seqs
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.type_k = cparams.type_v = KV_TYPES[self.kv_dtype]
        # Off unless asked: llama.cpp's CPU flash attention rounds Q to F16, which moved
        # log-probs by ~3e-3 on the tiny model, against ~2e-6 with it off and an F32 KV cache.
        cparams.flash_attn_type = (
            ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if self.flash_attn
            else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.kv_unified = self.kv_unified
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(self.model, cparams)
        if not ctx:
            self.unload()
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.ctx = ctx
        if self.adapter is not None:
            self._apply_adapter(self.adapter)
        self.threads_now = self.threads
        self._batch_size = int(cparams.n_batch)
        self._batch = ll.llama_batch_init(self._batch_size, 0, 1)

    def set_adapter(self, path: Path | None) -> None:
        """Compute with the GGUF LoRA adapter at ``path`` from now on (None: the base alone),
        without reloading the model: the adapter's tensors load beside the mapped base and the
        context switches to them. RuntimeError (the previous adapter kept) when llama.cpp
        cannot load or apply it."""
        ll = self._ll
        if self.model is None or self.ctx is None:
            raise RuntimeError("no model is loaded to apply an adapter to")
        new = None
        if path is not None:
            new = ll.llama_adapter_lora_init(self.model, str(path).encode())
            if not new:
                raise RuntimeError(f"llama.cpp could not load the LoRA adapter {path}")
        try:
            self._apply_adapter(new)
        except RuntimeError:
            if new is not None:
                ll.llama_adapter_lora_free(new)
            raise
        old, self.adapter = self.adapter, new
        if old is not None:
            ll.llama_adapter_lora_free(old)

    def _apply_adapter(self, adapter: Any) -> None:
        ll = self._ll
        if adapter is None:
            failed = ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapters = (ll.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(1.0)  # the adapter's own alpha / r scales it
            failed = ll.llama_set_adapters_lora(self.ctx, adapters, 1, scales)
        if failed:
            raise RuntimeError("llama.cpp could not set the LoRA adapter on its context")

    def _free_context(self) -> None:
        ll = self._ll
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx is not None:
            ll.llama_free(self.ctx)
            self.ctx = None

    def unload(self) -> None:
        """Free the context, batch and model (whatever is held). Idempotent."""
        self._free_context()
        if self.model is not None:
            ll = self._ll
            if self.adapter is not None:
                ll.llama_adapter_lora_free(self.adapter)
                self.adapter = None
            ll.llama_model_free(self.model)
            self.model = None

    def set_threads(self, threads: int) -> None:
        """Compute the next decodes on ``threads`` threads (llama.cpp takes the count per
        decode, so this costs nothing)."""
        if threads != self.threads_now:
            self._ll.llama_set_n_threads(self.ctx, threads, threads)
            self.threads_now = threads

    def decode(self, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode ``(seq, token, pos, wants_logits)`` items in batches of at most ``n_batch``;
        return the logits of the items that asked for them, in order, as float32 (k, vocab).
        When one batch holds every item that asked (every decode step does), the array is a
        view of llama.cpp's logits buffer, valid until the next call: a step's logits are read
        once, so copying 49k floats per sample per step would only cost time.
        RuntimeError when llama.cpp fails to decode."""
        ll = self._ll
        b = self._batch
        out: list[np.ndarray] = []
        tok = np.ctypeslib.as_array(b.token, shape=(self._batch_size,))
        pos = np.ctypeslib.as_array(b.pos, shape=(self._batch_size,))
        nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self._batch_size,))
        want = np.ctypeslib.as_array(b.logits, shape=(self._batch_size,))
        parts = range(0, len(items), self._batch_size)
        for lo in parts:
            part = items[lo : lo + self._batch_size]
            n = len(part)
            seq, toks, poss, wants = zip(*part, strict=True)
            tok[:n] = toks
            pos[:n] = poss
            nseq[:n] = 1
            want[:n] = wants
            for i, s in enumerate(seq):
                b.seq_id[i][0] = s
            b.n_tokens = n
            rc = ll.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            k = int(sum(wants))
            if k:
                ptr = ll.llama_get_logits(self.ctx)
                arr = np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(k, self.vocab_size)
                )
                # A later part's decode overwrites the buffer: keep a copy unless this is the last.
                out.append(arr if lo == parts[-1] else arr.copy())
        if not out:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)
