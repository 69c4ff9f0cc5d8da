"""Writing an export into a folder all at once: a crash or error leaves it complete or absent.

Every export (full weights, merged LoRA, the adapter alone) writes into a hidden folder beside
its target and renames it into place only once the last file is written and checked.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A new empty folder beside ``out`` to write an export in, renamed to ``out`` when the block
    completes and removed when it raises: ``out`` holds a complete export or nothing."""
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed run's leftover of the same pid
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["staged_folder"]
