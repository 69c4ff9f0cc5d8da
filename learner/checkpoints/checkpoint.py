"""Learner checkpoints: model, optimizer and the step report of the version they hold.

One folder per version under ``<job dir>/checkpoints`` (the newest :data:`KEEP`), written to a
temporary name and renamed, so a crash leaves the previous checkpoint intact; ``echo-job export``
reads their model weights back (:func:`load_model_state`). Only local files of our own are read
back: tensors through safetensors, optimizer state through ``torch.load(weights_only=True)``.
A version the FSDP2 learner wrote is a sharded DCP checkpoint
(:mod:`~echo.learner.checkpoints.dcp_checkpoint`); :func:`latest` and :func:`load_model_state` read
it whole, so a job may go back to one process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from echo.learner.checkpoints.checkpoint_files import (
    KEEP,
    Checkpoint,
    fsync,
    is_dcp,
    keep_newest,
    version_dir,
)


def save(root: Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` under ``root`` durably (fsynced, then renamed into place) and keep only
    the newest :data:`KEEP`. :raises OSError: the disk refused."""
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, ckpt.version)
    tmp = root / f".tmp-{ckpt.version}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(
        {k: v.contiguous() for k, v in ckpt.model_state.items()}, str(tmp / "model.safetensors")
    )
    torch.save(ckpt.optim_state, tmp / "optim.pt")
    (tmp / "report.bin").write_bytes(ckpt.report)
    (tmp / "meta.json").write_text(
        json.dumps({"version": ckpt.version, "anchor_version": ckpt.anchor_version})
    )
    # Durable before visible, and visible before the report naming this version is sent: the
    # ledger (fsynced by SQLite) must never be ahead of the newest checkpoint after a power loss.
    for name in ("model.safetensors", "optim.pt", "report.bin", "meta.json"):
        fsync(tmp / name)
    fsync(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync(root)
    keep_newest(root)


def versions(root: Path) -> list[int]:
    """The versions whose checkpoint is complete under ``root``, oldest first (only the newest
    :data:`KEEP` are kept)."""
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.name.startswith("v") and (d / "meta.json").exists():
            try:
                out.append(int(d.name[1:]))
            except ValueError:
                continue
    return sorted(out)


def load_model_state(root: Path, version: int) -> dict[str, torch.Tensor]:
    """The model weights of ``version``'s checkpoint (the learner's float32 master weights, every
    ``state_dict`` name; no optimizer state is read).

    :raises FileNotFoundError: no checkpoint of ``version`` is kept under ``root``.
    """
    path = version_dir(root, version) / "model.safetensors"
    if is_dcp(path.parent):  # written by the FSDP2 learner
        from echo.learner.checkpoints import dcp_checkpoint  # torch.distributed: only when needed

        return dcp_checkpoint.load_full(path.parent)["model"]
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint of version {version} under {root}")
    return load_file(str(path))


def latest(root: Path) -> Checkpoint | None:
    if not root.exists():
        return None
    for d in sorted((p for p in root.iterdir() if p.name.startswith("v")), reverse=True):
        try:
            if is_dcp(d):  # written by the FSDP2 learner: read with no ranks
                # torch.distributed: only when needed
                from echo.learner.checkpoints import dcp_checkpoint

                return dcp_checkpoint.load_for_single(d)
            meta = json.loads((d / "meta.json").read_text())
            return Checkpoint(
                version=int(meta["version"]),
                anchor_version=int(meta["anchor_version"]),
                model_state=load_file(str(d / "model.safetensors")),
                # On the CPU whatever device wrote it; the optimizer moves it to its params.
                optim_state=torch.load(d / "optim.pt", weights_only=True, map_location="cpu"),
                report=(d / "report.bin").read_bytes(),
            )
        except (OSError, ValueError, KeyError, RuntimeError):
            continue  # a damaged checkpoint: fall back to the one before
    return None


# Callers restore and count checkpoints through this module, whichever format wrote them.
__all__ = ["KEEP", "Checkpoint", "latest", "load_model_state", "save", "versions"]
