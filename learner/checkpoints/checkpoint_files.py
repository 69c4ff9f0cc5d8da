"""What every learner checkpoint shares, whichever process wrote it: the folder of each version
under ``<job dir>/checkpoints``, the newest :data:`KEEP` kept, the :class:`Checkpoint` a learner
restores, and the fsyncs that make a checkpoint durable before it is visible.

The single learner's files are :mod:`echo.learner.checkpoints.checkpoint`, the FSDP2 learner's
sharded ones :mod:`echo.learner.checkpoints.dcp_checkpoint`; both build on this module.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# Checkpoints kept: the newest and the one before it (a crash while the newest is written).
KEEP = 2
# ``meta.json``'s "format" in a version the FSDP2 learner wrote
# (echo.learner.checkpoints.dcp_checkpoint).
DCP_FORMAT = "dcp"


@dataclass
class Checkpoint:
    version: int
    anchor_version: int
    model_state: dict[str, torch.Tensor]
    optim_state: dict
    report: bytes  # the signed StepReport of this version (re-sent after a restart)


def version_dir(root: Path, version: int) -> Path:
    """The folder of ``version``'s checkpoint under ``root``."""
    return root / f"v{version:08d}"


def fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_newest(root: Path) -> None:
    """Remove all but the newest :data:`KEEP` checkpoints under ``root``."""
    for old in sorted(p for p in root.iterdir() if p.name.startswith("v"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def is_dcp(version_dir: Path) -> bool:
    """Whether the checkpoint folder ``version_dir`` holds a DCP checkpoint. Here, not in
    :mod:`echo.learner.checkpoints.dcp_checkpoint`, so that the single learner tells the formats
    apart without importing ``torch.distributed.checkpoint`` (about a fifth of its start-up
    imports)."""
    try:
        return json.loads((version_dir / "meta.json").read_text()).get("format") == DCP_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
