"""Benchmark the lossless sparse weight patch codec (``echo.protocol.patch``).

(a) Real learner steps: a tiny Llama trained with AdamW on random tokens at RL-like learning
    rates; fp32 master weights, bf16 published copies; every consecutive pair is encoded.
(b) A synthetic bf16 update stream (500M parameters; fewer with ``--quick``) at 99% and 99.9%
    unchanged: uniform random positions, changed values nudged by 1-2 ulp.

Every patch is applied and checked bit for bit. Each is compared with the full bf16 state and
with a plain baseline, ``zstd(int32 positions + new uint16 values)`` at the same zstd level,
measured in the same run (a ratio above 1 means the patch is smaller).

Run: ``python benchmarks/patch.py [--quick]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch
import zstandard

from echo.protocol.patch import apply_patch, apply_patch_inplace, encode_patch, patch_stats
from echo.tools.bench import emit, median, parse_args, say, timed

LEVEL = 3  # the codec's default zstd level; the baseline uses the same one
# Encode and apply are timed best-of-N: the first call in a process pays page faults for fresh
# output memory, which a long-running node does not pay on every version.
REPEATS = 2


def int32_baseline(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> int:
    """Bytes of zstd(int32 positions of every tensor, then the new bits at those positions)."""
    pos, vals = [], []
    for name, o in old.items():
        p = np.flatnonzero(o != new[name])
        pos.append(p.astype("<i4"))
        vals.append(new[name][p])
    raw = np.concatenate(pos).tobytes() + np.concatenate(vals).tobytes()
    return len(zstandard.ZstdCompressor(level=LEVEL).compress(raw))


def state_bytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in state.values())


def measure_pair(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> dict:
    """Encode, apply, verify and compare one version pair."""
    full = state_bytes(old)
    t_enc, patch = timed(lambda: encode_patch(old, new, level=LEVEL), repeats=REPEATS)
    t_app, out = timed(lambda: apply_patch(old, patch, max_output_bytes=full), repeats=REPEATS)
    for name, a in new.items():
        if not np.array_equal(out[name], a):
            raise AssertionError(f"patch did not reproduce {name!r}")
    del out
    t_inplace = float("inf")
    for _ in range(REPEATS):
        live = {k: a.copy() for k, a in old.items()}
        t, _ = timed(lambda live=live: apply_patch_inplace(live, patch, max_output_bytes=full))
        t_inplace = min(t_inplace, t)
    for name, a in new.items():
        if not np.array_equal(live[name], a):
            raise AssertionError(f"in-place patch did not reproduce {name!r}")
    del live
    stats = patch_stats(patch)
    base = int32_baseline(old, new)
    return {
        "bytes": len(patch),
        "changed_fraction": stats["changed_fraction"],
        "bits_per_change": 8 * len(patch) / max(1, stats["changed"]),
        "ratio_vs_full_bf16": full / len(patch),
        "ratio_vs_int32_baseline": base / len(patch),
        "baseline_bytes": base,
        "encode_MBps": full / 1e6 / t_enc,
        "apply_MBps": full / 1e6 / t_app,
        "apply_inplace_MBps": full / 1e6 / t_inplace,
        "positions": stats["positions"],
        "values": stats["values"],
    }


def summarise(rows: list[dict]) -> dict:
    keys = ("bytes", "changed_fraction", "bits_per_change", "ratio_vs_full_bf16")
    out = {k: median([r[k] for r in rows]) for k in keys}
    out["bytes_per_version"] = out.pop("bytes")
    out["ratio_vs_int32_baseline"] = median([r["ratio_vs_int32_baseline"] for r in rows])
    out["encode_MBps"] = median([r["encode_MBps"] for r in rows])
    out["apply_MBps"] = median([r["apply_MBps"] for r in rows])
    out["apply_inplace_MBps"] = median([r["apply_inplace_MBps"] for r in rows])
    out["versions"] = len(rows)
    return out


# ------------------------------------------------------------------------- (a) real learner steps


def bf16_bits(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The bf16 published copy of the fp32 master weights, as flat uint16 bit views."""
    return {
        k: v.detach().to(torch.bfloat16).reshape(-1).view(torch.int16).numpy().view(np.uint16)
        for k, v in model.state_dict().items()
    }


def real_steps(lr: float, steps: int, hidden: int, layers: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rows = []
    prev = bf16_bits(model)
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (8, 64))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        cur = bf16_bits(model)
        r = measure_pair(prev, cur)
        rows.append(r)
        say(
            f"  real lr={lr:g} step {step + 1}: {r['bytes']} B, changed "
            f"{r['changed_fraction']:.4%}, x{r['ratio_vs_full_bf16']:.1f} vs bf16, "
            f"x{r['ratio_vs_int32_baseline']:.2f} vs int32 baseline, {r['positions']}"
        )
        prev = cur
    out = summarise(rows)
    out["params"] = params
    out["bytes_per_step"] = [r["bytes"] for r in rows]
    out["changed_fraction_per_step"] = [round(r["changed_fraction"], 6) for r in rows]
    return out


# ------------------------------------------------------------------ (b) synthetic update stream


