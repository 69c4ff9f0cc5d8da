"""``echo-node`` with its lease round trips timed, for benchmarks/attack.py.

Run as ``python -m echo.tools.timed_node join ...`` (the node CLI's arguments): the real node,
whose every ``/echo/lease`` call to the coordinator is timed and appended, as ``wall_time
seconds``, to ``$ECHO_LEASE_TIMES_DIR/<pid>.txt``. Nothing else changes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from echo.node import session
from echo.protocol import ids

_OUT = Path(os.environ.get("ECHO_LEASE_TIMES_DIR", ".")) / f"{os.getpid()}.txt"
_call = session.CoordinatorSession.call


async def _timed_call(self, proto: str, payload: bytes, **kw) -> bytes:
    t0 = time.monotonic()
    try:
        return await _call(self, proto, payload, **kw)
    finally:
        if proto == ids.PROTO_LEASE:
            with open(_OUT, "a") as f:
                f.write(f"{time.time():.3f} {time.monotonic() - t0:.6f}\n")


session.CoordinatorSession.call = _timed_call  # type: ignore[method-assign]

if __name__ == "__main__":
    from echo.node.cli import app

    app()
