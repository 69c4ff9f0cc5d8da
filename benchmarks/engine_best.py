"""Each engine's best offline group generation: the ceiling the node's engines are measured against.

For the same model, prompts, group size and lengths as the node's path, each engine is called
the way its own documentation generates ``n`` samples per prompt, with no node code in between,
under a few settings; the fastest setting is the engine's best (``group_vs_engine_<engine>`` =
node tokens/s over it, measured in the same run by ``benchmarks/engines.py`` and
``benchmarks/real_model.py``).

- torch: ``transformers``' ``model.generate(..., do_sample=True, num_return_sequences=group)``,
  all groups in one call (left-padded) or one call per group, on the engine's own model object.
- llama.cpp: its batched decoding through the C API, as llama.cpp's ``batched`` example does it:
  each prompt prefilled once into one sequence and copied to the group's other sequences
  (``llama_memory_seq_cp``), one ``llama_decode`` per step for every unfinished sequence, and
  llama.cpp's own sampler (``llama_sampler_init_dist``, temperature 1) picking tokens in C.
  Settings: sequences per context (one group, or every group at once), threads, ``n_batch``;
  the GGUF is the node engine's own file (same weights, same storage dtype), mapped with
  llama.cpp's defaults (repacking allowed).
- vLLM: ``LLM.generate`` on the node engine's own ``LLM``, one ``SamplingParams(n=group)`` per
  prompt, no log-probs asked.

Every runner returns the number of tokens generated (EOS counted, as the node counts it); the
caller times it, so rounds of the node path and of each setting can be interleaved.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Runner = Callable[[], int]


def _count(rows: torch.Tensor, eos_id: int) -> int:
    """Tokens generated in ``rows`` (samples x new tokens): up to and including the first EOS."""
    hit = rows == eos_id
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, rows.shape[1])
    return int(first.sum())


# ------------------------------------------------------------------------------------------ torch


def torch_runners(
    model: Any, prompts: list[list[int]], group: int, max_new: int, eos_id: int, pad_id: int
) -> dict[str, Runner]:
    """``transformers`` ``generate`` with ``num_return_sequences``: all groups in one call, and
    one call per group."""

    def batch(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids, mask

    @torch.inference_mode()
    def run(ps: list[list[int]]) -> int:
        ids, mask = batch(ps)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_return_sequences=group,
            max_new_tokens=max_new,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        return _count(out[:, ids.shape[1] :], eos_id)

    return {
        "generate(all groups, num_return_sequences)": lambda: run(prompts),
        "generate(one group per call)": lambda: sum(run([p]) for p in prompts),
    }


# -------------------------------------------------------------------------------------- llama.cpp


class LlamaBatched:
    """llama.cpp's batched decoding with its own sampler on one context (see the module
    docstring). ``close`` frees what llama.cpp handed out."""

    def __init__(
        self,
        ll: Any,
        model: Any,
        *,
        n_seq: int,
        seq_len: int,
        threads: int,
        n_batch: int,
        vocab_size: int,
        f32_kv: bool = False,
    ) -> None:
        self.ll, self.n_seq, self.vocab_size = ll, n_seq, vocab_size
        cp = ll.llama_context_default_params()
        if f32_kv:  # the node engine's KV settings (log-prob parity): F32 cache, no flash attention
            cp.type_k = cp.type_v = 0
            cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.n_ctx = seq_len * n_seq
        cp.n_seq_max = n_seq
        cp.n_batch = cp.n_ubatch = max(n_batch, n_seq)
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = max(n_batch, n_seq)  # a step decodes every sequence in one batch
        self.batch = ll.llama_batch_init(max(n_batch, n_seq), 0, 1)
        self.seed = 1

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode at most ``n_batch`` ``(seq, token, pos, logits)`` items as one batch; the
        batch indices of the items that asked for logits."""
        ll, b = self.ll, self.batch
        outs = []
        for i, (s, t, p, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, want
            b.seq_id[i][0] = s
            if want:
                outs.append(i)
        b.n_tokens = len(items)
        if ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return outs

    def _sampler(self) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(self.seed))
        self.seed += 1
        return chain

    def run(self, prompts: list[list[int]], group: int, max_new: int, eos_id: int) -> int:
        """Generate ``group`` samples of every prompt, ``n_seq // group`` prompts at a time."""
        per = max(1, self.n_seq // group)
        total = 0
        for lo in range(0, len(prompts), per):
            total += self._chunk(prompts[lo : lo + per], group, max_new, eos_id)
        return total

    def _chunk(self, prompts: list[list[int]], group: int, max_new: int, eos_id: int) -> int:
        ll = self.ll
        mem = ll.llama_get_memory(self.ctx)
        ll.llama_memory_clear(mem, True)
        samplers = [self._sampler() for _ in range(len(prompts) * group)]
        try:
            last: dict[int, int] = {}
            # Every prompt prefilled once, into the first sequence of its group, in n_batch
            # parts; each sample of a group draws its first token from the prompt's last logits
            # right after the part that computed them.
            items = [
                (g * group, t, i, i == len(p) - 1)
                for g, p in enumerate(prompts)
                for i, t in enumerate(p)
            ]
            for lo in range(0, len(items), self.n_batch):
                part = items[lo : lo + self.n_batch]
                for i in self._decode(part):
                    seq0 = part[i][0]
                    for s in range(seq0, seq0 + group):
                        last[s] = int(ll.llama_sampler_sample(samplers[s], self.ctx, i))
            for g in range(len(prompts)):
                for j in range(1, group):
                    ll.llama_memory_seq_cp(mem, g * group, g * group + j, -1, -1)
            pos = {s: len(prompts[s // group]) for s in last}
            count = dict.fromkeys(last, 1)
            active = [s for s in last if last[s] != eos_id and max_new > 1]
            while active:
                outs = self._decode([(s, last[s], pos[s], True) for s in active])
                for s, i in zip(active, outs, strict=True):
                    pos[s] += 1
                    last[s] = int(ll.llama_sampler_sample(samplers[s], self.ctx, i))
                    count[s] += 1
                active = [s for s in active if last[s] != eos_id and count[s] < max_new]
            return sum(count.values())
        finally:
            for smp in samplers:
                ll.llama_sampler_free(smp)


class LlamaRunners:
    """llama.cpp's model mapped from ``gguf`` (llama.cpp's default model parameters) and one
    :class:`LlamaBatched` context per setting; ``close`` frees them all."""

    def __init__(
        self,
        gguf: Path,
        prompts: list[list[int]],
        group: int,
        max_new: int,
        eos_id: int,
        vocab_size: int,
        threads: list[int],
        n_batches: tuple[int, ...] = (64, 512),
        all_groups_only: bool = False,
    ) -> None:
        import llama_cpp as ll

        self.ll = ll
        self.model = ll.llama_model_load_from_file(
            str(gguf).encode(), ll.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        seq_len = -(-(max(len(p) for p in prompts) + max_new) // 256) * 256
        self.contexts: dict[str, LlamaBatched] = {}
        seqs = {group * len(prompts)} if all_groups_only else {group, group * len(prompts)}
        for n_seq in sorted(seqs):
            for t in threads:
                for nb in n_batches:
                    name = f"llama.cpp batched: {n_seq} seqs/context, {t} threads, n_batch {nb}"
                    self.contexts[name] = LlamaBatched(
                        ll,
                        self.model,
                        n_seq=n_seq,
                        seq_len=seq_len,
                        threads=t,
                        n_batch=nb,
                        vocab_size=vocab_size,
                    )
        # The node's own KV settings beside llama.cpp's defaults (F16 cache, flash attention
        # where llama.cpp picks it): what the parity settings cost, apart from the node's code.
        n_all, t_node = group * len(prompts), max(threads)
        name = (
            f"llama.cpp batched, F32 KV, no flash attention: {n_all} seqs/context, {t_node} threads"
        )
        self.contexts[name] = LlamaBatched(
            ll,
            self.model,
            n_seq=n_all,
            seq_len=seq_len,
            threads=t_node,
            n_batch=512,
            vocab_size=vocab_size,
            f32_kv=True,
        )
        self.runners: dict[str, Runner] = {
            name: (lambda c=c: c.run(prompts, group, max_new, eos_id))
            for name, c in self.contexts.items()
        }

    def close(self) -> None:
        for c in self.contexts.values():
            c.close()
        self.contexts = {}
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None


# ------------------------------------------------------------------------------------------- vLLM


def vllm_runners(llm: Any, prompts: list[list[int]], group: int, max_new: int) -> dict[str, Runner]:
    """``LLM.generate`` with ``SamplingParams(n=group)`` per prompt on the engine's own ``llm``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run() -> int:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [
                SamplingParams(n=group, max_tokens=max_new, temperature=1.0, top_p=1.0, seed=i)
                for i in range(len(prompts))
            ],
            use_tqdm=False,
        )
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return {"LLM.generate(n=group)": run}


# ----------------------------------------------------------------------------------------- timing


def time_round(runners: dict[str, Runner], rates: dict[str, list[float]]) -> None:
    """Run every runner once, appending its tokens/s to ``rates[name]``."""
    import time

    for name, run in runners.items():
        t0 = time.perf_counter()
        n = run()
        rates.setdefault(name, []).append(n / (time.perf_counter() - t0))


def best(rates: dict[str, list[float]], threads: int | None = None) -> tuple[str, float]:
    """The setting with the highest best-round tokens/s, and that rate; with ``threads``, of
    the settings on that many threads only (their names say ", N thread(s)"; all settings
    where none names its threads)."""
    names = [k for k in rates if threads is None or f", {threads} thread" in k] or list(rates)
    name = max(names, key=lambda k: max(rates[k]))
    return name, max(rates[name])


def _at_threads(run: Runner, threads: int) -> Runner:
    """``run`` with torch's (process-wide) thread count set to ``threads``, then restored."""

    def wrapped() -> int:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run()
        finally:
            torch.set_num_threads(before)

    return wrapped


def offline_runners(
    name: str, engine: Any, prompts: list[list[int]], group: int, max_new: int, quick: bool
) -> tuple[dict[str, Runner], Callable[[], None]]:
    """The best-offline settings of node engine ``engine`` (torch, llamacpp or vllm, weights
    loaded) for these prompts, and what frees them. Thread counts tried: the engine's and 1;
    ``quick`` tries only every group in one call (torch) or one context (llama.cpp), n_batch 512."""
    if name == "torch":
        runners = torch_runners(engine.model, prompts, group, max_new, engine.eos_id, engine.pad_id)
        if quick:
            runners = dict(list(runners.items())[:1])
        threads = torch.get_num_threads()
        if threads != 1:
            runners.update({f"{k}, 1 thread": _at_threads(r, 1) for k, r in list(runners.items())})
        return {
            f"{k}, {threads} threads" if "thread" not in k else k: r for k, r in runners.items()
        }, lambda: None
    if name in ("llamacpp", "llamacpp_live"):
        lr = LlamaRunners(
            engine.gguf_path,
            prompts,
            group,
            max_new,
            engine.eos_id,
            engine.vocab_size,
            sorted({1, engine.threads}),
            n_batches=(512,) if quick else (64, 512),
            all_groups_only=quick,
        )
        return lr.runners, lr.close
    if name == "vllm":
        return vllm_runners(engine._llm, prompts, group, max_new), lambda: None
    raise ValueError(f"no offline runners for engine {name!r}")
