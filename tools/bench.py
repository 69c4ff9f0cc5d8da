"""Shared scaffolding for benchmark scripts: a ``--quick`` flag, timing, and the result line.

Every benchmark prints readable lines while it runs and, as its very last line, one JSON object
(:func:`emit`) so that scripts and CI can parse the result with ``tail -n 1``. Run a benchmark as
``python benchmarks/<name>.py [--quick]``; ``--quick`` must finish in about a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    *,
    setup: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse the common flags (``--quick``) plus any that ``setup(parser)`` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes, about a minute (CI smoke run)"
    )
    if setup is not None:
        setup(parser)
    return parser.parse_args(argv)


def timed(fn: Callable[[], T], *, repeats: int = 1) -> tuple[float, T]:
    """Run ``fn`` ``repeats`` times; return (best wall seconds, last result)."""
    best = float("inf")
    result: T
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (0.0 when empty), for summarising per-iteration figures."""
    return float(statistics.median(values)) if values else 0.0


def say(*parts: object) -> None:
    """Print one readable progress line and flush (so it shows up live when piped)."""
    print(*parts, flush=True)


def emit(result: dict[str, Any]) -> None:
    """Print ``result`` as the single final JSON line. Call it last and only once."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True, default=float), flush=True)
