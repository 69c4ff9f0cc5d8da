"""The llama.cpp engine's temp folders: named after their process, dead processes' reaped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from echo.node.engines.scratch_dirs import PREFIX, make_scratch_dir, reap_dead


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_processs_folder_is_reaped_and_nothing_else(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{dead_pid()}-abc"
    live = tmp_path / f"{PREFIX}{os.getppid()}-def"  # pytest's parent: alive
    mine = tmp_path / f"{PREFIX}{os.getpid()}-ghi"
    old = tmp_path / f"{PREFIX}x7_q2lm"  # an older version's name: no pid in it
    other = tmp_path / "echo-other-123-x"
    for d in (dead, live, mine, old, other):
        d.mkdir()
        (d / "policy.gguf").write_bytes(b"GGUF")
    assert reap_dead(tmp_path) == [dead]
    assert not dead.exists()
    assert all(d.exists() for d in (live, mine, old, other))


def test_a_new_folder_carries_its_pid_and_reaps_first(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{dead_pid()}-abc"
    dead.mkdir()
    new = make_scratch_dir(str(tmp_path))
    assert new.parent == tmp_path and new.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert new.is_dir() and not dead.exists()
