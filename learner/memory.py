"""What one learner rank holds in memory, estimated before the job runs (``echo-job plan``).

:func:`estimate` sizes, per rank, what the learner keeps for the whole job -- weights, gradients
and AdamW's two moments of the policy (sharded by ``nproc_per_node`` with ``backend = "fsdp2"``),
the KL reference and the re-scorer's model -- and what one step adds on top: the layers FSDP2
gathers whole while they compute, and the activations autograd keeps for the backward pass
(with the logits over the full vocabulary, which dominate for small models with large
vocabularies). It follows the learner as built (:mod:`~echo.learner.fsdp.trainer`,
:mod:`~echo.learner.lora`): master weights, gradients and moments in float32, compute in bf16
where :func:`~echo.learner.fsdp.distributed.mixed_precision` picks it (CUDA), else float32.

The formula, per rank, for ``P`` parameters, ``T`` of them trained, ``N`` ranks::

    weights 4P/N + gradients 4T/N + AdamW 8T/N  (+ 4P/N KL reference, + 4P/N re-scorer)
    + gathered: 2 decoder layers and the root (embeddings, norm, head) in the compute dtype
    + activations: tokens of the rank's groups x (layers x (10 h + 4 i + 2 kv) x compute bytes
                   + vocab x (compute bytes + 8))
      (with activation checkpointing: layers x h + one layer's (10 h + 4 i + 2 kv), the
      layers' inputs kept and one layer recomputed at a time)

A LoRA job trains only the adapter (``T`` is its parameters; ``P`` counts base and adapter,
both sharded). On the CPU, rank 0 also keeps the published versions the re-scorer remembers
(:attr:`RankMemory.leader_total_bytes`). The model is built whole in host memory on every rank
before it is sharded (:attr:`RankMemory.build_host_bytes`), a limit documented in
docs/learner-fsdp.md. The estimate itself is arithmetic; torch and psutil are imported only to
ask the device how much memory it has (:func:`available_per_rank`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# A prompt's tokens when nothing has been measured yet (the tasks' prompts are short).
DEFAULT_PROMPT_TOKENS = 64
# Saved activations of one Llama decoder layer, per token, in units of the hidden size h,
# the MLP width i and the key/value width kv: the two norms' inputs and outputs, q, the
# attention output and o_proj's output (~10 h); gate, up, silu(gate) and their product (4 i);
# k and v (2 kv). Attention itself (SDPA) keeps only its log-sum-exp.
_LAYER_H, _LAYER_I, _LAYER_KV = 10, 4, 2
# Per completion token and vocabulary entry: the logits in the compute dtype, then the float32
# copy and log-softmax the loss reads (grpo.GRPOLearner._logprobs), whose gradient reuses them.
_LOGIT_F32_BYTES = 8
# Published dtypes' bytes (the re-scorer's remembered versions).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The projections LoRA may wrap: (in, out) as multiples of (h, i, kv) -- see _proj_dims.
_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """A Llama-like causal LM's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def layer_params(self) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; MLP; two norms

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


