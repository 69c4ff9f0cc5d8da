"""One-step arithmetic word problems in GSM8K's shape: the real-learning benchmark's task data.

A JSON Lines file of ``{"id", "question", "answer"}`` rows (the fields of
``tests/data/gsm8k_mini.jsonl``, read by the ``dataset`` task and graded by math-verify),
generated from a fixed seed so every machine writes the same file: small numbers, one
operation (add, take away, multiply, share equally), a dozen everyday templates. SmolLM2-135M-
Instruct answers about a third of them right at the start, in a sentence that ends on the
number, so the task starts well above 0 and well below its ceiling, and a completion fits in
a few dozen tokens (docs/results/2026-12-06-real-learning.md has the measurements).

``ops`` may instead name bare arithmetic (:data:`BARE`: "What is 5 + 9?"), which SmolLM2 can
answer within 8 tokens; scored by the last number, single-digit sums are the recipe that learns
(docs/results/2026-12-07-real-learning.md).

    python benchmarks/word_problems.py OUT.jsonl [--rows N]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROWS = 1000
SEED = 27  # the issue that asked for it
NAMES = ["Tom", "Sara", "Ben", "Lily", "Omar", "Mia", "Ravi", "Anna", "Leo", "Zoe"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "cards", "shells"]


def _add(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 40), rng.randint(2, 30)
    q = rng.choice([
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        f"There are {a} {item} in a bag and {b} {item} on the table. How many {item} are "
        "there in all?",
        f"{name} found {a} {item} on Monday and {b} on Tuesday. How many {item} did {name} "
        "find?",
    ])  # fmt: skip
    return q, a + b


def _sub(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    b = rng.randint(2, 30)
    a = b + rng.randint(1, 30)
    q = rng.choice([
        f"{name} had {a} {item} and gave away {b}. How many {item} does {name} have left?",
        f"A shop had {a} {item}. It sold {b} of them. How many {item} are left?",
        f"{name} needs {a} {item} and already has {b}. How many more {item} does {name} need?",
    ])  # fmt: skip
    return q, a - b


def _mul(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    q = rng.choice([
        f"A box holds {a} {item}. How many {item} are in {b} boxes?",
        f"{name} buys {b} packs of {item} with {a} {item} in each pack. How many {item} is "
        "that?",
        f"There are {b} rows with {a} {item} in each row. How many {item} are there?",
    ])  # fmt: skip
    return q, a * b


def _div(rng: random.Random, name: str, item: str) -> tuple[str, int]:
    b, k = rng.randint(2, 9), rng.randint(2, 12)
    q = rng.choice([
        f"{name} shares {b * k} {item} equally among {b} friends. How many {item} does each "
        "friend get?",
        f"{b * k} {item} are packed into {b} equal bags. How many {item} are in each bag?",
        f"{name} puts {b * k} {item} into groups of {b}. How many groups are there?",
    ])  # fmt: skip
    return q, k


OPS = {"add": _add, "sub": _sub, "mul": _mul, "div": _div}


def _bare(lo: int, hi: int, sign: str):
    """A maker of bare sums or products ("What is 7 + 5?", operands lo..hi): no prose to
    explain, so a 135M model can answer with the number alone in a few tokens (the word
    problems above sample 0-6% right at temperature 1, docs/results/2026-12-07-real-learning.md)."""

    def make(rng: random.Random, _name: str, _item: str) -> tuple[str, int]:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"What is {a} {sign} {b}?", a + b if sign == "+" else a * b

    return make


# Not word problems, and not in the default file: named in ``ops`` on their own.
BARE = {"add1": _bare(1, 9, "+"), "add2": _bare(10, 99, "+"), "mul1": _bare(2, 9, "*")}
MAKERS = {**OPS, **BARE}


def rows(n: int = ROWS, seed: int = SEED, ops: list[str] | None = None) -> list[dict[str, object]]:
    """``n`` problems, the same on every machine for the same ``seed`` and ``ops`` (the makers
    of :data:`MAKERS` taken in turn; default the four word problems of :data:`OPS`, the file
    the tests read; :data:`BARE`'s bare arithmetic only when named)."""
    if n < 1:
        raise ValueError(f"need at least one row, not {n}")
    unknown = set(ops or ()) - set(MAKERS)
    if unknown or ops == []:
        raise ValueError(f"ops must name some of {sorted(MAKERS)}, not {ops}")
    rng = random.Random(seed)
    makers = [MAKERS[o] for o in (ops or OPS)]
    out = []
    for i in range(n):
        q, a = makers[i % len(makers)](rng, rng.choice(NAMES), rng.choice(ITEMS))
        out.append({"id": f"w{i:04d}", "question": q, "answer": a})
    return out


def write(path: Path, n: int = ROWS, seed: int = SEED, ops: list[str] | None = None) -> Path:
    """Write the problems to ``path`` (replaced whole); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed, ops)))
    tmp.replace(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=ROWS)
    args = ap.parse_args()
    write(args.out, args.rows)


if __name__ == "__main__":
    main()
