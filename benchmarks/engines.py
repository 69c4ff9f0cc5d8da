"""Benchmark the rollout engines: node-path overhead and time to apply a new version.

(a) Rollout tokens/s of every engine present (torch; llamacpp and vllm when importable) through
    the node path, against the same engine called directly on the same prompts in the same run.
    Node path: signed lease envelopes in (``open_record``: envelope + schema decode), prompts
    encoded, one ``generate`` for all leases, then per lease a ``Submission`` with packed tokens
    and log-probs, sealed (``echo.protocol.signing.seal_record``) and zstd-compressed: the bytes
    a node sends.
    ``overhead_<engine>`` = 1 - node tokens/s / engine tokens/s: the fraction of the engine's own
    throughput the node path loses, the median over rounds of 1 - (time inside generate) / (time
    of the whole node-path call), so noise between calls on a shared machine cannot distort it.
    Direct calls on the same prompts, interleaved with the node-path calls, are reported beside
    it (``direct_tokens_per_s_<engine>``, ``overhead_vs_direct_calls_<engine>``, best rounds) as a
    cross-check. Rates (``tokens_per_s_<engine>``) are the best round's.
    ``group_vs_engine_<engine>``: node-path tokens/s over the engine's best offline group
    generation for the same prompts, group size and lengths (``benchmarks/engine_best.py``:
    transformers ``generate`` with ``num_return_sequences``, llama.cpp's batched decoding with its
    own sampler, vLLM ``LLM.generate`` with ``n``), timed in the same rounds.
(b) Time to apply a version vs model size (tiny hidden 64 up to a few tens of MB): one AdamW step
    at an RL-sized learning rate published in bfloat16 (and float32), the lossless patch decoded
    (``apply_patch``), then each engine's ``load_state`` of the new state (llama.cpp: diff +
    in-place GGUF write + reload; ``llamacpp_live``: the same without the reload), next to the
    first load (llama.cpp: full GGUF write + load).

Run: ``python benchmarks/engines.py [--quick] [--threads N] [--engines a,b]``. The last line
printed is one JSON object. vLLM runs from ``.venv-vllm`` (``scripts/vllm_env.sh``; there with
``--engines vllm``: its transformers is too old for the torch engine), in (a) on the tiny model
with 2 heads of 32.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from engine_best import flat_result, node_vs_offline, report

from echo.models.spec import ModelSpec, build_model, encode_prompt
from echo.models.weights import export_state, to_bits
from echo.node.engines.base import Engine, GenRequest
from echo.node.engines.factory import make_engine
from echo.node.worker import lease_prompt, lease_request, lease_submission
from echo.protocol import codec, signing
from echo.protocol import messages as m
from echo.protocol.patch import apply_patch, encode_patch
from echo.tasks.registry import make_task
from echo.tools.bench import emit, parse_args, say

# The first AdamW step moves every weight by about lr; 1e-6 is an RL-sized learning rate.
LR = 1e-6


def available_engines() -> list[str]:
    names = ["torch"]
    if importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("gguf"):
        names.append("llamacpp")
    if importlib.util.find_spec("vllm"):
        names.append("vllm")
    return names


def build_engine(name: str, spec: ModelSpec, threads: int | None) -> Engine | None:
    """The engine ``name`` (``llamacpp_live``: llama.cpp with ``live_patch``), or None with a
    line saying why when this build cannot make it."""
    try:
        if name == "llamacpp_live":
            from echo.node.engines.llamacpp_engine import LlamaCppEngine

            # Same storage dtype as make_engine's default, so only the reload differs.
            return LlamaCppEngine(spec, threads=threads, dtype="float32", live_patch=True)
        return make_engine(name, spec, threads=threads)
    except (ValueError, RuntimeError, ImportError) as exc:  # e.g. vllm not wired in this build
        say(f"  {name}: not available ({exc})")
        return None


def close(engine: Engine) -> None:
    if hasattr(engine, "close"):
        engine.close()


# ---------------------------------------------------------------------------------- (a) node path


class NodePath:
    """The node's per-lease work around ``generate`` (see ``echo.node.worker.Node._work``)."""

    def __init__(self, spec: ModelSpec, n_leases: int, group: int, max_new: int) -> None:
        self.spec = spec
        self.task = make_task("addition", {"max_operand": 99})
        self.coord_key = Ed25519PrivateKey.generate()
        self.coord_pub = signing.public_key_bytes(self.coord_key)
        self.node_key = Ed25519PrivateKey.generate()
        now = time.time()
        sampling = [
            m.SamplingSpec(max_new_tokens=max_new, temperature=1.0, top_p=1.0, seed=17 + i)
            for i in range(n_leases)
        ]
        self.leases = [
            signing.seal_record(
                self.coord_key,
                m.Lease(
                    lease_id=f"lease{i:04d}",
                    job_id="job1",
                    node_id="node1",
                    prompt_id=1000 + i,
                    prompt_tokens=m.pack_tokens(
                        encode_prompt(spec, self.task.prompt(1000 + i))),
                    group_size=group,
                    sampling=sampling[i],
                    min_version=0,
                    issued_at=now,
                    deadline=now + 3600,
                ),
            )
            for i in range(n_leases)
        ]

    def requests(self, leases: list[m.Lease]) -> list[GenRequest]:
        return [
            lease_request(lease, lease_prompt(lease, self.spec.vocab)) for lease in leases
        ]

    def open_leases(self) -> list[m.Lease]:
        return [
            signing.open_record(b, m.Lease, expected_signer=self.coord_pub)[1]
            for b in self.leases
        ]

    def run(self, engine: Engine) -> tuple[int, float, list[bytes]]:
        """Leases in -> generate -> sealed, compressed submissions out.

        Returns (tokens, seconds inside ``generate``, the submissions)."""
        leases = self.open_leases()
        reqs = self.requests(leases)
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        gen_s = time.perf_counter() - t0
        out = []
        tokens = 0
        for lease, group in zip(leases, results, strict=True):
            tokens += sum(len(c.token_ids) for c in group)
            sub = lease_submission(
                lease,
                group,
                version=1,
                engine=engine.name,
                state_digest="0" * 64,
                gen_seconds=gen_s / len(leases),
            )
            out.append(codec.compress(signing.seal_record(self.node_key, sub)))
        return tokens, gen_s, out