def shape_of(model: Mapping[str, Any]) -> Shape:
    """The shape of the model a job spec's ``model_spec_dict()`` names: a tiny Llama from its
    fields (the model spec's defaults for the others), a Hugging Face folder from its
    ``config.json``.

    :raises ValueError: the folder has no readable Llama-like config.
    """
    if model.get("kind") == "hf":
        path = Path(str(model.get("path", ""))) / "config.json"
        try:
            c = json.loads(path.read_text())
            heads = int(c["num_attention_heads"])
            return Shape(
                hidden=int(c["hidden_size"]),
                layers=int(c["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                intermediate=int(c["intermediate_size"]),
                vocab=int(c["vocab_size"]),
                tied=bool(c.get("tie_word_embeddings", False)),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot size the model: {path}: {exc}") from None
    from echo.models.spec import ModelSpec  # pydantic only; the defaults live there

    s = ModelSpec.from_dict(dict(model))
    return Shape(
        s.hidden, s.layers, s.heads, s.num_kv_heads, s.intermediate_size, s.vocab, s.tie_embeddings
    )


def _proj_dims(shape: Shape, name: str) -> tuple[int, int]:
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[name]


def lora_params(shape: Shape, rank: int, targets: list[str] | tuple[str, ...]) -> int:
    """Parameters of a LoRA adapter of ``rank`` on ``targets`` in every layer (A: r x in,
    B: out x r). :raises ValueError: an unknown target."""
    bad = [t for t in targets if t not in _PROJS]
    if bad:
        raise ValueError(f"unknown LoRA targets {bad}")
    return shape.layers * sum(rank * sum(_proj_dims(shape, t)) for t in targets)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one learner rank needs (see the module docstring for the formula)."""

    backend: str
    ranks: int
    params: int
    trained_params: int
    compute_dtype: str  # the forward's dtype (mixed precision on CUDA)
    weights_bytes: int  # the policy's float32 master weights (this rank's shard)
    grads_bytes: int
    optim_bytes: int  # AdamW's exp_avg and exp_avg_sq
    reference_bytes: int  # the KL term's frozen copy (0 without one)
    rescorer_bytes: int  # the re-scorer's model
    gathered_bytes: int  # layers FSDP2 holds whole while they compute
    activations_bytes: int  # one step's saved activations and logits
    tokens_per_rank: int
    build_host_bytes: int  # host memory while the model is built whole, before sharding
    remembered_host_bytes: int  # rank 0: published versions the re-scorer keeps, on the host
    staleness_keep: int  # how many versions it keeps (staleness + 1)
    on_host: bool  # the device is the host's memory (cpu): rank 0's remembered versions count

    @property
    def leader_total_bytes(self) -> int:
        """Rank 0's peak: :attr:`total_bytes`, and on the CPU the versions it remembers for
        re-scoring and the one it gathers to publish."""
        extra = self.remembered_host_bytes * (self.staleness_keep + 1) // self.staleness_keep
        return self.total_bytes + (extra if self.on_host else 0)

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and optimizer state: what sharding divides by the ranks."""
        return self.weights_bytes + self.grads_bytes + self.optim_bytes

    @property
    def total_bytes(self) -> int:
        """The rank's peak on its device."""
        return (
            self.state_bytes
            + self.reference_bytes
            + self.rescorer_bytes
            + self.gathered_bytes
            + self.activations_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "state_bytes": self.state_bytes,
            "total_bytes": self.total_bytes,
            "leader_total_bytes": self.leader_total_bytes,
        }


def estimate(
    model: Mapping[str, Any],
    job: Mapping[str, Any],
    backend: str = "single",
    nproc_per_node: int = 1,
    device: str = "cpu",
    prompt_tokens: float = DEFAULT_PROMPT_TOKENS,
    shape: Shape | None = None,
    checkpoint_layers: bool = False,
) -> RankMemory:
    """Per-rank memory of the learner of a job (``job``: its spec as a dict, ``model``: its
    ``model_spec_dict()``) on ``device`` (``cuda*`` computes in bf16 with fsdp2, as the learner
    does where the GPU supports it), with ``nproc_per_node`` ranks of ``backend``. ``shape``
    overrides the model's (a calculation for a model not on this machine);
    ``checkpoint_layers``: ``[learner] activation_checkpointing`` (fsdp2 only).

    :raises ValueError: a model that cannot be sized, or ranks or activation checkpointing
        without fsdp2.
    """
    if backend not in ("single", "fsdp2"):
        raise ValueError(f"unknown learner backend {backend!r}")
    n = nproc_per_node if backend == "fsdp2" else 1
    if n < 1 or (backend == "single" and nproc_per_node != 1):
        raise ValueError('nproc_per_node > 1 needs backend = "fsdp2"')
    if checkpoint_layers and backend != "fsdp2":
        raise ValueError('activation_checkpointing needs backend = "fsdp2"')
    s = shape or shape_of(model)
    p = s.params()
    lora = job.get("lora")
    trained = lora_params(s, int(lora["rank"]), list(lora["target_modules"])) if lora else p
    total_p = p + (trained if lora else 0)  # the adapter's parameters sit beside the base's
    mixed = backend == "fsdp2" and device.startswith("cuda")
    cb = 2 if mixed else 4

    def shard(count: int) -> int:
        return math.ceil(count / n) * 4

    kl = float(job.get("grpo", {}).get("kl_coef", 0.0) or 0.0) > 0
    gathered = 0
    if backend == "fsdp2":
        # The root stays gathered for its whole forward; a layer and the next one prefetched.
        # (The gathered copies are new buffers beside the rank's own float32 shard.)
        gathered = (s.root_params() + min(2, s.layers) * s.layer_params()) * cb
    groups = math.ceil(int(job.get("batch_groups", 8)) / n)
    max_new = int(job.get("sampling", {}).get("max_new_tokens", 8))
    seq = int(prompt_tokens) + max_new
    seqs = groups * int(job.get("group_size", 16))
    per_token_layer = _LAYER_H * s.hidden + _LAYER_I * s.intermediate + _LAYER_KV * s.kv_dim
    if checkpoint_layers:  # each layer keeps its input; one layer's activations at a time
        activations = seqs * seq * (s.layers * s.hidden + per_token_layer) * cb
    else:
        activations = seqs * seq * s.layers * per_token_layer * cb
    activations += seqs * max_new * s.vocab * (cb + _LOGIT_F32_BYTES)
    publish = _DTYPE_BYTES.get(str(job.get("publish_dtype", "float32")), 4)
    keep = int(job.get("staleness", 1)) + 1
    remembered = keep * trained * publish
    return RankMemory(
        backend=backend,
        ranks=n,
        params=total_p,
        trained_params=trained,
        compute_dtype="bfloat16" if mixed else "float32",
        weights_bytes=shard(total_p),
        grads_bytes=shard(trained),
        optim_bytes=2 * shard(trained),
        reference_bytes=shard(total_p) if kl else 0,
        rescorer_bytes=shard(total_p),
        gathered_bytes=gathered,
        activations_bytes=activations,
        tokens_per_rank=seqs * seq,
        build_host_bytes=total_p * 4 * (2 if kl else 1),
        remembered_host_bytes=remembered,
        staleness_keep=keep,
        on_host=not device.startswith("cuda"),
    )


def available_per_rank(device: str, nproc_per_node: int) -> int:
    """Bytes each rank may use on ``device`` as the learner resolves it (``auto``: a CUDA GPU
    if torch sees one): one GPU's memory per rank on CUDA, the host's memory shared by the
    ranks elsewhere; 0 when unknown."""
    if device in ("auto", "cuda") or device.startswith("cuda:"):
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            return int(torch.cuda.get_device_properties(index).total_memory)
        if device != "auto":
            return 0
    import psutil

    return int(psutil.virtual_memory().total) // max(nproc_per_node, 1)


def resolved_device(device: str) -> str:
    """``auto`` as the learner resolves it (cuda where torch sees a GPU, else cpu)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def misfit(need: RankMemory, available_per_rank: int) -> str | None:
    """Why ``need`` does not fit ``available_per_rank`` bytes (0: unknown, which fits), or
    None."""
    worst = max(need.total_bytes, need.leader_total_bytes)
    if available_per_rank and worst > available_per_rank:
        return (
            f"each of {need.ranks} learner rank(s) needs up to {worst / 1e9:.2f} GB, "
            f"the device offers {available_per_rank / 1e9:.2f} GB per rank"
        )
    return None


def plan(
    job: Mapping[str, Any],
    backend: str,
    nproc_per_node: int,
    device: str,
    checkpoint_layers: bool = False,
) -> dict[str, Any]:
    """``echo-job plan``'s learner memory: the estimate for ``job`` (its spec as a dict) on the
    coordinator's ``[learner]`` settings (``checkpoint_layers``: its
    ``activation_checkpointing``), the memory each rank has, and whether it fits (with
    the reason when not). A model that cannot be sized gives ``{"error": ...}``."""
    from echo.protocol.jobspec import JobSpec

    spec = JobSpec.model_validate(dict(job))
    dev = resolved_device(device)
    try:
        need = estimate(spec.model_spec_dict(), spec.model_dump(mode="json"), backend,
                        nproc_per_node, dev, checkpoint_layers=checkpoint_layers)  # fmt: skip
    except ValueError as exc:
        return {"error": str(exc), "fits": True}
    have = available_per_rank(device, need.ranks)
    why = misfit(need, have)
    return {
        **need.to_dict(),
        "device": dev,
        "available_per_rank_bytes": have,
        "fits": why is None,
        "misfit": why,
    }
