"""The scoring sandbox's zygote: loads one job's scorers, confines itself, forks a child per group.

Run by :class:`echo.tasks.sandbox.Sandbox` as ``python -I -m echo.tasks.sandbox_zygote FD``,
where ``FD`` is its end of a ``SOCK_SEQPACKET`` control socket. The sequence:

1. Read the recipe (task, params, reward terms, the parent's ``sys.path``) and build the job's
   :class:`~echo.tasks.scoring.JobReward`: datasets are read and researcher functions imported
   here, while the filesystem is still in reach.
2. Warm every scorer on a few answers, so the lazy imports they do on first use are done.
3. :func:`echo.tasks.jail.confine` itself and report ``ready`` with the steps that took.
4. Serve: ``fork`` (with a stream socket passed as ancillary data) forks a child that reads one
   request on that socket, scores it and exits; ``kill`` kills a live child. Nothing here reads
   a completion: only the children do, each one group, so whatever a hostile text does to a
   child cannot outlive the group it came in.

Frames on a child's socket: a 4-byte big-endian length, then msgpack. The request is
``{"prompt_id": int, "texts": [str, ...], "context": bytes | None}`` (``context``: the
parent's :meth:`~echo.tasks.base.Task.scoring_context`, pickled by the parent); the child
answers each text, in order, with ``[score, outcome]`` (``outcome`` "ok" or "scorer_error"),
so a text that kills the child costs the texts after it only a new child.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import struct
import sys
from typing import Any

import msgpack

# Recipes and control messages are a few KB; anything longer is not from our parent.
MAX_CONTROL_BYTES = 1 << 20
# One group's texts: generous for 64 completions of 8k tokens.
MAX_REQUEST_BYTES = 64 << 20
_LEN = struct.Struct(">I")

OK, SCORER_ERROR = "ok", "scorer_error"


def read_frame(sock: socket.socket, max_bytes: int) -> bytes | None:
    """One length-prefixed frame from a blocking socket; None at a clean end of stream.

    :raises ValueError: a frame over ``max_bytes`` (checked before reading it) or a stream that
        ends inside a frame.
    """
    head = _read_exact(sock, _LEN.size, allow_eof=True)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > max_bytes:
        raise ValueError(f"frame of {size} bytes over the limit of {max_bytes}")
    body = _read_exact(sock, size, allow_eof=False)
    assert body is not None
    return body


def _read_exact(sock: socket.socket, n: int, *, allow_eof: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if allow_eof and not buf:
                return None
            raise ValueError(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def write_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one length-prefixed frame."""
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _build(recipe: dict[str, Any]) -> Any:
    from echo.tasks.registry import make_task
    from echo.tasks.scoring import JobReward, RewardTerm

    task = make_task(recipe["task"], recipe["params"])
    return JobReward(task, [RewardTerm(**t) for t in recipe["rewards"]])


def _warm(reward: Any) -> None:
    """Score a few typical answers so that what the scorers import on first use is imported
    now, before the filesystem is gone: the reference answer bare, tagged and boxed, LaTeX,
    and junk, for a training prompt and a held-out one."""
    task = reward.task
    pids = [0, *task.eval_prompt_ids(1)]
    for pid in pids:
        answer = task.answer(pid)
        for text in (
            answer,
            f"<answer>{answer}</answer>",
            f"so \\boxed{{{answer}}}",
            "\\frac{1}{2} + x^2",
            "[[1, 2], [3, 4]]",
            "junk",
            "",
        ):
            reward.detailed(pid, text)
    # Encodings that text handling may look up lazily.
    for codec in ("idna", "utf-16", "latin-1", "ascii"):
        "x".encode(codec)


def _serve_child(fd: int, reward: Any, cpu_s: float, zygote: int) -> None:
    from echo.tasks import jail

    gc.disable()
    jail.limit_call(cpu_s, zygote)
    sock = socket.socket(fileno=fd)
    raw = read_frame(sock, MAX_REQUEST_BYTES)
    if raw is None:
        return
    req = msgpack.unpackb(raw, raw=False, max_str_len=MAX_REQUEST_BYTES, max_array_len=4096)
    prompt_id, texts = int(req["prompt_id"]), req["texts"]
    if req.get("context") is not None:
        # From our parent, the coordinator, which made it from its own task: never from a node.
        reward.task.pin(prompt_id, pickle.loads(req["context"]))
    for text in texts:
        value, outcome = reward.detailed(prompt_id, str(text))
        write_frame(sock, msgpack.packb([float(value), outcome]))


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


def serve(ctrl: socket.socket, reward: Any) -> None:
    """Answer ``fork`` and ``kill`` until the parent closes the control socket."""
    children: set[int] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, MAX_CONTROL_BYTES, 1)
        except OSError:
            return
        if not msg:
            return
        cmd = msgpack.unpackb(msg, raw=False)
        _reap(children)
        if cmd.get("op") == "fork" and len(fds) == 1:
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                try:
                    ctrl.close()
                    _serve_child(fds[0], reward, float(cmd["cpu_s"]), me)
                finally:
                    os._exit(0)
            os.close(fds[0])
            children.add(pid)
            ctrl.send(msgpack.packb({"pid": pid}))
        else:
            for fd in fds:
                os.close(fd)
            if cmd.get("op") == "kill" and cmd.get("pid") in children:
                # Only live children of ours: an unreaped pid cannot have been reused.
                os.kill(int(cmd["pid"]), signal.SIGKILL)
            ctrl.send(msgpack.packb({"ok": True}))


def main(fd: int) -> None:
    parent = os.getppid()
    ctrl = socket.socket(fileno=fd)
    recipe = msgpack.unpackb(ctrl.recv(MAX_CONTROL_BYTES), raw=False)
    for path in reversed(recipe.get("sys_path", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        reward = _build(recipe)
        _warm(reward)
    except BaseException as exc:  # noqa: BLE001 - the parent reports why the job cannot score
        ctrl.send(msgpack.packb({"error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return
    applied: list[str] = []
    if recipe.get("jail", True):
        from echo.tasks import jail

        applied = jail.confine()
        jail.die_with_parent(parent)
    # Children share the zygote's heap copy-on-write; a collection in a child would touch (and
    # copy) every page of it. Frozen objects are never collected, and a child never collects.
    gc.collect()
    gc.freeze()
    ctrl.send(msgpack.packb({"ready": applied}))
    serve(ctrl, reward)


if __name__ == "__main__":
    main(int(sys.argv[1]))
