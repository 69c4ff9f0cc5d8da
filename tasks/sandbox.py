"""Scoring untrusted completions outside the caller's process: :class:`Sandbox`.

Every scorer that reads completion text (reasoning-gym's ``score_answer``, math-verify, a
researcher's regex or ``python`` function, our own format checks) may be made to run code, hang
in C, or allocate without end by a text chosen for it. A :class:`Sandbox` owns one job's scoring:

- a **zygote** process (:mod:`echo.tasks.sandbox_zygote`) started with a clean environment and
  no inherited descriptors but its control socket, which builds the job's reward, warms it and
  confines itself (:mod:`echo.tasks.jail`: no network, no filesystem, nobody's uid, resource
  limits);
- a **child forked per group**, which scores that group's texts and exits, so a compromise
  never outlives the group that caused it;
- **only the caller's data in**: the request carries the texts and, for tasks whose items
  another process would regenerate differently, the caller's own item (pickled by the caller
  for its child; nothing a child sends back is unpickled);
- the **caller's deadlines**: each text has :attr:`Sandbox.budget_s` of wall time; a child that
  overruns is killed and the text scores 0 with outcome ``scorer_timeout`` (``scorer_crashed``
  when the child dies on it, say at a resource limit). The rest of the group goes on in a new
  child, until :data:`MAX_FAILURES_PER_GROUP` texts have failed: then the rest score 0 as
  ``scorer_skipped`` (a group that kills two children is not an honest one).

:meth:`Sandbox.score` blocks the calling thread (the coordinator calls it through
``trio.to_thread``); it is thread-safe, and concurrent calls score in concurrent children.
Replies are parsed as untrusted: a bounded frame, two fields, a finite score within the reward's
range. Each :class:`Score` carries the wall seconds it took, what the caller charges the node.

Zygotes are started from one long-lived thread of this module (:data:`_SPAWNER`), never from
the calling thread: a zygote dies with the *thread* that started it (``PR_SET_PDEATHSIG``), and
trio retires a worker thread after 10 s idle, so a zygote started by a scoring call was killed
within seconds of a lull, and the next group paid its restart (reasoning-gym and sympy imported
and warmed again, seconds of a core: honest submit p99 of 4-8 s in benchmarks/attack.py).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from echo.tasks.jail import STRONG
from echo.tasks.sandbox_zygote import MAX_CONTROL_BYTES, OK, SCORER_ERROR, write_frame
from echo.tasks.scoring import DEFAULT_TIMEOUT_S, RewardTerm

log = logging.getLogger(__name__)

SCORER_TIMEOUT = "scorer_timeout"
SCORER_CRASHED = "scorer_crashed"
SCORER_SKIPPED = "scorer_skipped"
OUTCOMES = frozenset({OK, SCORER_ERROR, SCORER_TIMEOUT, SCORER_CRASHED, SCORER_SKIPPED})
# Two texts that each killed a child mark the group as hostile; scoring the rest would only
# hand its sender more of our CPU.
MAX_FAILURES_PER_GROUP = 2
# Wall seconds per text for components without a timeout of their own (exact, regex, format):
# honest texts score in milliseconds, so this only ever bounds a hostile one.
FAST_COMPONENT_S = 2.0
# A task's own scorer: some reasoning-gym ones check an answer by solving the puzzle
# (futoshiki's reference took over 2 s here on a busy machine).
TASK_COMPONENT_S = 10.0
# The zygote imports the task's libraries (reasoning-gym and sympy take seconds) and warms them.
START_TIMEOUT_S = 120.0
# Answers to fork/kill commands come from our own zygote at once; a silent one is replaced.
CONTROL_TIMEOUT_S = 10.0
# The child's CPU limit is a backstop behind the caller's wall-clock deadline: a busy child's
# CPU seconds pass as fast as wall seconds, so without slack SIGXCPU could win the race and a
# timeout would read as a crash.
CPU_SLACK_S = 2.0
# A reply frame is two short fields.
MAX_REPLY_BYTES = 256
# A zygote holds its job's libraries in memory (reasoning-gym and sympy: ~200 MB); one unused
# this long (its job over, or its nodes gone) is stopped, and the next group starts another.
IDLE_CLOSE_S = 600.0
# Starts every zygote: its one worker lives as long as the process (see the module doc).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")


class SandboxError(Exception):
    """The job cannot be scored: its reward does not load, or its zygote does not start."""


@dataclass(frozen=True)
class Recipe:
    """What a zygote builds: the task by name and params, and the reward terms."""

    task: str
    params: dict[str, Any]
    rewards: tuple[RewardTerm, ...] = ()

    def wire(self, jail: bool) -> bytes:
        return msgpack.packb(
            {
                "task": self.task,
                "params": self.params,
                "rewards": [asdict(r) for r in self.rewards],
                "sys_path": [p for p in sys.path if p],
                "jail": jail,
            }
        )

    def budget_s(self) -> float:
        """Wall seconds one text may take: the sum of its components' bounds."""
        terms = self.rewards or (RewardTerm(),)
        total = 0.0
        for t in terms:
            if t.kind == "math":
                # Two parses and one comparison, each bounded by math-verify's own timeout.
                total += 2 * (t.timeout_s or DEFAULT_TIMEOUT_S) + 1
            elif t.kind == "python":
                total += t.timeout_s or DEFAULT_TIMEOUT_S
            elif t.kind == "task":
                total += TASK_COMPONENT_S
            else:
                total += FAST_COMPONENT_S
        return total

    def max_abs(self) -> float:
        """The largest |reward| the weighted sum can reach (components score in [0, 1]; a
        ``python`` one may return any finite number, so it is not bounded here)."""
        terms = self.rewards or (RewardTerm(),)
        if any(t.kind == "python" for t in terms):
            return math.inf
        return sum(abs(t.weight) for t in terms)


