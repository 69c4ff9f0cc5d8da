"""What protocol 9's batch reply costs against protocol 8's, for one batch of long groups.

Protocol 8 handed the learner each group's arrays packed (int32 ids, float32 log-probs), rebuilt
at batch time from the stored rows with the prompt rendered again, and the learner unpacked them
(``decode_batch``). Protocol 9 stores each group encoded once, in the learner's form (lists),
when it is accepted; a batch reply splices the stored bytes and the learner's message decoder
yields the lists. Both sides are timed here in the same run, on the same groups: the
coordinator's batch assembly, the reply's size, and the learner's decode down to the lists the
GRPO step reads. The protocol 8 side is rebuilt from the old code as the baseline.

    python benchmarks/batch_wire.py [--quick]
"""

from __future__ import annotations

import numpy as np

from echo.protocol import codec
from echo.protocol import messages as m
from echo.tools.bench import emit, parse_args, say, timed

GROUP, TOKENS, PROMPT = 16, 4096, 300


def groups(n: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    """``n`` groups as verification leaves them: int32 ids, float32 log-probs, the prompt."""
    return [
        {
            "prompt": rng.integers(0, vocab, PROMPT).astype("<i4"),
            "ids": [rng.integers(0, vocab, TOKENS).astype("<i4") for _ in range(GROUP)],
            "lps": [-rng.random(TOKENS, dtype=np.float32) * 5 for _ in range(GROUP)],
        }
        for _ in range(n)
    ]


def v8_reply(gs: list[dict], render) -> bytes:
    """Protocol 8's batch assembly: each group rebuilt from its packed rows, prompt rendered."""
    out = []
    for i, g in enumerate(gs):
        out.append(
            {
                "rollout_id": f"r{i}",
                "node_id": "n",
                "prompt_id": i,
                "prompt_tokens": np.asarray(render(g), dtype="<i4").tobytes(),
                "version": 1,
                "engine": "torch",
                "rewards": [0.0] * GROUP,
                "completions": [
                    {"token_ids": a.tobytes(), "logprobs": b.tobytes(), "finish_reason": "length"}
                    for a, b in zip(g["ids"], g["lps"], strict=True)
                ],
            }
        )
    return codec.packb({"groups": out, "current_version": 1, "cancelled": False, "more": False})


def v8_learner(data: bytes, vocab: int) -> list:
    """Protocol 8's learner: the reply decoded, then every array unpacked and checked again."""
    obj = codec.unpackb(data, max_bytes=64 << 20)
    out = []
    for g in obj["groups"]:
        prompt = m.unpack_tokens(g["prompt_tokens"], vocab_size=vocab, max_len=1 << 16).tolist()
        ids = [
            m.unpack_tokens(c["token_ids"], vocab_size=vocab, max_len=1 << 16).tolist()
            for c in g["completions"]
        ]
        lps = [np.frombuffer(c["logprobs"], "<f4").astype(float).tolist() for c in g["completions"]]
        out.append((prompt, ids, lps))
    return out


def v9_stored(gs: list[dict]) -> list[bytes]:
    """What the coordinator stores on acceptance (once per group; not on the batch path)."""
    return [
        m.encode(
            m.TrainingGroup.model_construct(
                rollout_id=f"r{i}",
                node_id="n",
                prompt_id=i,
                prompt_tokens=g["prompt"].tolist(),
                version=1,
                engine="torch",
                rewards=[0.0] * GROUP,
                completions=[
                    m.TrainingCompletion.model_construct(
                        token_ids=a.tolist(), logprobs=b.tolist(), finish_reason="length"
                    )
                    for a, b in zip(g["ids"], g["lps"], strict=True)
                ],
            )
        )
        for i, g in enumerate(gs)
    ]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n, repeats = (2, 2) if args.quick else (8, 3)
    rng = np.random.default_rng(0)
    result: dict[str, float] = {"groups": n, "group_size": GROUP, "tokens": TOKENS}
    for name, vocab in (("tiny", 259), ("qwen", 151_936)):
        gs = groups(n, vocab, rng)
        # Rendering stands in as a copy of the prompt: the real one tokenizes text, slower still.
        old_build_s, old = timed(
            lambda gs=gs: v8_reply(gs, lambda g: g["prompt"].tolist()), repeats=repeats
        )
        stored = v9_stored(gs)
        new_build_s, new = timed(lambda s=stored: m.encode_batch_reply(s, 1), repeats=repeats)
        old_learn_s, _ = timed(lambda d=old, v=vocab: v8_learner(d, v), repeats=repeats)
        new_learn_s, _ = timed(
            lambda d=new: m.decode(m.BatchReply, d, max_bytes=64 << 20), repeats=repeats
        )
        say(
            f"{name} (vocab {vocab}), {n} groups of {GROUP}x{TOKENS}: reply "
            f"{len(old) / 2**20:.1f} -> {len(new) / 2**20:.1f} MiB "
            f"({len(new) / len(old):.2f}x); coordinator batch {old_build_s * 1e3:.0f} -> "
            f"{new_build_s * 1e3:.1f} ms; learner decode {old_learn_s * 1e3:.0f} -> "
            f"{new_learn_s * 1e3:.0f} ms ({new_learn_s / old_learn_s:.2f}x)"
        )
        result.update(
            {
                f"{name}_reply_bytes_ratio": len(new) / len(old),
                f"{name}_coordinator_batch_ratio": new_build_s / old_build_s,
                f"{name}_learner_decode_ratio": new_learn_s / old_learn_s,
                f"{name}_learner_decode_v9_s": new_learn_s,
            }
        )
    emit(result)


if __name__ == "__main__":
    main()
