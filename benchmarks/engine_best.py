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
- vLLM: ``LLM.generate`` with ``n`` on the node engine's own ``LLM``, with and without what a
  node must ask for (``benchmarks/engine_best_vllm.py``).

CPU time counts this process and its children: vLLM computes in its engine-core process, so
its own process's CPU time alone would be the front end's only.

Every runner returns the number of tokens generated (EOS counted, as the node counts it); the
caller times it, so rounds of the node path and of each setting can be interleaved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from echo.tools.bench import say

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
    :class:`LlamaBatched` context per setting; ``close`` frees them all.

    Settings: sequences per context (every group at once; also one group unless
    ``all_groups_only``) x ``threads`` x ``n_batches``, on llama.cpp's default KV settings, and
    one more with the node's own KV settings (F32 cache, no flash attention) on every group at
    once, the most threads and n_batch 512: what the parity settings cost, apart from the node's
    code."""

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

        from echo.node.engines.llamacpp_context import pad_cells

        self.ll = ll
        self.model = ll.llama_model_load_from_file(
            str(gguf).encode(), ll.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        seq_len = pad_cells(max(len(p) for p in prompts) + max_new)
        n_all = group * len(prompts)
        seqs = {n_all} if all_groups_only else {group, n_all}
        settings = [
            (f"{n_seq} seqs/context, {t} threads, n_batch {nb}", n_seq, t, nb, False)
            for n_seq in sorted(seqs)
            for t in threads
            for nb in n_batches
        ]
        settings.append(
            (f"F32 KV, no flash attention: {n_all} seqs/context, {max(threads)} threads", n_all,
             max(threads), 512, True)
        )
        self.contexts: dict[str, LlamaBatched] = {}
        for label, n_seq, t, nb, f32_kv in settings:
            self.contexts[f"llama.cpp batched, {label}"] = LlamaBatched(
                ll,
                self.model,
                n_seq=n_seq,
                seq_len=seq_len,
                threads=t,
                n_batch=nb,
                vocab_size=vocab_size,
                f32_kv=f32_kv,
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


# ----------------------------------------------------------------------------------------- timing


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live children (vLLM's engine core)."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += t.user + t.system
    return total


def time_round(
    runners: dict[str, Runner],
    rates: dict[str, list[float]],
    cpu_rates: dict[str, list[float]] | None = None,
    before: Callable[[], None] = lambda: None,
) -> None:
    """Run every runner once, appending its tokens/s to ``rates[name]`` and its tokens per
    CPU second (:func:`cpu_seconds`) to ``cpu_rates[name]``; ``before`` runs, untimed, before
    each."""
    for name, run in runners.items():
        before()
        t0, c0 = time.perf_counter(), cpu_seconds()
        n = run()
        rates.setdefault(name, []).append(n / (time.perf_counter() - t0))
        if cpu_rates is not None:
            cpu_rates.setdefault(name, []).append(n / max(cpu_seconds() - c0, 1e-9))


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
    name: str,
    engine: Any,
    prompts: list[list[int]],
    group: int,
    max_new: int,
    quick: bool,
    requests: list[Any] | None = None,
) -> tuple[dict[str, Runner], Callable[[], None]]:
    """The best-offline settings of node engine ``engine`` (torch, llamacpp or vllm, weights
    loaded) for these prompts, and what frees them. Thread counts tried: the engine's and 1;
    ``quick`` tries only every group in one call (torch) or one context (llama.cpp), n_batch 512.
    ``requests``: the node's ``GenRequest`` for these prompts, whose seeds and temperature vLLM
    reuses (default: seeds 0, 1, ..., temperature 1)."""
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
        from engine_best_vllm import vllm_runners

        seeds = [r.params.seed for r in requests] if requests else list(range(len(prompts)))
        temperature = requests[0].params.temperature if requests else 1.0
        runners = vllm_runners(
            engine._llm, prompts, group, max_new, seeds, engine.eos_id, temperature
        )
        return runners, lambda: None
    raise ValueError(f"no offline runners for engine {name!r}")


# ------------------------------------------------------------------------ node path vs offline


def out_threads(engine: Any) -> int:
    """Threads the engine may compute with: llama.cpp's own count, else torch's (process-wide)."""
    return getattr(engine, "threads", None) or torch.get_num_threads()


def node_vs_offline(
    name: str,
    engine: Any,
    path: Any,
    prompts: list[list[int]],
    group: int,
    max_new: int,
    quick: bool,
    rounds: int,
) -> dict[str, Any]:
    """Rounds of: ``engine.generate`` called directly on ``path``'s requests, the node path
    (``path.run(engine)`` -> tokens, seconds inside generate, submissions), and every offline
    setting of :func:`offline_runners`, interleaved so that drift on a shared machine hits all
    alike. Rates are best rounds; ``group_vs_engine_rounds`` is each round's node-path rate
    over that round's best offline rate (its median is the figure least moved by load that
    comes and goes between rounds). ``group_vs_engine_cpu`` compares tokens per CPU second
    (:func:`cpu_seconds`) instead (best rounds): on one thread that is the rate the work would have
    on an idle core, so it tells the node's cost from the engine's where the machine's load moves
    wall-clock rates several-fold between runs; on more threads it also counts time spent
    spinning at barriers."""
    direct = path.requests(path.open_leases())
    engine.generate(direct[:1])  # warm-up
    # vLLM keeps prompts' KV blocks across calls; every round asks for the same prompts, which a
    # node's leases do not, so each timed vLLM call starts from an empty prefix cache.
    forget = engine._llm.reset_prefix_cache if name == "vllm" else lambda: None
    runners, free = offline_runners(name, engine, prompts, group, max_new, quick, direct)
    offline: dict[str, list[float]] = {}
    offline_cpu: dict[str, list[float]] = {}
    lost, node_rate, engine_rate, direct_rate, ratios, node_cpu = [], [], [], [], [], []
    try:
        for _ in range(rounds):
            forget()
            t0 = time.perf_counter()
            res = engine.generate(direct)
            direct_s = time.perf_counter() - t0
            direct_rate.append(sum(len(c.token_ids) for g in res for c in g) / direct_s)
            forget()
            t0, c0 = time.perf_counter(), cpu_seconds()
            n, gen_s, _ = path.run(engine)
            node_s = time.perf_counter() - t0
            node_cpu.append(n / max(cpu_seconds() - c0, 1e-9))
            node_rate.append(n / node_s)
            engine_rate.append(n / gen_s)
            lost.append(1.0 - gen_s / node_s)
            time_round(runners, offline, offline_cpu, forget)
            ratios.append(node_rate[-1] / max(v[-1] for v in offline.values()))
            say(  # per round: a shared machine's load shows in how rounds differ
                f"    round: node path {node_rate[-1]:.1f} tok/s; offline "
                + "; ".join(f"{v[-1]:.1f} ({k})" for k, v in offline.items())
                + f"; ratio {ratios[-1]:.2f}"
            )
    finally:
        free()
    best_name, best_tps = best(offline)
    same_tps = best(offline, out_threads(engine))[1]
    node_tps, direct_tps = max(node_rate), max(direct_rate)
    st = getattr(engine, "step_threads", None)
    return {
        # Within-call ratio: its median is robust to load between calls.
        "overhead": statistics.median(lost),
        "node_tokens_per_s": node_tps,
        "engine_tokens_per_s": max(engine_rate),
        "direct_tokens_per_s": direct_tps,
        "overhead_vs_direct_calls": 1.0 - node_tps / direct_tps,
        "threads": out_threads(engine),
        # What the engine's step timing settled on (1 or ``threads``), and its step times.
        "threads_chosen": st.chosen if st is not None else out_threads(engine),
        "step_seconds": dict(st.estimate) if st is not None else {},
        "best_offline_tokens_per_s": best_tps,
        "best_offline": best_name,
        "group_vs_engine": node_tps / best_tps,
        # The node's thread count against the engine's best on as many threads: on a loaded
        # machine thread count alone can move a rate 10x (spinning barriers).
        "group_vs_engine_same_threads": node_tps / same_tps,
        "group_vs_engine_rounds": ratios,
        "group_vs_engine_median": statistics.median(ratios),
        "offline": {k: max(v) for k, v in offline.items()},
        "node_tokens_per_cpu_s": max(node_cpu),
        "best_offline_tokens_per_cpu_s": max(max(v) for v in offline_cpu.values()),
        "group_vs_engine_cpu": max(node_cpu) / max(max(v) for v in offline_cpu.values()),
        "offline_cpu": {k: max(v) for k, v in offline_cpu.items()},
    }


def report(name: str, out: dict[str, Any]) -> None:
    """Print one engine's figures from :func:`node_vs_offline`."""
    for k, v in out["offline"].items():
        say(f"    offline {v:8.1f} tok/s  {out['offline_cpu'][k]:8.1f} tok/cpu-s  {k}")
    say(
        f"  {name:9s} node path {out['node_tokens_per_s']:8.1f} tok/s (engine "
        f"{out['engine_tokens_per_s']:.1f}, direct calls {out['direct_tokens_per_s']:.1f}), "
        f"overhead {out['overhead']:.2%}, threads {out['threads']} (steps on "
        f"{out['threads_chosen']}); group_vs_engine {out['group_vs_engine']:.2f} "
        f"(median of rounds {out['group_vs_engine_median']:.2f}, same threads "
        f"{out['group_vs_engine_same_threads']:.2f}; best offline "
        f"{out['best_offline_tokens_per_s']:.1f} tok/s: {out['best_offline']}); per CPU second "
        f"{out['node_tokens_per_cpu_s']:.1f} against {out['best_offline_tokens_per_cpu_s']:.1f}: "
        f"group_vs_engine_cpu {out['group_vs_engine_cpu']:.2f}"
    )


def flat_result(name: str, out: dict[str, Any], suffix: str = "") -> dict[str, Any]:
    """The JSON keys of one engine: ``group_vs_engine*_<engine>`` and the figures behind them."""
    keys = (
        "best_offline_tokens_per_s",
        "best_offline",
        "threads_chosen",
        "group_vs_engine",
        "group_vs_engine_same_threads",
        "group_vs_engine_median",
        "group_vs_engine_cpu",
    )
    return {f"{k}_{name}{suffix}": out[k] for k in keys}