@dataclass(frozen=True)
class Score:
    """One text's reward, how scoring ended (:data:`OUTCOMES`), and the wall seconds it took."""

    value: float
    outcome: str
    seconds: float


@dataclass
class _Zygote:
    proc: subprocess.Popen[bytes]
    ctrl: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)


class Sandbox:
    """One job's scorers behind a confined zygote (see the module doc).

    ``jail=False`` keeps the separate processes and limits on time but skips confinement; it is
    for tests of the mechanism on systems that refuse it, never for a coordinator.
    """

    def __init__(self, recipe: Recipe, *, jail: bool = True, budget_s: float | None = None):
        self.recipe = recipe
        self.jail = jail
        self.budget_s = budget_s if budget_s is not None else recipe.budget_s()
        self.protections: list[str] = []
        self.restarts = 0
        self._lock = threading.Lock()
        self._zygote: _Zygote | None = None
        self._used = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start the zygote now (else the first :meth:`score` does); returns the protections
        that took (:data:`echo.tasks.jail.STRONG` for a full sandbox).

        :raises SandboxError: the reward does not load (the message says why) or the zygote did
            not come up within :data:`START_TIMEOUT_S`.
        """
        self._get_zygote()
        return list(self.protections)

    def close(self) -> None:
        """Stop the zygote and its children; a later :meth:`score` starts a new one."""
        with self._lock:
            z, self._zygote = self._zygote, None
        if z is not None:
            _stop(z)

    def close_if_idle(self, idle_s: float = IDLE_CLOSE_S) -> bool:
        """Stop the zygote if no group was scored for ``idle_s``; whether it was stopped."""
        # Never waits for the lock: the coordinator calls this on its event loop, and a score
        # or a zygote start holds the lock for as long as it takes (a start at load 31 froze
        # the loop for 29 s). A sandbox in use is not idle.
        if not self._lock.acquire(blocking=False):
            return False
        try:
            idle = self._zygote is not None and time.monotonic() - self._used > idle_s
        finally:
            self._lock.release()
        if idle:
            self.close()
        return idle

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get_zygote(self) -> _Zygote:
        with self._lock:
            self._used = time.monotonic()
            z = self._zygote
            if z is not None and z.proc.poll() is None:
                return z
            if z is not None:
                self.restarts += 1
                _stop(z)
                self._zygote = None
            self._zygote = self._spawn()
            return self._zygote

    def _spawn(self) -> _Zygote:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            "PATH": os.defpath,
            "LANG": "C.UTF-8",
            # One thread: a zygote forks, and numerical libraries' thread pools do not survive
            # a fork.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
            proc = _SPAWNER.submit(
                subprocess.Popen,
                [sys.executable, "-I", "-m", "echo.tasks.sandbox_zygote", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                # A hostile text can make a scorer log anything; none of it reaches our log.
                stderr=subprocess.DEVNULL,
                close_fds=True,
            ).result()
        finally:
            child.close()
        z = _Zygote(proc, parent)
        try:
            parent.send(self.recipe.wire(self.jail))
            parent.settimeout(START_TIMEOUT_S)
            raw = parent.recv(MAX_CONTROL_BYTES)
        except OSError as exc:
            _stop(z)
            raise SandboxError(f"scoring sandbox did not start: {exc}") from None
        reply = _control_reply(raw)
        if "error" in reply:
            _stop(z)
            raise SandboxError(f"cannot load the job's reward: {reply['error']}")
        ready = reply.get("ready")
        if not isinstance(ready, list):
            _stop(z)
            raise SandboxError("scoring sandbox did not start (no ready message)")
        self.protections = [str(p) for p in ready]
        missing = [p for p in STRONG if p not in self.protections]
        if missing and self.jail:
            log.warning(
                "scoring sandbox for %s runs without %s (run as root, or allow unprivileged "
                "user namespaces: sysctl kernel.unprivileged_userns_clone=1)",
                self.recipe.task,
                ", ".join(missing),
            )
        else:
            log.info("scoring sandbox for %s: %s", self.recipe.task, ", ".join(self.protections))
        parent.settimeout(CONTROL_TIMEOUT_S)
        return z

    # -- scoring ---------------------------------------------------------------------------

    def score(
        self,
        prompt_id: int,
        texts: Sequence[str],
        context: Any = None,
        max_s: float | None = None,
    ) -> list[Score]:
        """Each text's :class:`Score`, in order; never raises for what a text says or does.
        ``context``: the caller's ``task.scoring_context(prompt_id)``, for tasks whose items
        another process would not regenerate the same. ``max_s``: wall seconds the whole group
        may take (what its sender may still spend); a text still scoring then is killed
        (``scorer_timeout``) and the rest are skipped (``scorer_skipped``).

        :raises SandboxError: the zygote cannot be (re)started.
        """
        until = math.inf if max_s is None else time.monotonic() + max_s
        out: list[Score] = []
        failures = 0
        while len(out) < len(texts):
            if failures >= MAX_FAILURES_PER_GROUP or time.monotonic() >= until:
                out.extend(Score(0.0, SCORER_SKIPPED, 0.0) for _ in texts[len(out) :])
                break
            done, failed = self._score_in_child(prompt_id, texts[len(out) :], context, until)
            out.extend(done)
            failures += failed
        return out

    def _score_in_child(
        self, prompt_id: int, texts: Sequence[str], context: Any, until: float
    ) -> tuple[list[Score], int]:
        """Score ``texts`` in one fresh child until it ends or fails; (scores, 1 if it failed)."""
        z = self._get_zygote()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = self._fork(z, theirs, self.budget_s * len(texts) + CPU_SLACK_S)
        finally:
            theirs.close()
        out: list[Score] = []
        try:
            ctx = None if context is None else pickle.dumps(context)
            request = {"prompt_id": prompt_id, "texts": list(texts), "context": ctx}
            write_frame(mine, msgpack.packb(request))
            reader = _FrameReader(mine)
            limit = self.recipe.max_abs()
            for _ in texts:
                t0 = time.monotonic()
                raw = reader.next(min(t0 + self.budget_s, until))
                took = time.monotonic() - t0
                if raw is _TIMEOUT:
                    self._kill(z, pid)
                    out.append(Score(0.0, SCORER_TIMEOUT, took))
                    return out, 1
                parsed = _reply(raw, limit) if raw is not None else None
                if parsed is None:
                    self._kill(z, pid)
                    out.append(Score(0.0, SCORER_CRASHED, took))
                    return out, 1
                out.append(Score(parsed[0], parsed[1], took))
            return out, 0
        except OSError:
            self._kill(z, pid)
            out.append(Score(0.0, SCORER_CRASHED, 0.0))
            return out, 1
        finally:
            mine.close()

    def _fork(self, z: _Zygote, sock: socket.socket, cpu_s: float) -> int:
        with z.lock:
            try:
                socket.send_fds(
                    z.ctrl, [msgpack.packb({"op": "fork", "cpu_s": cpu_s})], [sock.fileno()]
                )
                reply = _control_reply(z.ctrl.recv(MAX_CONTROL_BYTES))
            except OSError as exc:
                reply = {"error": str(exc)}
        pid = reply.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            # A zygote that does not answer is replaced; the next call starts another.
            _stop(z)
            raise SandboxError(f"scoring sandbox failed to fork: {reply.get('error', reply)}")
        return pid

    def _kill(self, z: _Zygote, pid: int) -> None:
        with z.lock:
            try:
                z.ctrl.send(msgpack.packb({"op": "kill", "pid": pid}))
                z.ctrl.recv(MAX_CONTROL_BYTES)
            except OSError:
                _stop(z)


_TIMEOUT = object()


class _FrameReader:
    """Length-prefixed frames from a child, each read by a deadline, bounded in size."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def next(self, deadline: float) -> Any:
        """The next frame's bytes; None at end of stream or for an oversized frame;
        ``_TIMEOUT`` past ``deadline``."""
        while True:
            if len(self.buf) >= 4:
                size = int.from_bytes(self.buf[:4], "big")
                if size > MAX_REPLY_BYTES:
                    return None
                if len(self.buf) >= 4 + size:
                    frame = bytes(self.buf[4 : 4 + size])
                    del self.buf[: 4 + size]
                    return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _TIMEOUT
            ready, _, _ = select.select([self.sock], [], [], remaining)
            if not ready:
                return _TIMEOUT
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > 4 * MAX_REPLY_BYTES:
                return None


def _reply(raw: bytes, limit: float) -> tuple[float, str] | None:
    """A child's ``[score, outcome]``, checked; None for anything else."""
    try:
        value = msgpack.unpackb(raw, raw=False, max_str_len=64, max_array_len=2, max_map_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if not isinstance(value, list) or len(value) != 2:
        return None
    score, outcome = value
    if isinstance(score, bool) or not isinstance(score, int | float):
        return None
    if not math.isfinite(score) or abs(score) > limit + 1e-9 or outcome not in (OK, SCORER_ERROR):
        return None
    return float(score), outcome


def _control_reply(raw: bytes) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(raw, raw=False, max_str_len=8192, max_array_len=64)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return {"error": "unreadable control reply"}
    return value if isinstance(value, dict) else {"error": "unreadable control reply"}


def _stop(z: _Zygote) -> None:
    """Kill a zygote (its children die with their sockets: each exits on a closed socket)."""
    try:
        z.ctrl.close()
    finally:
        if z.proc.poll() is None:
            z.proc.kill()
        try:
            z.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("scoring zygote %d did not exit after SIGKILL", z.proc.pid)
