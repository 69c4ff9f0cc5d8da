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
