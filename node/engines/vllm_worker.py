"""What the vLLM engine runs inside vLLM's workers: its sampler wrapper and the weight read-back.

:class:`EchoWorkerExtension` is vLLM's ``worker_extension_cls`` for the engine: its methods run in
every worker, called by name through ``LLM.collective_rpc``. It wraps the worker's top-k/top-p
sampler so that it reports log-probs before top-p (see :mod:`echo.node.engines.vllm_engine`), and
hashes the weights the model computes with (:meth:`EchoWorkerExtension.echo_tensor_digests`),
following the plan :func:`read_plan` makes of where each published tensor lies in vLLM's fused
modules. On the CPU linear layers keep only a kernel-packed copy, so their matrices are read back
through the layer's own GEMM on identity blocks.
"""

from __future__ import annotations

import torch

from echo.models.weights import DTYPES, dtype_name, tensor_digest

# HF projection -> (vLLM's fused module, its parts in row order): Llama, Mistral, Qwen2 layouts.
_FUSED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}
# Rows of the identity fed through a packed CPU linear layer per call when reading it back.
_PROBE_ROWS = 512


def read_plan(meta: dict[str, tuple[str, tuple[int, ...]]]) -> list[tuple]:
    """For each published tensor: (name, vLLM module, parameter, first row, shape, dtype), the
    rows of that module's parameter it occupies (fused q/k/v and gate/up projections stack their
    parts' rows in order; padded vocabularies add rows at the end)."""
    plan = []
    for name, (dtype, shape) in sorted(meta.items()):
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        offset = 0
        if leaf in _FUSED:
            fused, parts = _FUSED[leaf]
            for part in parts[: parts.index(leaf)]:
                sibling = f"{parent}.{part}.{param}"
                if sibling not in meta:
                    raise ValueError(f"cannot place {name!r}: the state has no {sibling!r}")
                offset += meta[sibling][1][0]
            module = f"{parent}.{fused}"
        plan.append((name, module, param, offset, list(shape), dtype))
    return plan


def _probe(module: torch.nn.Module, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) matrix a linear layer computes with, read through its own GEMM: identity
    blocks in, transposed rows out (exact: every output is 1 x w plus zeros; a stored -0.0
    comes back as +0.0)."""
    outs = []
    for lo in range(0, cols, _PROBE_ROWS):
        hi = min(cols, lo + _PROBE_ROWS)
        eye = torch.zeros((hi - lo, cols), dtype=dtype)
        eye[:, lo:hi] = torch.eye(hi - lo, dtype=dtype)
        outs.append(module.quant_method.apply(module, eye, None))
    return torch.cat(outs).t().contiguous()


def _held(module: torch.nn.Module, param: str, cols: int | None) -> torch.Tensor:
    """What ``module`` computes with for ``param``: the parameter itself, or for a weight the CPU
    backend packed for its GEMM (``cpu_linear``), the matrix read back through that GEMM."""
    p = getattr(module, param)
    held = p.detach() if p.numel() else None
    if param == "weight" and cols is not None and hasattr(module, "cpu_linear"):
        probed = _probe(module, cols, p.dtype)
        # The parameter (when kept) carries exact bits, -0.0 included; a mismatch with what the
        # GEMM computes with shows the GEMM's copy instead.
        if held is None or held.shape != probed.shape or not torch.equal(held, probed):
            held = probed
    if held is None:
        raise RuntimeError(f"{type(module).__name__}.{param} holds no data to read back")
    return held


class EchoWorkerExtension:
    """Methods added to vLLM's workers (``worker_extension_cls``), called by name through
    ``LLM.collective_rpc``."""

    def echo_logprobs_before_top_p(self) -> bool:
        """Wrap the worker's top-k/top-p sampler so it reports ``log_softmax`` of the logits it
        receives (already divided by the temperature) before truncating them; False where the
        worker has no such sampler (e.g. vLLM's V2 model runner). Greedy-only batches never reach
        it: vLLM's ``processed_logprobs`` there is the raw ``log_softmax``, as the convention
        wants."""
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        inner_sampler = getattr(sampler, "topk_topp_sampler", None)
        if inner_sampler is None or not callable(getattr(inner_sampler, "forward", None)):
            return False
        if getattr(inner_sampler, "_echo_wrapped", False):
            return True
        inner = inner_sampler.forward

        def forward(logits, generators, k, p):  # type: ignore[no-untyped-def]
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
            sampled, _ = inner(logits, generators, k, p)
            return sampled, logprobs

        inner_sampler.forward = forward
        # The wrapped sampler need not compute its post-top-p log-probs any more.
        inner_sampler.logprobs_mode = "raw_logprobs"
        inner_sampler._echo_wrapped = True
        return True

    def echo_threads(self) -> int:
        """The worker's torch thread count (vLLM sets it from its CPU binding)."""
        return torch.get_num_threads()

    def echo_tensor_digests(self, plan: list[tuple]) -> dict[str, tuple[str, list[int], str]]:
        """name -> (dtype, shape, sha256 of the raw bytes) of each planned tensor as the model
        holds it, cast to the published dtype (see :func:`read_plan`)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out: dict[str, tuple[str, list[int], str]] = {}
        cached: tuple[tuple[str, str], torch.Tensor] | None = None
        with torch.inference_mode():
            for name, module_name, param, offset, shape, dtype in plan:
                key = (module_name, param)
                if cached is None or cached[0] != key:
                    module = model.get_submodule(module_name)
                    cols = shape[1] if len(shape) == 2 else None
                    cached = (key, _held(module, param, cols))
                full = cached[1]
                t = full[offset : offset + shape[0]] if full.dim() else full
                t = t.to("cpu", DTYPES[dtype]).contiguous()
                out[name] = (dtype_name(t.dtype), list(t.shape), tensor_digest(t))
        return out
