"""GRPO for rollouts generated elsewhere, in one file.

The learner receives GRPO groups (one prompt, several sampled completions, their rewards, and the
per-token log-probs the node's engine reported when it sampled them) and takes optimizer steps.
Its hyper-parameters are :class:`echo.protocol.jobspec.GRPOParams`, the ``[job.grpo]`` table of a
job, defined there once so that every field can be set from a job file.

Per completion token t of sample i in group g, with the group-normalised advantage

    A_i      = (r_i - mean_g(r)) / (std_g(r) + adv_eps)

and mu_t the node's behaviour log-prob of t (the policy it sampled from, in its engine), the
loss is the token-mean over all trained completion tokens of the batch of minus the job's
per-token objective (``objective``: PPO's clipped surrogate anchored at mu, or CISPO's clipped
importance weight; :mod:`echo.learner.algorithm.objective` gives both and why). On-policy (S = 0, or
the first epoch of a group from the current weights) both are exactly the on-policy gradient. Extra
epochs (``ppo_epochs``) reuse the batch inside the same trust region.

Log-probs everywhere are ``log_softmax(logits / temperature)`` of the full vocabulary, the same
definition the engines report (see ``echo.node.engines.base``), so :meth:`GRPOLearner.score`
recomputes a node's numbers; the learner's re-scoring (``echo.learner.rescoring.rescore``) builds on
it.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from echo.learner.algorithm.clip import clip_gradients
from echo.learner.algorithm.objective import token_surrogate
from echo.protocol.jobspec import GRPOParams

GRPOConfig = GRPOParams  # the learner's name for the job's [job.grpo] table


# Re-scoring hooks of :meth:`GRPOLearner.step`. TokenStats maps the (tokens, vocab) log-softmax
# rows to per-token figures; Gate gets, per group, (log-probs, *figures) and says which groups
# may be trained on.
TokenStats = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
Gate = Callable[[list[tuple[torch.Tensor, ...]]], list[bool]]


class Across:
    """How the step's sums and maxima span the processes that share its batch: here, one
    process holds all of it. The FSDP2 learner passes one that reduces over its ranks
    (``echo.learner.fsdp.trainer``), so the loss is divided by the whole batch's token count
    and the metrics describe the whole batch, whichever rank computes them."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def max(self, values: torch.Tensor) -> torch.Tensor:
        return values


@dataclass
class TrainGroup:
    """One GRPO group as the learner consumes it.

    ``prompt_ids``: token ids of the prompt all completions share. ``completions``: generated token
    ids (ending with EOS when the sample stopped). ``behaviour_logprobs``: per completion token, as
    the node reported. ``version``: the policy version the node sampled with.
    """

    prompt_ids: list[int]
    completions: list[list[int]]
    behaviour_logprobs: list[list[float]]
    rewards: list[float]
    version: int = 0

    def check(self, vocab_size: int) -> None:
        """Raise ValueError if the lists disagree in length or hold impossible values."""
        n = len(self.completions)
        if n == 0:
            raise ValueError("group has no completions")
        if len(self.behaviour_logprobs) != n or len(self.rewards) != n:
            raise ValueError(
                f"group has {n} completions, {len(self.behaviour_logprobs)} log-prob lists "
                f"and {len(self.rewards)} rewards"
            )
        if not self.prompt_ids:
            raise ValueError("group has an empty prompt")
        for c, lp in zip(self.completions, self.behaviour_logprobs, strict=True):
            if len(c) != len(lp):
                raise ValueError(f"completion of {len(c)} tokens has {len(lp)} log-probs")
        ids = [t for c in self.completions for t in c] + list(self.prompt_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"token id outside [0, {vocab_size})")
        if not all(math.isfinite(r) for r in self.rewards):
            raise ValueError("reward is not finite")
        # A little above 0 is rounding in some engine's log_softmax, not a probability above 1.
        if not all(math.isfinite(x) and x <= 1e-3 for lp in self.behaviour_logprobs for x in lp):
            raise ValueError("behaviour log-prob is not a finite number <= 0")


def group_advantages(rewards: list[float] | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) within a group (population std); an all-equal group gives zeros,
    exactly (it carries no signal about which sample was better)."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.numel() == 0 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


@dataclass
class PaddedBatch:
    """Groups flattened to right-padded rows of prompt + completion."""

    ids: torch.Tensor  # (rows, width) token ids, padded
    mask: torch.Tensor  # (rows, width) 1 on real tokens
    target: torch.Tensor  # (rows, width - 1) bool: position p predicts a completion token p + 1
    lengths: list[int]  # completion length of each row


