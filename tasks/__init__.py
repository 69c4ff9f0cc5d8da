"""echo.tasks: task adapters (a deterministic prompt source plus a verifiable reward)."""

from echo.tasks.base import Task, TaskParams
from echo.tasks.registry import TASKS, make_task

__all__ = ["TASKS", "Task", "TaskParams", "make_task"]