def synthetic_layout(target: int, hidden: int = 1024) -> list[tuple[str, int]]:
    """Llama-like tensor sizes adding up to at least ``target`` parameters."""
    layout = [("embed", 32000 * hidden)]
    i = 0
    while sum(n for _, n in layout) < target:
        for name, n in (
            ("q", hidden * hidden),
            ("k", hidden * hidden // 4),
            ("v", hidden * hidden // 4),
            ("o", hidden * hidden),
            ("gate", hidden * 4 * hidden),
            ("up", hidden * 4 * hidden),
            ("down", hidden * 4 * hidden),
            ("norm1", hidden),
            ("norm2", hidden),
        ):
            layout.append((f"layers.{i}.{name}", n))
        i += 1
    return layout


def nudge(rng: np.random.Generator, flat: np.ndarray, unchanged: float) -> np.ndarray:
    """A new version of ``flat``: a (1 - unchanged) fraction nudged by +-1 or +-2 ulp."""
    n = flat.size
    gaps = rng.geometric(1 - unchanged, int(n * (1 - unchanged) * 1.1) + 64)
    pos = np.cumsum(gaps) - 1
    pos = pos[pos < n]
    steps = rng.choice(np.array([-2, -1, 1, 2], np.int32), pos.size, p=[0.1, 0.4, 0.4, 0.1])
    mag = np.clip((flat[pos] & 0x7FFF).astype(np.int32) + steps, 1, 0x7F7F)
    out = flat.copy()
    out[pos] = (flat[pos] & 0x8000) | mag.astype(np.uint16)
    return out


def synthetic(params: int, versions: int) -> dict[str, dict]:
    layout = synthetic_layout(params)
    total = sum(n for _, n in layout)
    gen = torch.Generator().manual_seed(0)
    flat = (torch.randn(total, generator=gen) * 0.02).to(torch.bfloat16)
    flat = flat.view(torch.int16).numpy().view(np.uint16)
    bounds = np.cumsum([0] + [n for _, n in layout])
    flat[bounds[-3] : bounds[-1]] = 0x3F80  # norm weights start at 1.0

    def views(a: np.ndarray) -> dict[str, np.ndarray]:
        return {name: a[bounds[i] : bounds[i + 1]] for i, (name, _) in enumerate(layout)}

    rng = np.random.default_rng(0)
    results = {}
    for unchanged in (0.99, 0.999):
        rows = []
        cur = flat
        for v in range(versions):
            nxt = nudge(rng, cur, unchanged)
            r = measure_pair(views(cur), views(nxt))
            rows.append(r)
            say(
                f"  synthetic {total / 1e6:.0f}M params, {unchanged:.1%} unchanged, version "
                f"{v + 1}: {r['bytes'] / 1e6:.2f} MB, x{r['ratio_vs_full_bf16']:.1f} vs bf16, "
                f"x{r['ratio_vs_int32_baseline']:.2f} vs int32 baseline, "
                f"{r['bits_per_change']:.2f} bits/change, encode {r['encode_MBps']:.0f} MB/s, "
                f"apply {r['apply_MBps']:.0f} MB/s (in place {r['apply_inplace_MBps']:.0f} MB/s)"
            )
            cur = nxt
        results[f"{unchanged:.3f}".rstrip("0")] = summarise(rows) | {"params": total}
    return results


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    quick = args.quick
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    say(f"patch benchmark ({'quick' if quick else 'full'}), zstd level {LEVEL}")
    say("(a) real learner steps, tiny Llama, AdamW, bf16 copies of fp32 master weights")
    real = {
        f"lr_{lr:g}": real_steps(lr, steps=4 if quick else 10, hidden=128, layers=4)
        for lr in (1e-6, 1e-5)
    }
    say("(b) synthetic bf16 update stream")
    syn = synthetic(50_000_000 if quick else 500_000_000, versions=2 if quick else 3)
    s99, s999 = syn["0.99"], syn["0.999"]
    millions = s99["params"] / 1e6
    note = (
        f"quick mode: synthetic stream has {millions:.0f}M parameters, not 500M"
        if quick
        else f"synthetic stream has {millions:.0f}M parameters"
    )
    say(note)
    say(
        f"summary: 99% unchanged x{s99['ratio_vs_full_bf16']:.1f} vs bf16, "
        f"x{s99['ratio_vs_int32_baseline']:.2f} vs int32 baseline; 99.9% unchanged "
        f"x{s999['ratio_vs_full_bf16']:.1f} / x{s999['ratio_vs_int32_baseline']:.2f}; encode "
        f"{s99['encode_MBps']:.0f} MB/s, apply {s99['apply_MBps']:.0f} MB/s"
    )
    emit(
        {
            "benchmark": "patch",
            "quick": quick,
            "note": note,
            "zstd_level": LEVEL,
            "synthetic_params": s99["params"],
            "ratio_vs_full_bf16": s99["ratio_vs_full_bf16"],
            "ratio_vs_int32_baseline": s99["ratio_vs_int32_baseline"],
            "bytes_per_version": s99["bytes_per_version"],
            "encode_MBps": s99["encode_MBps"],
            "apply_MBps": s99["apply_MBps"],
            "apply_inplace_MBps": s99["apply_inplace_MBps"],
            "ratio_vs_full_bf16_99_9": s999["ratio_vs_full_bf16"],
            "ratio_vs_int32_baseline_99_9": s999["ratio_vs_int32_baseline"],
            "bytes_per_version_99_9": s999["bytes_per_version"],
            "encode_MBps_99_9": s999["encode_MBps"],
            "apply_MBps_99_9": s999["apply_MBps"],
            "apply_inplace_MBps_99_9": s999["apply_inplace_MBps"],
            "synthetic": syn,
            "real": real,
        }
    )


if __name__ == "__main__":
    main()
