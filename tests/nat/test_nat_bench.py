"""benchmarks/nat.py's time-to-all part runs (issue 32: code no run exercises rots).

The benchmark's broadcast runs in the emulated internet were broken by a refactor of
benchmarks/broadcast.py (``NatBench`` still called methods that had moved to the relay swarm) and
nothing ran them: a smoke run here, 4 nodes, 0.5 MB, one tree run each way (about 25 s).

Needs root, iproute2 and iptables (nat table); skipped where they are missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import echo.tools.netem_nat as netem_nat

ROOT = Path(__file__).resolve().parents[2]
_OK, _WHY = netem_nat.available(prefix="ecnr")
pytestmark = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")


def test_time_to_all_runs_with_half_the_nodes_behind_nat() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "nat.py"), "--quick", "--time-only",
         "--n", "4", "--size-mb", "0.5", "--repeats", "1", "--prefix", "ecnr"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["behind_nat"] == 2
    for way in ("public", "nat"):
        (row,) = figures["runs"][way]
        assert row["bytes_ok"] and row["time_s"] > 0, row
    assert figures["time_to_all_nat_vs_public"] > 0
    # The tree relayed: public nodes forwarded the version to others.
    assert figures["relayed_bytes_public_nodes"] > 0
