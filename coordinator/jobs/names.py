"""Job names and job ids as they may appear in paths: checked where a job is created and again
wherever a path is built from one.

A job's folder is ``data_dir/jobs/<job id>`` and its id is ``<name>-<8 hex>``, so a name is
held to a strict pattern (:data:`JOB_NAME_PATTERN`) when a job is submitted. A job id is
checked again when its folder is named (:func:`job_dir`): one path component under
``data_dir/jobs``, never ``..`` nor a separator, even for a job stored by an older build.
Both checks raise ValueError with a message that names the problem.
"""

from __future__ import annotations

import re
from pathlib import Path

# Letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64 characters.
JOB_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# What a job id may never contain, whatever build stored it.
_FORBIDDEN_IN_ID = ("/", "\\", "\x00")


def check_job_name(name: str) -> str:
    """Return ``name`` if it may name a job; raise ValueError naming the rule otherwise."""
    if not JOB_NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"job name {name!r} is not allowed: use 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def job_dir(data_dir: Path, job_id: str) -> Path:
    """The folder of ``job_id`` under ``data_dir/jobs``.

    :raises ValueError: ``job_id`` is empty, ``.`` or ``..``, holds a path separator or NUL, or
        would resolve outside ``data_dir/jobs``.
    """
    if not job_id or job_id in (".", "..") or any(c in job_id for c in _FORBIDDEN_IN_ID):
        raise ValueError(f"job id {job_id!r} cannot name a folder")
    root = data_dir / "jobs"
    path = root / job_id
    if path.resolve().parent != root.resolve():
        raise ValueError(f"job id {job_id!r} resolves outside {root}")
    return path