def node_path_spec(name: str) -> ModelSpec:
    """The tiny model; vLLM gets 2 heads of 32 (its CPU attention has no head size 16)."""
    return ModelSpec(heads=2) if name == "vllm" else ModelSpec()


def bench_node_path(names: list[str], quick: bool, threads: int | None) -> dict[str, Any]:
    n_leases, group, max_new = (4, 16, 32) if quick else (8, 16, 48)
    rounds = 3 if quick else 6
    say(
        f"(a) node path vs direct: tiny model, {n_leases} leases x {group} samples x "
        f"<= {max_new} tokens, {rounds} rounds each, threads: {threads or 'engine default'}"
    )
    out: dict[str, Any] = {}
    for name in names:
        spec = node_path_spec(name)
        state = export_state(build_model(spec))
        path = NodePath(spec, n_leases, group, max_new)
        direct_reqs = path.requests(path.open_leases())
        engine = build_engine(name, spec, threads)
        if engine is None:
            continue
        try:
            engine.load_state(state)
            prompts = [r.prompt_ids for r in direct_reqs]
            r = node_vs_offline(name, engine, path, prompts, group, max_new, quick, rounds)
            report(name, r)
            out[name] = r
        finally:
            close(engine)
    return out


# ---------------------------------------------------------------------------------- (b) versions


