"""The pure-torch reference engine: batched sampling with a KV cache over any HF causal LM.

All requests' samples run as one batch: prompts are left-padded so every row's last prompt token
sits in the same column, an attention mask hides the padding, and explicit position ids make each
row count positions from its own first real token (so a row's log-probs do not depend on how long
its neighbours' prompts are). Each request's prompt is prefilled once and its KV cache repeated
for the request's ``n`` samples. Then one token per step is fed with the cache, until every row
has stopped at EOS or reached its budget.

Log-probs follow ``echo.node.engines.base``: ``log_softmax(logits / temperature)`` of the sampled
token over the full vocabulary, before top-p truncation, so the learner recomputes them exactly.
Each request samples from its own ``torch.Generator`` seeded by its ``SamplingParams.seed``, so its
random stream does not depend on what else is in the batch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from echo.models.kv_cache import forward_with_cache
from echo.models.spec import ModelSpec, build_model, eos_token_id
from echo.models.weights import DTYPES, export_state
from echo.models.weights import load_state as load_model_state
from echo.models.weights import state_digest as digest_of
from echo.node.engines.base import Completion, Engine, GenRequest, SamplingParams
from echo.node.engines.step_threads import StepThreads
from echo.node.engines.torch_lora import TorchLora


class TorchEngine(Engine):
    """Reference engine on CPU or one GPU. ``threads`` sets torch's (process-wide) thread count;
    on the CPU with ``adapt_threads`` each decode step runs on 1 thread or on ``threads``,
    whichever the last steps' times say is faster now (:mod:`~echo.node.engines.step_threads`:
    on a machine whose cores are busy, 1 thread decoded a small model several times faster than
    2); torch's count is restored after each :meth:`generate`. Off by default: torch's matmul
    reductions round differently on another thread count, so with it two calls on the same seeds
    may differ in the last bits of a log-prob; the node turns it on
    (:func:`~echo.node.engines.factory.make_engine`), where speed matters and log-probs are
    checked within a tolerance anyway."""

    name = "torch"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        device: str = "cpu",
        threads: int | None = None,
        dtype: str = "float32",
        adapt_threads: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.spec = spec
        self.device = torch.device(device)
        self.step_threads = StepThreads(
            torch.get_num_threads(), adapt=adapt_threads and self.device.type == "cpu"
        )
        self.dtype = dtype
        self.model = build_model(spec).to(self.device, DTYPES[dtype]).eval()
        self.eos_id = eos_token_id(spec)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_id  # any valid id: padded positions are masked out
        self.vocab_size = self.model.config.vocab_size
        # The dtype weights were published in: the digest is computed in it, so an engine running
        # float32 weights loaded from a bfloat16 state still matches the learner's bf16 digest.
        self._state_dtype = dtype
        self.last_stats: dict[str, float] = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
        self._lora: TorchLora | None = None  # set while the engine serves LoRA adapters

    # -- weights ------------------------------------------------------------------------------

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` into the model (exact; cast to the engine's dtype if it differs)."""
        if self._lora is not None:  # back from serving adapters: the plain model again
            self.model = build_model(self.spec).to(self.device, DTYPES[self.dtype]).eval()
            self._lora, self.lora_served = None, ""
        load_model_state(self.model, state)
        floats = [t.dtype for t in state.values() if t.is_floating_point()]
        if floats:
            self._state_dtype = str(floats[0]).removeprefix("torch.")

    def state_digest(self) -> str:
        if self._lora is not None:
            return self._lora.served_digest()
        return digest_of(export_state(self.model, self._state_dtype))

    def holds_base(self, base_digest: str) -> bool:
        return self._lora is not None and self._lora.holds_base(base_digest)

    def load_adapter(
        self, base: dict[str, torch.Tensor] | None, adapter: dict[str, torch.Tensor], ref: Any
    ) -> None:
        """Serve a LoRA adapter through the learner's own ``peft`` layers
        (:mod:`echo.node.engines.torch_lora`); the base loads once, adapters switch in place."""
        lora = self._lora or TorchLora(self.spec, self.device, self.dtype)
        self.lora_served = lora.load(base, adapter, ref)
        assert lora.model is not None
        self._lora, self.model = lora, lora.model

    # -- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Sample every request's ``n`` completions in one batch (see the module docstring)."""
        if not requests:
            return []
        start = time.perf_counter()
        dev = self.device
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"prompt token id outside [0, {self.vocab_size})")

        # One row per sample; rows of a request are contiguous (slices[i]).
        slices, at = [], 0
        for r in requests:
            slices.append(slice(at, at + r.n))
            at += r.n
        rows = at
        counts = torch.tensor([r.n for r in requests])
        # Each request's prompt is prefilled once (one row per request) and its KV cache, logits,
        # mask and positions are then repeated for the request's n samples: a group's samples
        # share their prompt, so prefilling it n times would only repeat the same work.
        prompts = [r.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        expand = torch.repeat_interleave(torch.arange(len(prompts)), counts).to(dev)

        params = [r.params for r in requests]

        def per_row(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(values, dtype=dtype), counts).to(dev)

        # Greedy rows (temperature 0) report the raw log_softmax, i.e. temperature 1.
        row_temp = per_row([p.temperature or 1.0 for p in params], torch.float32).unsqueeze(1)
        row_top_p = per_row([p.top_p for p in params], torch.float32)
        budget = per_row([p.max_new_tokens for p in params], torch.long)
        gens = [self._generator(p) for p in params]

        before = torch.get_num_threads()
        if self.step_threads.adapt:
            torch.set_num_threads(self.step_threads.chosen)
        try:
            tokens, logps, length, stopped = self._decode(
                ids, mask, pos, expand, rows, budget, row_temp, row_top_p, params, slices, gens
            )
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

        tok_rows = torch.stack(tokens, 1).cpu().tolist()
        lp_rows = torch.stack(logps, 1).cpu().tolist()
        lengths, stops = length.cpu().tolist(), stopped.cpu().tolist()
        result: list[list[Completion]] = []
        for sl in slices:
            result.append(
                [
                    Completion(
                        token_ids=tok_rows[i][: lengths[i]],
                        logprobs=lp_rows[i][: lengths[i]],
                        finish_reason="stop" if stops[i] else "length",
                    )
                    for i in range(sl.start, sl.stop)
                ]
            )
        seconds = time.perf_counter() - start
        n_tokens = int(sum(lengths))
        self.last_stats = {
            "tokens": n_tokens,
            "seconds": seconds,
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
        }
        return result

    def _decode(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        expand: torch.Tensor,
        rows: int,
        budget: torch.Tensor,
        row_temp: torch.Tensor,
        row_top_p: torch.Tensor,
        params: list[SamplingParams],
        slices: list[slice],
        gens: list[torch.Generator],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Prefill one row per request, repeat it for the samples, then step every row to EOS
        or its budget; (tokens per step, log-probs per step, lengths, stopped at EOS)."""
        dev = self.device
        st = self.step_threads
        out, cache = forward_with_cache(
            self.model, input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1
        )
        logits = out.logits[:, -1, :].index_select(0, expand)
        cache = repeat_rows(cache, expand)
        mask, next_pos = mask.index_select(0, expand), pos[:, -1].index_select(0, expand) + 1

        tokens, logps = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        length = torch.zeros(rows, dtype=torch.long, device=dev)
        for _ in range(int(budget.max())):
            tok, lp = self._sample(logits.float(), row_temp, row_top_p, params, slices, gens)
            tok = torch.where(done, self.pad_id, tok)
            tokens.append(tok)
            logps.append(lp)
            length += (~done).long()
            hit_eos = (~done) & (tok == self.eos_id)
            stopped |= hit_eos
            done |= hit_eos | (length >= budget)
            if bool(done.all()):
                break
            # Finished rows keep stepping (their outputs are ignored): pruning the cache would
            # cost more than it saves at these batch sizes.
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=dev)], 1)
            n = st.threads()
            if st.adapt and n != torch.get_num_threads():
                torch.set_num_threads(n)
            t0 = time.perf_counter()
            out, cache = forward_with_cache(
                self.model,
                cache,
                input_ids=tok.unsqueeze(1),
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(1),
            )
            st.observe(n, time.perf_counter() - t0)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        return tokens, logps, length, stopped

    @staticmethod
    def _generator(params: SamplingParams) -> torch.Generator:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        return torch.Generator().manual_seed(seed % (1 << 63))

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        row_temp: torch.Tensor,
        row_top_p: torch.Tensor,
        params: list[SamplingParams],
        slices: list[slice],
        gens: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its log-prob (full-vocabulary, before top-p)."""
        logp = torch.log_softmax(logits / row_temp, dim=-1)
        sample_logp = logp
        if bool((row_top_p < 1).any()):
            # Keep the smallest prefix of the sorted distribution whose mass reaches top_p
            # (the top token always stays), renormalised by sampling from the kept mass.
            sorted_lp, order = logp.sort(dim=-1, descending=True)
            mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
            # Rows with top_p == 1 drop nothing, even where rounding pushes the mass past 1.
            drop_sorted = (mass_before >= row_top_p.unsqueeze(1)) & (row_top_p < 1).unsqueeze(1)
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            sample_logp = logp.masked_fill(drop, float("-inf"))
        probs = sample_logp.exp()
        tok = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for p, sl, g in zip(params, slices, gens, strict=True):
            if p.temperature == 0:
                tok[sl] = logits[sl].argmax(-1)
            else:
                # Sampling on the CPU keeps one generator per request on any device.
                tok[sl] = torch.multinomial(probs[sl].cpu(), 1, generator=g).squeeze(1).to(tok)
        return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)


def repeat_rows(cache: Any, index: torch.Tensor) -> Any:
    """``cache`` with its batch rows taken at ``index`` (rows repeated for a group's samples):
    a transformers ``Cache`` in place (``reorder_cache``, which index-selects every layer's keys
    and values), or the legacy tuple of per-layer (key, value) tensors anew."""
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(index)
        return cache
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)
