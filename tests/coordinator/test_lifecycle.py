"""Daemons stop cleanly on SIGINT/SIGTERM and surface single errors plainly."""

from __future__ import annotations

import os
import signal

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


FROZEN_AT_EXIT = """
import atexit, gc, trio
# Registered before the daemon runs, so it runs after run_until_signalled's handler (LIFO).
atexit.register(lambda: print("at exit frozen:", gc.get_freeze_count() > 0))
from echo.p2p.lifecycle import run_until_signalled
run_until_signalled(trio.lowlevel.checkpoint)
print("after the daemon frozen:", gc.get_freeze_count() > 0)
"""


def test_a_daemon_exits_without_a_last_full_garbage_collection() -> None:
    """The interpreter's teardown walked every object a daemon with torch and libp2p made
    (3-6 s on a loaded 2-core machine, per process a swarm stops): the objects are frozen
    first, as the process exits and not before (the daemon's own collections go on)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "-c", FROZEN_AT_EXIT],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["after the daemon frozen: False", "at exit frozen: True"]
