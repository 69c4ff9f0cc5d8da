"""Daemons stop cleanly on SIGINT/SIGTERM and surface single errors plainly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from echo.p2p.lifecycle import run_until_signalled


def test_signal_cancels_and_returns_true() -> None:
    finished = []

    async def daemon() -> None:
        try:
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            await trio.sleep(10)
        finally:
            finished.append("cleaned up")

    assert run_until_signalled(daemon) is True
    assert finished == ["cleaned up"]


def test_normal_return_and_single_error_unwrapped() -> None:
    async def quick() -> None:
        await trio.sleep(0)

    assert run_until_signalled(quick) is False

    async def failing() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(trio.sleep, 10)
            raise ValueError("bad setting")

    with pytest.raises(ValueError, match="bad setting"):
        run_until_signalled(failing)


def _lines_of(script: str) -> list[str]:
    """What ``script`` prints, run in a fresh interpreter (garbage-collector state is
    process-wide), from the repository root."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


FROZEN_AT_EXIT = """
import atexit, gc, trio
seen = {}
# Registered before the daemon runs, so it runs after run_until_signalled's handler (LIFO).
atexit.register(lambda: print("at exit all frozen:", gc.get_freeze_count() > seen["at_start"]))
start_up = [[i] for i in range(1000)]  # made before the daemon runs, lives as long
from echo.p2p.lifecycle import run_until_signalled

async def main():
    seen["at_start"] = gc.get_freeze_count()
    seen["serving"] = [[i] for i in range(1000)]

run_until_signalled(main)
print("start-up heap frozen:", seen["at_start"] >= len(start_up))
print("made while serving frozen:", gc.get_freeze_count() > seen["at_start"])
"""


def test_a_daemon_s_start_up_heap_is_frozen_and_it_exits_without_a_last_full_collection() -> None:
    """Full collections walked every object a daemon's imports made (some 300,000: 0.1-1.0 s
    each, the loop waiting; benchmarks/gc_pause.py), so what exists when the daemon starts is
    frozen; what it makes while serving is collected as usual. The interpreter's teardown
    walked every object too (3-6 s on a loaded 2-core machine, per process a swarm stops):
    everything is frozen as the process exits."""
    assert _lines_of(FROZEN_AT_EXIT) == [
        "start-up heap frozen: True",
        "made while serving frozen: False",
        "at exit all frozen: True",
    ]


SETTLED_TWICE = """
import gc, weakref
from echo.p2p.lifecycle import settle_heap

class Engine:
    pass

engine = Engine()
engine.me = engine  # a cycle, as models and engines have
alive = weakref.ref(engine)
settle_heap()  # the engine is built: frozen
del engine
gc.collect()
print("frozen cycle kept by a collection:", alive() is not None)
settle_heap()  # the engine was dropped
print("collected by the next settle:", alive() is None)
"""


def test_a_frozen_cycle_that_dies_is_collected_by_the_next_settle() -> None:
    """A node freezes its engine when it opens it and drops it at the job's end: a frozen
    cycle is never collected, so the engine's weights would stay until exit unless the next
    settle thaws what the last one froze."""
    assert _lines_of(SETTLED_TWICE) == [
        "frozen cycle kept by a collection: True",
        "collected by the next settle: True",
    ]
