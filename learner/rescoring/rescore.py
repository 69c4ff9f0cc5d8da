"""Re-scoring submitted rollouts under the version they claim (verification step 5).

A prefill of the submitted tokens under the claimed weights gives, per token, the log-prob the
policy assigns and the entropy of its distribution. Three group-level checks follow, each an
aggregate over many tokens because engines differ on single tokens even with equal weights:

- **mismatch**: mean |log-prob reported by the node - log-prob recomputed here|. Fabricated
  log-probs fail it. The threshold is per engine (:data:`MISMATCH_THRESHOLDS`), measured from
  honest runs.
- **sampling shape** (two tests; failing either fails the group): K = the number of chosen
  tokens the policy gives probability below :data:`IMPROBABLE_P`. For the policy's own
  samples, token t lands there with probability q_t = the policy's total mass on such tokens,
  exactly computable, so K has mean sum(q_t) and variance sum(q_t (1 - q_t)); random tokens
  or another model's land there almost always. A count of bounded 0/1 events has light tails
  at any entropy, but little power on a flat policy. The second test is a z-score of
  log p(x_t) + H_t (mean 0 for the policy's own samples) with each term clipped at
  -:data:`SHAPE_CLIP` so one rare honest token under a peaked policy cannot dominate it. A
  fixed median-probability cut (grail's) fails on flat policies.
- **termination**: a completion that claims to stop must end on an EOS the policy would emit
  with non-negligible probability.

Rollouts are only ever trained on after passing; the verdicts go back to the coordinator.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from echo.learner.algorithm.grpo import TrainGroup, pad_id_of
from echo.learner.rescoring.prefill import completion_logits
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import load_state
from echo.protocol import reasons as R

# Mean |reported - recomputed| log-prob allowed per engine (nats/token). Honest torch float32
# on a CPU measures ~2e-7 against our prefill (here, 40 groups); llama.cpp f32 ~2e-4; GPUs differ
# more (TF32 / bf16 kernels). The margins are 50-500x; a swapped prompt or fabricated log-probs
# miss by far more once the policy depends on its prompt at all.
MISMATCH_THRESHOLDS = {
    "torch": 1e-4,
    "torch-cuda": 0.05,
    "torch-mps": 0.05,
    "llamacpp": 0.01,
    "vllm": 0.1,
}
DEFAULT_MISMATCH = 0.1
# A chosen token below this probability is "improbable" for the sampling-shape count.
IMPROBABLE_P = 0.01
# K may exceed its honest mean by this many standard deviations plus a constant before the count
# test fails: the constant covers Poisson tails when the mean is near 0.
SHAPE_SIGMAS = 4.0
SHAPE_SLACK = 2.0
# The second test: z of the chosen tokens' log p + H (mean 0 for the policy's own samples), each
# token's term clipped below at -SHAPE_CLIP nats so one rare honest token cannot dominate, over
# the exact second moment of the clipped term. Each test alone misses something (the count:
# EOS-only completions just above IMPROBABLE_P; z: several rare honest tokens at once), so
# failing either fails the group.
# Measured on 600 honest groups each at three warm-up levels: 0 false rejections; random-token
# groups under a warmed-up policy: 200/200 caught (under an untrained, near-uniform policy
# random tokens are genuinely indistinguishable from its samples).
SHAPE_CLIP = 4.0
SHAPE_MIN_Z = -5.0
# An EOS the policy gives less than this probability is not a place it would have stopped.
MIN_EOS_PROB = 1e-3
# More than this fraction of a group's "stop" completions ending improbably fails the group.
MAX_IMPROBABLE_STOPS = 0.25


def token_stats(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From (tokens, vocab) log-softmax rows: entropy H, the mass on improbable tokens (q_t of
    the count test) and E[clip(log p + H, -SHAPE_CLIP)^2] (the clipped z test's scale)."""
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    q = (p * (p < IMPROBABLE_P)).sum(-1)
    x = (logp + ent.unsqueeze(-1)).clamp(min=-SHAPE_CLIP)
    return ent, q, (p * x * x).sum(-1)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    stats: dict[str, float] = field(default_factory=dict)


