"""Task names -> classes, and :func:`make_task` with clear errors for job descriptions."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from echo.tasks.addition import Addition
from echo.tasks.base import Task
from echo.tasks.reverse import Reverse

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (Addition, Reverse)}


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build task ``name`` from ``params``; ValueError names the bad task or parameter."""
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r} (known: {', '.join(sorted(TASKS))})")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"task {name!r}: params must be a mapping, not {type(params).__name__}")
    try:
        parsed = cls.Params.model_validate(params or {})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
            for err in e.errors()
        )
        raise ValueError(f"task {name!r}: bad params: {problems}") from None
    return cls(parsed)
