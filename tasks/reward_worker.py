"""Reward functions run in a child process, so a slow, hanging or crashing one costs one score.

A researcher's reward is their own code: it may loop forever, block on I/O or kill its process.
:class:`RewardWorker` keeps one child process (``spawn``: no inherited locks or threads) that
loads the function once and answers one call at a time. The parent waits at most ``timeout_s``
for each answer; on a timeout the child is killed and a fresh one is started on the next call,
and the caller gets :class:`RewardTimeout` (the job's reward then scores 0 and logs why).

Targets are named, never pickled: ``"entry:NAME"`` is the entry point ``NAME`` of group
:data:`ENTRY_POINT_GROUP` (how installed packages register rewards), ``"module:attr"`` an
importable function. The function is called with keyword arguments only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import math
import multiprocessing
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "echo_swarm.rewards"
# A child imports Python, our package and the researcher's module before it is ready.
START_TIMEOUT_S = 120.0


class RewardError(Exception):
    """A reward call that gave no score: the function raised, returned a non-number, could not
    be loaded, or its process died."""


class RewardTimeout(RewardError):
    """A reward call that did not answer within its time limit (its process was killed)."""


def find_entry_point(name: str) -> importlib.metadata.EntryPoint:
    """The entry point ``name`` of group ``echo_swarm.rewards`` (not loaded).

    :raises ValueError: no such entry point; the message lists the registered names.
    """
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    found = [ep for ep in eps if ep.name == name]
    if not found:
        known = ", ".join(sorted(ep.name for ep in eps)) or "none"
        raise ValueError(
            f"no reward entry point {name!r} in group {ENTRY_POINT_GROUP!r} (registered: {known})"
        )
    return found[0]


def resolve(target: str) -> Callable[..., Any]:
    """The function ``target`` names (see the module doc).

    :raises ValueError: a malformed target or a missing entry point; ImportError or
        AttributeError when the module or function does not exist; TypeError if not callable.
    """
    kind, sep, rest = target.partition(":")
    if not sep or not rest:
        raise ValueError(f"reward target {target!r} is not 'entry:NAME' or 'module:function'")
    fn = (
        find_entry_point(rest).load()
        if kind == "entry"
        else getattr(importlib.import_module(kind), rest)
    )
    if not callable(fn):
        raise TypeError(f"reward target {target!r} is not callable")
    return fn


def _child_main(conn: Any, target: str) -> None:
    """The child's loop: load ``target``, then answer ``kwargs`` with ("ok", float) or
    ("error", reason) until the parent closes the pipe."""
    try:
        fn = resolve(target)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            value = fn(**kwargs)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"returned {type(value).__name__}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            conn.send(("ok", float(value)))
        except BaseException as exc:  # noqa: BLE001 - any failure of user code is one score
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class RewardWorker:
    """One child process serving calls to ``target``, each bounded by ``timeout_s`` seconds.

    Thread-safe (calls are serialised). The child starts on the first call or :meth:`start`.
    """

    def __init__(self, target: str, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.target = target
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._load_error: str | None = None
        self.kills = 0  # children killed (timeouts, deaths, close)
        weakref.finalize(self, RewardWorker._stop, self.__dict__)

    def start(self) -> None:
        """Start the child now and wait until it has loaded the target.

        :raises RewardError: the target does not load (the message says why) or the child did
            not come up within ``start_timeout_s``.
        """
        with self._lock:
            self._ensure_started()

    def call(self, **kwargs: Any) -> float:
        """The target's score for ``kwargs`` (picklable values).

        :raises RewardTimeout: no answer within ``timeout_s`` (the child is killed).
        :raises RewardError: the function raised or returned a non-finite or non-number value,
            the child died, or the target does not load.
        """
        with self._lock:
            self._ensure_started()
            try:
                self._conn.send(kwargs)
                answered = self._conn.poll(self.timeout_s)
                reply = self._conn.recv() if answered else None
            except (EOFError, OSError, BrokenPipeError):
                self._kill()
                raise RewardError(f"reward process for {self.target} died") from None
            if reply is None:
                self._kill()
                raise RewardTimeout(
                    f"{self.target} gave no answer within {self.timeout_s:g} s "
                    "(process killed; a new one starts on the next call)"
                )
            status, value = reply
            if status != "ok":
                raise RewardError(f"{self.target}: {value}")
            return float(value)

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        with self._lock:
            self._kill()

    def _ensure_started(self) -> None:
        if self._load_error is not None:
            raise RewardError(self._load_error)
        if self._proc is not None and self._proc.is_alive():
            return
        if self._proc is not None:
            self._kill()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_main, args=(child, self.target), daemon=True, name="echo-reward"
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(self.start_timeout_s):
            self._kill()
            raise RewardError(f"reward process for {self.target} did not start")
        try:
            status, detail = parent.recv()
        except (EOFError, OSError):
            self._kill()
            raise RewardError(f"reward process for {self.target} died while loading") from None
        if status != "ready":
            self._kill()
            # A target that does not load will not load on the next call either.
            self._load_error = f"cannot load reward {self.target}: {detail}"
            raise RewardError(self._load_error)

    def _kill(self) -> None:
        if self._proc is not None:
            self.kills += 1
        RewardWorker._stop(self.__dict__)

    @staticmethod
    def _stop(state: dict[str, Any]) -> None:
        proc, conn = state.get("_proc"), state.get("_conn")
        state["_proc"] = state["_conn"] = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
