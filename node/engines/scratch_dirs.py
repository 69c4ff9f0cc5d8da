"""The llama.cpp engine's private GGUF folders in the temp dir, and the ones dead nodes left.

An engine without a ``workdir`` writes its GGUF (515 MB for SmolLM2-135M in float32) into a
folder of its own under the temp dir and removes it on close. A node killed by a signal never
closes: each such kill used to leave its folder behind, and on 2026-12-07 fourteen of them
filled a test machine's disk. :func:`make_scratch_dir` names each folder after its process and,
before making a new one, removes the folders of processes that no longer exist.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "echo-llamacpp-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def reap_dead(root: Path) -> list[Path]:
    """Remove ``root``'s ``PREFIX<pid>-*`` folders whose process is gone; returns them. A folder
    without a pid in its name (an older version's) is left alone, as is a live process's."""
    reaped = []
    for path in root.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        reaped.append(path)
    return reaped


def make_scratch_dir(root: str | None = None) -> Path:
    """A new private folder ``PREFIX<pid>-<random>`` under ``root`` (the temp dir by default),
    after removing the folders dead processes left there."""
    base = Path(root or tempfile.gettempdir())
    reap_dead(base)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