def shares(n: int, parts: int) -> list[range]:
    """The indices of ``n`` items (groups) in ``parts`` contiguous runs, sizes differing by at
    most one, the larger runs first: how an FSDP2 learner's ranks split a batch, and how a
    step splits into :attr:`GRPOLearner.parts`."""
    base, extra = divmod(n, parts)
    starts = [k * base + min(k, extra) for k in range(parts + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(parts)]


def pad_id_of(model: torch.nn.Module) -> int:
    """The id to pad a batch with: any valid one does (padding is masked out), so the config's
    pad id when it is one, else 0."""
    pad = getattr(model.config, "pad_token_id", None)
    vocab = model.get_input_embeddings().num_embeddings
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab else 0


def pad_batch(
    prompts: list[list[int]],
    completions: list[list[list[int]]],
    pad_id: int,
    device: torch.device,
) -> PaddedBatch:
    """Group ``i``'s completions ``completions[i]`` after its prompt ``prompts[i]``, one
    right-padded row each: causal attention keeps real tokens from seeing the pads after them,
    and positions count from 0 in every row, as in the engines' left-padded batches."""
    rows = [(p, c) for p, group in zip(prompts, completions, strict=True) for c in group]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
        # Logits at position p predict token p + 1: completion tokens sit at
        # prompt_len .. prompt_len + length - 1, predicted from one position earlier.
        target[i, len(p) - 1 : len(p) - 1 + len(c)] = True
    lengths = [len(c) for _, c in rows]
    return PaddedBatch(ids.to(device), mask.to(device), target.to(device), lengths)


class GRPOLearner:
    """Owns the policy and its optimizer: :meth:`step` trains on groups, :meth:`score` re-scores."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: GRPOConfig | None = None,
        temperature: float = 1.0,
        reference: torch.nn.Module | None = None,
        across: Across | None = None,
        parts: int = 1,
    ) -> None:
        """``reference``: the policy the KL term (``kl_coef``) holds the model near; a frozen
        copy of ``model`` as given when None (a learner restored from a checkpoint passes the
        policy it started from instead). ``across``: the reductions over the processes that
        share each batch (see :class:`Across`). ``parts``: see :attr:`parts`.

        :raises ValueError: if ``temperature`` is not positive (greedy samples carry no policy
            gradient) or ``parts`` is below 1.
        """
        if not temperature > 0:
            raise ValueError("temperature must be > 0 (greedy samples carry no policy gradient)")
        if parts < 1:
            raise ValueError(f"a step splits into at least 1 part, not {parts}")
        # How many contiguous parts a step computes its groups in (:func:`shares`), each padded,
        # forwarded and back-propagated on its own: the arithmetic of that many FSDP2 ranks
        # (each a part, their gradients summed), where one part (the whole batch in one
        # forward) rounds differently. The same update in exact arithmetic either way.
        self.parts = parts
        # Eval mode throughout (gradients still flow): dropout would make our log-probs a
        # different function from the one engines sample with and the coordinator re-scores.
        self.model = model.eval()
        self.cfg = cfg or GRPOConfig()
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.pad_id = pad_id_of(model)
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=self.cfg.lr,
            betas=self.cfg.betas,
            weight_decay=self.cfg.weight_decay,
        )
        self.reference: torch.nn.Module | None = None
        if self.cfg.kl_coef > 0:
            ref = reference if reference is not None else copy.deepcopy(model)
            self.reference = ref.to(self.device).eval().requires_grad_(False)
        self.version = 0  # number of steps taken; groups sampled at version v are version - v old
        self.across = across or Across()

    # -- batching and log-probs ---------------------------------------------------------------

    def _batch(self, groups: list[TrainGroup]) -> PaddedBatch:
        if not groups:
            # A rank whose share of the batch is empty still takes part in the sharded
            # forward and backward (their collectives need every rank): one row of two pads,
            # predicting nothing.
            ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
            target = torch.zeros((1, 1), dtype=torch.bool, device=self.device)
            return PaddedBatch(ids, torch.ones_like(ids), target, [])
        for g in groups:
            g.check(self.vocab_size)
        return pad_batch(
            [list(g.prompt_ids) for g in groups],
            [[list(c) for c in g.completions] for g in groups],
            self.pad_id,
            self.device,
        )

    def _logprobs(
        self,
        batch: PaddedBatch,
        stats: TokenStats | None = None,
        reference: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Log-probs of every completion token, flattened in row-major order (rows, then tokens).

        With ``stats``, also ``stats(log_softmax rows)`` computed without grad: per-token figures
        of the whole distribution that re-scoring needs, from this same forward. With
        ``reference`` (:meth:`_reference_logp` of the same batch), each token's
        KL(policy || reference), with grad, comes last in them.
        """
        # Right padding: causal attention keeps real tokens from seeing the pads after them, and
        # positions count from 0 in every row, as in the engine's left-padded batches.
        logits = self.model(input_ids=batch.ids, attention_mask=batch.mask).logits
        logits = logits[:, :-1][batch.target].float()  # (completion tokens, vocab)
        tokens = batch.ids[:, 1:][batch.target]
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if stats is None and reference is None:
            return chosen
        with torch.no_grad():
            figures = stats(logp.detach()) if stats is not None else ()
        if reference is not None:
            # The exact KL over the vocabulary, not a sampled estimate: what it must hold is
            # the mass of the answers no sample drew.
            figures = (*figures, (logp.exp() * (logp - reference)).sum(-1))
        return chosen, figures

    @torch.no_grad()
    def _reference_logp(self, batch: PaddedBatch) -> torch.Tensor | None:
        """The reference policy's log_softmax rows at the completion tokens of ``batch``
        (None without a KL term): once per step, as every epoch compares with the same."""
        if self.reference is None:
            return None
        logits = self.reference(input_ids=batch.ids, attention_mask=batch.mask).logits
        return torch.log_softmax(logits[:, :-1][batch.target].float() / self.temperature, -1)

    @torch.no_grad()
    def score(self, groups: list[TrainGroup]) -> list[list[list[float]]]:
        """Per-token log-probs of each group's completions under the current weights (the same
        definition engines report). Only ``prompt_ids`` and ``completions`` are read."""
        probe = [
            TrainGroup(
                g.prompt_ids,
                g.completions,
                [[0.0] * len(c) for c in g.completions],
                [0.0] * len(g.completions),
                g.version,
            )
            for g in groups
        ]
        if not probe:
            return []
        batch = self._batch(probe)
        flat = self._logprobs(batch).cpu().tolist()
        out, at, row = [], 0, 0
        for g in groups:
            per_group = []
            for _ in g.completions:
                n = batch.lengths[row]
                per_group.append(flat[at : at + n])
                at, row = at + n, row + 1
            out.append(per_group)
        return out

    # -- the update ---------------------------------------------------------------------------

    def step(
        self,
        groups: list[TrainGroup],
        gate: Gate | None = None,
        gate_stats: TokenStats | None = None,
    ) -> dict[str, float]:
        """One update on ``groups`` (``ppo_epochs`` optimizer steps); returns metrics.

        ``gate``, if given, sees per group the log-prob of each completion token and the
        per-token ``gate_stats`` of the distribution, both from this step's own first forward,
        and returns which groups may be trained on; the others get zero weight. Re-scoring
        groups sampled from the current weights thus costs no extra forward pass.

        The groups are computed in :attr:`parts` contiguous parts (:func:`shares`; one unless
        set), each padded, forwarded and back-propagated on its own, their gradients added in
        order.
        """
        cfg = self.cfg
        start = time.perf_counter()
        split = [[groups[i] for i in r] for r in shares(len(groups), self.parts)]
        parts = [p for p in split if p] or [groups]
        batches = [self._batch(p) for p in parts]
        dev = self.device
        across = self.across

        def total(*values: float | torch.Tensor) -> list[float]:
            """Sums over every process's share of the batch."""
            t = torch.tensor([float(v) for v in values], dtype=torch.float64)
            return across.sum(t).tolist()

        # Per part, each token's advantage and behaviour log-prob, in _logprobs's flat order.
        adv_groups = [group_advantages(g.rewards, cfg.adv_eps) for g in groups]
        advs, behaviours, at = [], [], 0
        for part, batch in zip(parts, batches, strict=True):
            rows = adv_groups[at : at + len(part)]
            at += len(part)
            adv_rows = torch.cat(rows) if rows else torch.zeros(0)
            lengths = torch.tensor(batch.lengths, dtype=torch.long)
            advs.append(torch.repeat_interleave(adv_rows, lengths).to(dev))
            behaviours.append(
                torch.tensor(
                    [x for g in part for lp in g.behaviour_logprobs for x in lp],
                    dtype=torch.float32,
                ).to(dev)
            )
        behaviour = torch.cat(behaviours)
        rewards = [r for g in groups for r in g.rewards]
        staleness = [self.version - g.version for g in groups]
        signal, n_tokens, reward_sum, n_rewards, stale_sum, n_groups = total(
            sum(bool(a.any()) for a in adv_groups),
            behaviour.numel(),
            sum(rewards),
            len(rewards),
            sum(staleness),
            len(staleness),
        )
        stale_max = across.max(torch.tensor([max(staleness, default=-(1 << 30))]))
        metrics: dict[str, float] = {
            # Groups whose samples scored differently: the only ones the policy gradient sees.
            "signal_groups": signal,
            "reward": reward_sum / n_rewards,
            "tokens": n_tokens,
            "staleness_max": float(stale_max[0]),
            "staleness_mean": stale_sum / n_groups,
        }
        if n_tokens == 0:  # nothing to learn from (all completions empty)
            metrics.update(loss=0.0, mismatch=0.0, is_w=1.0, clip_frac=0.0, grad_norm=0.0)
            metrics["step_s"] = time.perf_counter() - start
            return metrics

        keeps = [torch.ones(b.numel(), device=dev) for b in behaviours]  # tokens the gate passes
        references = [self._reference_logp(b) for b in batches]
        for epoch in range(cfg.ppo_epochs):
            gated = epoch == 0 and gate is not None
            stats = (gate_stats or (lambda lp: ())) if gated else None
            logps, kls, extras = [], [], []
            for batch, reference in zip(batches, references, strict=True):
                if stats is not None or reference is not None:
                    logp, extra = self._logprobs(batch, stats, reference)
                    if reference is not None:
                        *extra, token_kl = extra
                        kls.append(token_kl)
                    extras.append(extra)
                else:
                    logp = self._logprobs(batch)
                logps.append(logp)
            if epoch == 0:
                first = torch.cat([lp.detach() for lp in logps])
                (abs_diff,) = total((first - behaviour).abs().sum())
                metrics["mismatch"] = abs_diff / n_tokens
                if gate is not None:
                    sizes = [sum(len(c) for c in g.completions) for g in groups]
                    figures = [torch.cat(f) for f in zip(*extras, strict=True)]
                    # The gate judges on the CPU (a few numbers at a time): one copy each.
                    cut = [first.cpu().split(sizes), *(t.cpu().split(sizes) for t in figures)]
                    verdicts = gate(list(zip(*cut, strict=True)))
                    keep = torch.repeat_interleave(
                        torch.tensor(verdicts, dtype=torch.float32),
                        torch.tensor(sizes, dtype=torch.long),
                    ).to(dev)
                    keeps = list(keep.split([b.numel() for b in behaviours]))
                    (metrics["gated_groups"],) = total(len(verdicts) - sum(verdicts))
                    if total(keep.sum())[0] == 0:  # every group failed re-scoring: no update
                        metrics.update(loss=0.0, is_w=0.0, clip_frac=0.0, grad_norm=0.0)
                        self.version += 1
                        metrics["step_s"] = time.perf_counter() - start
                        return metrics
                kept = torch.cat(keeps) > 0
                # pi_theta / mu at the start of the step: how far the policy has moved since
                # the node sampled (staleness) or how far its engine is from ours.
                w = torch.exp(first - behaviour)[kept]
                w_sum, w_outside, n_kept = total(
                    w.sum(), ((w < 1 - cfg.clip_eps) | (w > 1 + cfg.clip_eps)).sum(), w.numel()
                )
                metrics["is_w"] = w_sum / n_kept
                metrics["is_w_outside"] = w_outside / n_kept
                # The loss is a token-mean over the whole batch's trained tokens, whichever
                # process holds them: each divides its own sum by the batch's count.
                kept_total = torch.tensor(n_kept, dtype=torch.float32, device=dev)
            self.opt.zero_grad(set_to_none=True)
            losses, mean_kls, stopped = [], [], 0.0
            for i, logp in enumerate(logps):
                adv, keep = advs[i], keeps[i]
                surrogate, held = token_surrogate(logp, behaviours[i], adv, cfg)
                loss = -(keep * surrogate).sum() / kept_total  # token-mean over trained tokens
                if kls:
                    mean_kl = (keep * kls[i]).sum() / kept_total
                    loss = loss + cfg.kl_coef * mean_kl
                    mean_kls.append(float(mean_kl.detach()))
                # Each part back-propagates on its own, as a rank would: its whole gradient is
                # then added to the parts' before it.
                loss.backward()
                losses.append(float(loss.detach()))
                # Tokens whose gradient the objective's clip stopped (ppo) or bounded (cispo).
                stopped += float(held[keep > 0].sum())
            grad_norm = clip_gradients(self.model.parameters(), cfg.max_grad_norm, across.sum)
            self.opt.step()
            if epoch == 0:
                if kls:
                    (metrics["kl"],) = total(sum(mean_kls))
                (metrics["loss"],) = total(sum(losses))
                metrics["grad_norm"] = float(grad_norm)
            (stopped,) = total(stopped)
            metrics["clip_frac"] = stopped / n_kept

        self.version += 1
        metrics["step_s"] = time.perf_counter() - start
        return metrics
