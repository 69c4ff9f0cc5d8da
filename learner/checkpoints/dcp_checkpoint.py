"""The FSDP2 learner's checkpoints: sharded, through ``torch.distributed.checkpoint`` (DCP).

A version's folder under ``<job dir>/checkpoints`` is laid out as the single learner's
(:mod:`~echo.learner.checkpoints.checkpoint`: ``v00000012/`` with ``report.bin`` and ``meta.json``),
but its weights and optimizer state are a DCP checkpoint in ``dcp/``: the ``{"model", "optim"}``
state dicts of :func:`~torch.distributed.checkpoint.state_dict.get_state_dict`, one file per rank
and a ``.metadata`` that maps every tensor's shards. DCP reshards on load, so the learner restarts
with any number of ranks (and the single learner, or ``echo-job export``, reads it with none).

The rules of the single learner's checkpoints hold: every rank writes its shard into a temporary
folder (DCP fsyncs each file), then rank 0 alone -- the only rank that reports -- writes the
report and the metadata, fsyncs them, and renames the folder into place; the report naming the
version is sent only after that. ``meta.json`` carries ``"format": "dcp"``.

DCP's ``.metadata`` is a pickle: like the single learner's ``optim.pt``, only checkpoints this
learner wrote into its own job folder are ever read, never anything a peer sent.
"""

from __future__ import annotations

import json
import os
import shutil
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from echo.learner.checkpoints.checkpoint_files import DCP_FORMAT as FORMAT
from echo.learner.checkpoints.checkpoint_files import Checkpoint, fsync, keep_newest, version_dir
from echo.learner.checkpoints.checkpoint_files import is_dcp as is_dcp  # readers call it here

DCP_DIR = "dcp"
# A LoRA job's checkpoint holds the adapter and its optimizer state only (the base is fixed in
# lora_base.safetensors), its tensors under peft's saved names (the live names without the
# adapter's name, ``.default.``): the names the single LoRA learner's checkpoints use.
# Not strict: the frozen base is no part of the state (DCP's load checks the adapter's names).
ADAPTER_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def _saved_name(name: str) -> str:
    return name.replace(".default.", ".")


def _model_and_optim(
    model: torch.nn.Module, opt: torch.optim.Optimizer, adapter: bool
) -> tuple[dict, dict]:
    """``get_state_dict`` of the model and optimizer; with ``adapter``, the trainable tensors
    only, the model's under their saved names."""
    model_sd, optim_sd = get_state_dict(model, opt, options=ADAPTER_ONLY if adapter else None)
    if adapter:
        model_sd = {_saved_name(n): t for n, t in model_sd.items()}
    return model_sd, optim_sd


def _fsync_tree(path: Path) -> None:
    """Flush the folder ``path`` and every file in it (DCP flushed its own files' data; their
    names in the folder are what this makes durable)."""
    for p in path.rglob("*"):
        if p.is_file():
            fsync(p)
    fsync(path)


def save(
    root: Path,
    version: int,
    anchor_version: int,
    report: bytes,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    leader: bool,
    adapter: bool = False,
) -> None:
    """Write the checkpoint of ``version`` under ``root``; every rank calls it at once, and
    ``leader`` (rank 0) commits it. Returns on rank 0 once the checkpoint is durable and
    visible. ``adapter``: a LoRA job's (see :data:`ADAPTER_ONLY`). :raises OSError: the disk
    refused."""
    tmp = root / f".tmp-{version}"
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)
    dist.barrier()  # the folder exists before any rank writes into it
    model_sd, optim_sd = _model_and_optim(model, opt, adapter)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / DCP_DIR)
    if not leader:
        return
    (tmp / "report.bin").write_bytes(report)
    (tmp / "meta.json").write_text(
        json.dumps({"version": version, "anchor_version": anchor_version, "format": FORMAT})
    )
    _fsync_tree(tmp)
    final = version_dir(root, version)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync(root)
    keep_newest(root)


def load_sharded(
    version_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, adapter: bool = False
) -> None:
    """Load the DCP checkpoint in ``version_dir`` into the sharded ``model`` and its ``opt``;
    every rank calls it at once, with whatever number of ranks wrote it. ``adapter``: a LoRA
    job's, as :func:`save` wrote it.

    :raises RuntimeError: the checkpoint does not match the model (DCP names the tensor).
    """
    # The optimizer's state is initialised by get_state_dict.
    model_sd, optim_sd = _model_and_optim(model, opt, adapter)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=version_dir / DCP_DIR)
    live = {_saved_name(n): n for n, p in model.named_parameters()} if adapter else {}
    model_sd = {live.get(n, n): t for n, t in state["model"].items()}
    set_state_dict(
        model,
        opt,
        model_state_dict=model_sd,
        optim_state_dict=state["optim"],
        options=ADAPTER_ONLY if adapter else None,
    )


def load_full(version_dir: Path) -> dict:
    """The whole DCP checkpoint in ``version_dir`` as plain tensors on the CPU, read by one
    process with no process group: ``{"model": {name: tensor}, "optim": {...}}`` with the
    optimizer state keyed by parameter name. :raises OSError: it cannot be read."""
    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(version_dir / DCP_DIR),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


def optim_by_index(optim_state: dict) -> dict:
    """An optimizer state keyed by parameter name (as :func:`load_full` returns it) keyed by
    position instead, as ``torch.optim.Optimizer.load_state_dict`` of an optimizer built over
    ``model.parameters()`` takes it: the names in ``param_groups`` are in that order."""
    groups = optim_state["param_groups"]
    index = {name: i for i, name in enumerate(chain.from_iterable(g["params"] for g in groups))}
    return {
        "state": {index[name]: s for name, s in optim_state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def load_for_single(version_dir: Path) -> Checkpoint:
    """A DCP checkpoint as the single learner restores one (full weights, positional
    optimizer state). :raises OSError, ValueError, KeyError: unreadable or incomplete."""
    meta = json.loads((version_dir / "meta.json").read_text())
    state = load_full(version_dir)
    return Checkpoint(
        version=int(meta["version"]),
        anchor_version=int(meta["anchor_version"]),
        model_state=state["model"],
        optim_state=optim_by_index(state["optim"]),
        report=(version_dir / "report.bin").read_bytes(),
    )
