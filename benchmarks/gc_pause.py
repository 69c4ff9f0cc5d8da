"""How long one full garbage collection holds a daemon's loop, with and without its startup
heap frozen (:func:`echo.p2p.lifecycle.settle_heap`).

Every daemon (coordinator, learner, node) imports torch, transformers and libp2p; the objects
those imports leave live as long as the process, and a full (generation 2) collection walked
all of them while the trio loop waited: 0.1-0.7 s in the coordinator of ``benchmarks/attack.py``,
up to 1.0 s in its learner and nodes, each one an honest RPC's tail. This imports what the three
daemons import, in this process, then times ``gc.collect()`` (each a full collection) before
and after ``settle_heap``, in the same run, with the same garbage made before each (a churn of
small cycles, as connections leave) and as many objects made since start-up alive.
``--quick``: fewer repetitions.

JSON: ``full_gc_ms_before``, ``full_gc_ms_after`` (medians), ``after_vs_before``,
``tracked_objects``, ``frozen_objects``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

# Cycles made before each collection: ~what a few hundred closed connections leave.
GARBAGE_CYCLES = 20_000
# Objects made after start-up and alive at each collection (connections, leases, caches): a
# frozen heap still walks these.
LIVE_OBJECTS = 50_000


def _garbage() -> None:
    for _ in range(GARBAGE_CYCLES):
        a: dict = {}
        a["self"] = a


def _full_gc_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _garbage()
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a few seconds)")
    args = p.parse_args()
    repeats = 5 if args.quick else 15
    import echo.coordinator.cli  # noqa: F401  (what the daemons import)
    import echo.learner.cli  # noqa: F401
    import echo.node.cli  # noqa: F401
    from echo.p2p.lifecycle import settle_heap

    gc.collect()
    tracked = len(gc.get_objects())
    live = [[i] for i in range(LIVE_OBJECTS)]
    before = _full_gc_ms(repeats)
    del live
    settle_heap()
    frozen = gc.get_freeze_count()
    live = [[i] for i in range(LIVE_OBJECTS)]  # made since: walked by every full collection
    after = _full_gc_ms(repeats)
    del live
    print(f"{tracked} tracked objects after the daemons' imports; {frozen} frozen by settle_heap")
    print(
        f"one full collection: {before:.1f} ms before, {after:.1f} ms after "
        f"({after / before:.3f} of before)"
    )
    print(json.dumps({
        "benchmark": "gc_pause",
        "full_gc_ms_before": round(before, 2),
        "full_gc_ms_after": round(after, 2),
        "after_vs_before": round(after / before, 4),
        "tracked_objects": tracked,
        "frozen_objects": frozen,
        "quick": args.quick,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