def bench_apply(names: list[str], quick: bool, threads: int | None) -> list[dict[str, Any]]:
    sizes = [
        ModelSpec(),
        ModelSpec(hidden=256, layers=4, heads=4),
        ModelSpec(hidden=384, layers=6, heads=6),
    ]
    if not quick:
        sizes.append(ModelSpec(hidden=512, layers=8, heads=8))
    dtypes = ["bfloat16"] if quick else ["bfloat16", "float32"]
    if "llamacpp" in names:
        names = [*names, "llamacpp_live"]
    say(f"(b) time to apply one version (AdamW step, lr {LR:g}) vs model size")
    rows = []
    for spec in sizes:
        model = build_model(spec).train()
        for dtype in dtypes:
            old = export_state(model, dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            data = torch.randint(3, spec.vocab, (8, 32))
            loss = model(input_ids=data, labels=data).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            new = export_state(model, dtype)
            old_bits, new_bits = to_bits(old), to_bits(new)
            patch = encode_patch(old_bits, new_bits)
            full = sum(a.nbytes for a in old_bits.values())
            t0 = time.perf_counter()
            apply_patch(old_bits, patch, max_output_bytes=full)
            t_patch = time.perf_counter() - t0
            changed = sum(int((old_bits[k] != new_bits[k]).sum()) for k in old_bits)
            total = sum(a.size for a in old_bits.values())
            row: dict[str, Any] = {
                "hidden": spec.hidden,
                "layers": spec.layers,
                "dtype": dtype,
                "params": total,
                "state_MB": full / 1e6,
                "patch_bytes": len(patch),
                "changed_fraction": changed / total,
                "apply_patch_s": t_patch,
            }
            for name in names:
                engine = build_engine(name, spec, threads)
                if engine is None:
                    continue
                try:
                    t0 = time.perf_counter()
                    engine.load_state(old)
                    row[f"{name}_first_load_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    engine.load_state(new)
                    row[f"{name}_load_version_s"] = time.perf_counter() - t0
                    last = getattr(engine, "last_load", None)
                    if last is not None:
                        row[f"{name}_live"] = last.live
                        row[f"{name}_bytes_written"] = last.bytes_written
                        row[f"{name}_write_s"] = last.write_seconds
                        row[f"{name}_reload_s"] = last.load_seconds
                finally:
                    close(engine)
            rows.append(row)
            extra = "  ".join(
                f"{n} {row[f'{n}_load_version_s'] * 1e3:.1f} ms"
                + (
                    f" (write {row[f'{n}_write_s'] * 1e3:.1f} + reload "
                    f"{row[f'{n}_reload_s'] * 1e3:.1f})"
                    if f"{n}_write_s" in row
                    else ""
                )
                + f" first {row[f'{n}_first_load_s'] * 1e3:.1f} ms"
                for n in names
                if f"{n}_load_version_s" in row
            )
            say(
                f"  h{spec.hidden:<4d} L{spec.layers} {dtype:8s} {total / 1e6:6.2f}M params "
                f"{full / 1e6:5.1f} MB  changed {changed / total:6.2%}  patch "
                f"{len(patch):>9,} B  apply_patch {t_patch * 1e3:6.1f} ms  load_state: {extra}"
            )
        model.eval()
    return rows


def add_args(p) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every engine (default: each engine's own choice)",
    )
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated engines to run, of those present (default: all; e.g. 'vllm' in "
        ".venv-vllm, whose transformers is too old for the torch engine)",
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], setup=add_args)
    names = available_engines()
    if args.engines:
        wanted = args.engines.split(",")
        names = [n for n in names if n in wanted]
    say(f"engines present: {', '.join(names)}")
    node = bench_node_path(names, args.quick, args.threads)
    apply_rows = bench_apply(names, args.quick, args.threads)
    result: dict[str, Any] = {f"overhead_{n}": r["overhead"] for n, r in node.items()}
    for n, r in node.items():
        result[f"tokens_per_s_{n}"] = r["engine_tokens_per_s"]
        result[f"node_tokens_per_s_{n}"] = r["node_tokens_per_s"]
        result[f"direct_tokens_per_s_{n}"] = r["direct_tokens_per_s"]
        result[f"overhead_vs_direct_calls_{n}"] = r["overhead_vs_direct_calls"]
        result[f"threads_{n}"] = r["threads"]
        result.update(flat_result(n, r))
    result["apply"] = apply_rows
    result["threads"] = args.threads
    result["quick"] = bool(args.quick)
    emit(result)


if __name__ == "__main__":
    main()
