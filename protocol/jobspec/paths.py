"""The file paths a job names: a path that must stay inside the job's folder, and the task
parameters that name files on the coordinator (read there, never sent to nodes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any


def relative_path_problem(path: str) -> str | None:
    """Why ``path`` could name something outside the folder it is taken relative to (absolute,
    a ``..`` part, a NUL byte), else None."""
    if "\x00" in path:
        return "must not contain a NUL byte"
    # A backslash is a separator on Windows; here it only hides a '..' from a casual reader.
    parts = PurePosixPath(path.replace("\\", "/"))
    if parts.is_absolute() or path.startswith("~"):
        return f"{path!r} must be relative to the job's folder, not absolute"
    if ".." in parts.parts:
        return f"{path!r} must stay inside the job's folder (no '..')"
    return None


def is_local_path_param(key: str) -> bool:
    """Whether task parameter ``key`` names a file on the coordinator (``path``, ``eval_path``,
    any ``*_path``): such a value is read only under the operator's dataset roots and never
    sent to nodes."""
    return key == "path" or key.endswith("_path")


def node_task_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The task parameters a node may see: all but those naming local files
    (:func:`is_local_path_param`). Nodes generate from the token ids in their leases and never
    read the dataset; where the coordinator keeps its files is nobody else's business."""
    return {k: v for k, v in params.items() if not is_local_path_param(k)}
