"""The real ``echo-node`` with its lease and submit round trips timed (benchmarks/attack.py), and
the readers of what it wrote.

Run as ``python -m echo.tools.timed_node join ...`` (the node CLI's arguments): the real node,
whose every lease and submit call to the coordinator is timed around the coordinator's reply
and appended, one line ``wall_time seconds rpc`` each, to ``$ECHO_RPC_TIMES_DIR/<pid>.txt``.
The node's own pacing before a call is not counted (the wait is the node's choice, not the
coordinator's latency); a submit's round trip includes its verification and scoring. Each lease
reply also appends ``wall_time granted why`` to ``<pid>.grants``: how many leases it granted,
and when none, the first word of its message. Nothing else changes.

:func:`rpc_times` and :func:`grants` read those files back by time window. This module owns
their format; importing it changes nothing (only running it patches the node).
"""

from __future__ import annotations

import os
import sys
import time
from contextvars import ContextVar
from pathlib import Path

from echo.protocol import ids

RPC_TIMES_ENV = "ECHO_RPC_TIMES_DIR"
TIMED_RPCS = {ids.PROTO_LEASE: "lease", ids.PROTO_SUBMIT: "submit"}


def run(argv: list[str]) -> None:
    """The real ``echo-node`` CLI on ``argv``, with its lease and submit calls timed."""
    from echo.node import pacing, session
    from echo.node.cli import app

    out = Path(os.environ.get(RPC_TIMES_ENV, ".")) / f"{os.getpid()}.txt"
    # When the node's own pacer let the call go: the wait before it is the node's choice, not
    # the coordinator's latency. Set in the calling task's context (the pacer runs in it).
    ready: ContextVar[float] = ContextVar("ready", default=0.0)
    real_wait, real_call = pacing.Pacer.wait, session.CoordinatorSession.call

    async def wait(self, rpc: str) -> float:
        waited = await real_wait(self, rpc)
        ready.set(time.monotonic())
        return waited

    async def call(self, proto: str, payload: bytes, **kw) -> bytes:
        t0 = time.monotonic()
        try:
            reply = await real_call(self, proto, payload, **kw)
            if proto == ids.PROTO_LEASE:  # what was granted, and why nothing when nothing
                from echo.protocol import messages as m

                got = m.decode(m.LeaseReply, reply)
                why = got.message.split(" ")[0] or "-"
                with open(out.with_suffix(".grants"), "a") as f:
                    f.write(f"{time.time():.3f} {len(got.leases)} {why}\n")
            return reply
        finally:
            if proto in TIMED_RPCS:
                dt = time.monotonic() - max(t0, ready.get())
                with open(out, "a") as f:
                    f.write(f"{time.time():.3f} {dt:.6f} {TIMED_RPCS[proto]}\n")

    pacing.Pacer.wait = wait  # type: ignore[method-assign]
    session.CoordinatorSession.call = call  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *argv]
    app()


def rpc_times(folder: Path, rpc: str, windows: list[tuple[float, float]]) -> list[float]:
    """The timed nodes' ``rpc`` round trips (seconds) that ended inside any of ``windows``."""
    out = []
    for f in folder.glob("*.txt"):
        for line in f.read_text().splitlines():
            at, dt, kind = line.split()
            if kind == rpc and any(a <= float(at) <= b for a, b in windows):
                out.append(float(dt))
    return out


def grants(folder: Path, window: tuple[float, float]) -> tuple[int, dict[str, int]]:
    """Leases the timed nodes were granted in ``window``, and the replies that granted none, by
    the first word of their message ("update", "buffer", ...)."""
    total, empty = 0, {}
    for f in folder.glob("*.grants"):
        for line in f.read_text().splitlines():
            at, n, why = line.split()
            if window[0] <= float(at) <= window[1]:
                total += int(n)
                if not int(n):
                    empty[why] = empty.get(why, 0) + 1
    return total, empty


if __name__ == "__main__":
    run(sys.argv[1:])