class Rescorer:
    """Holds the published states of the last ``keep`` versions and scores groups under them."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        keep: int,
        temperature: float,
        engine_thresholds: dict[str, float] | None = None,
        device: torch.device | str = "cpu",
        model: torch.nn.Module | None = None,
        load_into: Callable[[torch.nn.Module, dict[str, torch.Tensor]], None] = load_state,
    ) -> None:
        """``model`` and ``load_into``: the model remembered states are scored with (default: a
        fresh one of ``spec`` on ``device``) and how a state enters it (default: a whole state;
        a LoRA trainer passes its base with an adapter and an adapter-only load,
        ``echo.learner.lora``)."""
        self.model = (model if model is not None else build_model(spec)).to(device)
        self.model.eval()
        self.load_into = load_into
        self.temperature = temperature
        self.keep = keep
        self.thresholds = engine_thresholds or MISMATCH_THRESHOLDS
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._loaded = -1
        self.pad_id = pad_id_of(self.model)
        self.last_seconds = 0.0

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self._states[version] = state
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    @torch.inference_mode()
    def _token_stats(self, groups: list[TrainGroup]) -> list[tuple[torch.Tensor, ...]]:
        """Per group, per completion token: log p(chosen) and :func:`token_stats`. One batched
        prefill for all groups (they share a version), each group's prompt computed once."""
        logits, tokens = completion_logits(
            self.model,
            [list(g.prompt_ids) for g in groups],
            [[list(c) for c in g.completions] for g in groups],
            self.pad_id,
        )
        return self._stats_from(groups, logits, tokens)

    def _stats_from(
        self, groups: list[TrainGroup], logits: torch.Tensor, tokens: torch.Tensor
    ) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`_token_stats` from the logits predicting each completion token."""
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        sizes = [sum(len(c) for c in g.completions) for g in groups]
        # To the CPU in one copy each: :meth:`judge` reads them a few numbers at a time.
        parts = [chosen.cpu().split(sizes), *(t.cpu().split(sizes) for t in token_stats(logp))]
        return list(zip(*parts, strict=True))

    def check(
        self, groups: list[TrainGroup], finish: list[list[str]], engines: list[str] | None = None
    ) -> list[Verdict]:
        """A verdict per group, scoring each group under the weights of the version it claims."""
        t0 = time.perf_counter()
        out: list[Verdict | None] = [None] * len(groups)
        by_version: dict[int, list[int]] = {}
        for gi, g in enumerate(groups):
            if g.version not in self._states:
                # Not the node's fault (we restarted and lost that version's weights): dropped.
                out[gi] = Verdict(False, R.UNSCORABLE, {"version": float(g.version)})
            elif not any(g.completions):
                out[gi] = Verdict(False, R.INCOMPLETE_GROUP, {})
            else:
                by_version.setdefault(g.version, []).append(gi)
        for version, members in by_version.items():
            if self._loaded != version:
                self._load(version)
                self._loaded = version
            mine = self._share(members)
            stats = self._token_stats([groups[i] for i in mine])
            for gi, st in zip(mine, stats, strict=True):
                engine = engines[gi] if engines else "torch"
                out[gi] = self.judge(groups[gi], finish[gi], engine, *st)
        if by_version:
            self._gather(out)
        self.last_seconds = time.perf_counter() - t0
        return [v for v in out if v is not None]

    # Hooks of the FSDP2 learner's sharded re-scorer (echo.learner.fsdp.trainer), where each
    # rank scores its share of a version's groups and the verdicts are gathered.

    def _load(self, version: int) -> None:
        """Put the weights of ``version`` into the model."""
        self.load_into(self.model, self._states[version])

    def _share(self, members: list[int]) -> list[int]:
        """The groups of one version (indices) this process scores: all of them here."""
        return members

    def _gather(self, out: list[Verdict | None]) -> None:
        """Fill in the verdicts other processes reached: none here."""

    def judge(
        self,
        g: TrainGroup,
        finish: list[str],
        engine: str,
        lp: torch.Tensor,
        ent: torch.Tensor,
        q: torch.Tensor,
        m2: torch.Tensor,
    ) -> Verdict:
        """The verdict on one group from its per-token statistics (see the module docstring)."""
        behaviour = torch.tensor([x for c in g.behaviour_logprobs for x in c], dtype=torch.float32)
        n = int(lp.numel())
        mismatch = float((lp - behaviour).abs().mean()) if n else 0.0
        k = float((lp.exp() < IMPROBABLE_P).sum())
        q = q.clamp(0.0, 1.0)  # float rounding can push a sum of probabilities past 1
        k_mean, k_var = float(q.sum()), float((q * (1 - q)).sum())
        k_limit = k_mean + SHAPE_SIGMAS * math.sqrt(k_var) + SHAPE_SLACK
        clipped = (lp + ent).clamp(min=-SHAPE_CLIP)
        z = float(clipped.sum() / math.sqrt(float(m2.sum()) + 1e-9)) if n else 0.0
        median_p = float(lp.exp().median()) if n else 1.0
        excess_entropy = float(-(lp + ent).mean()) if n else 0.0
        improbable, stops, at = 0, 0, 0
        for c, reason in zip(g.completions, finish, strict=True):
            at += len(c)
            if reason == "stop" and c:
                stops += 1
                if math.exp(float(lp[at - 1])) < MIN_EOS_PROB:
                    improbable += 1
        stats = {
            "mismatch": mismatch,
            "improbable": k,
            "improbable_limit": k_limit,
            "z": z,
            "median_p": median_p,
            "excess_nll": excess_entropy,
            "tokens": float(n),
            "improbable_stops": float(improbable),
        }
        if mismatch > self.thresholds.get(engine, DEFAULT_MISMATCH):
            return Verdict(False, R.RESCORE_MISMATCH, stats)
        if k > k_limit or z < SHAPE_MIN_Z:
            return Verdict(False, R.SAMPLING_SHAPE, stats)
        if stops and improbable / stops > MAX_IMPROBABLE_STOPS:
            return Verdict(False, R.TERMINATION_IMPROBABLE, stats)
        return Verdict(True, "", stats)
