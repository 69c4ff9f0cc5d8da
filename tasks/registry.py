"""Task names -> classes, and :func:`make_task` with clear errors for job descriptions."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from echo.tasks.addition import Addition
from echo.tasks.base import Task
from echo.tasks.dataset import DatasetTask
from echo.tasks.gym import GymTask
from echo.tasks.reverse import Reverse

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (Addition, Reverse, DatasetTask, GymTask)}


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build task ``name`` from ``params``.

    ``"gym:<dataset>"`` is short for task ``gym`` with ``params.dataset = "<dataset>"``.

    :raises ValueError: the message names the unknown task, the bad parameter, or the missing
        dataset file (a dataset's rows are read on first use, not here).
    """
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"task {name!r}: params must be a mapping, not {type(params).__name__}")
    params = dict(params or {})
    base, sep, dataset = name.partition(":")
    if sep and base == GymTask.name:
        if params.get("dataset", dataset) != dataset:
            raise ValueError(
                f"task {name!r}: params.dataset {params['dataset']!r} contradicts the name"
            )
        params["dataset"] = dataset
        name = base
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown task {name!r} (known: {', '.join(sorted(TASKS))}, "
            "gym:<reasoning-gym dataset>)"
        )
    try:
        parsed = cls.Params.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ValueError(f"task {name!r}: bad params: {problems}") from None
    try:
        return cls(parsed)
    except ValueError as exc:
        raise ValueError(f"task {name!r}: {exc}") from None
