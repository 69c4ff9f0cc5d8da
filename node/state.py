"""The running node's state as another process reads it: ``DATA_DIR/status.json``.

:class:`StatusKeeper` owns the file. While ``echo-node join`` runs it rewrites it every
:data:`WRITE_INTERVAL_S` (a temporary file renamed over the old one, so a reader never sees half
a write), and on the way out it writes once more with why the node stopped. ``echo-node status``
and the local page (:mod:`echo.node.ui`) show what it holds: whether the node runs, its engine,
the job and policy version it holds, tokens/s, groups accepted and rejected with the reasons and
what to do about them, its credit (with ``api`` set), and its last error.

Whether the node runs is not taken from the file's word alone: a node killed with SIGKILL, or an
out-of-memory kill, writes nothing. :func:`read_status` checks that the process the file names
still exists (pid and start time, so a reused pid does not count) and that the file is fresh.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil
import trio

from echo.protocol import ids
from echo.protocol import reasons as R

if TYPE_CHECKING:
    from echo.node.config import NodeConfig
    from echo.node.display import Display
    from echo.node.engine_slot import EngineSlot
    from echo.node.policy import PolicyFollower
    from echo.node.session import CoordinatorSession
    from echo.p2p.host import EchoHost
    from echo.p2p.identity import Identity

STATUS_FILE = "status.json"
SCHEMA = 1
WRITE_INTERVAL_S = 2.0
# A running node's file older than this means its loop is stuck (or the clock jumped).
STALE_AFTER_S = 30.0
# The file is small (tens of rejections, a few checks); a bigger one is not ours.
MAX_STATUS_BYTES = 1 << 20
# How often the node fetches and verifies its credit ledger (the whole chain each time).
CREDIT_INTERVAL_S = 60.0
CREDIT_TIMEOUT_S = 45.0

# What a volunteer can do about each rejection reason a node is told (protocol/reasons.py).
_UPDATE = "update echo-swarm (pip install -U echo-swarm); report it if it goes on"
_SLOW = (
    "the node is slow for this job: lower --leases-at-once, raise --max-tokens-per-s if set, "
    "or check that nothing else holds the machine"
)
_ENGINE = (
    "the engine's output disagrees with the policy: run echo-node doctor, try --engine torch, "
    "and update echo-swarm"
)
REASON_FIXES: dict[str, str] = {
    R.STALE_VERSION: _SLOW + "; a slow download of new versions does this too",
    R.LEASE_EXPIRED: _SLOW,
    R.RATE_LIMITED: "nothing: the node asked too often and slows down by itself",
    R.DUPLICATE: "nothing if it happened once (a restart resubmits); " + _UPDATE,
    R.UNKNOWN_LEASE: "nothing if it happened once after a restart; " + _UPDATE,
    R.UNSCORABLE: "nothing: the learner no longer held that version to check it",
    R.NODE_EXCLUDED: "the coordinator excluded this node after repeated failed work: fix the "
    "reasons above, then ask the swarm's operator",
    R.UNKNOWN_NODE: "restart the node: it registers again",
    R.WRONG_WEIGHTS: _ENGINE,
    R.RESCORE_MISMATCH: _ENGINE,
    R.SAMPLING_SHAPE: _ENGINE,
    R.TERMINATION_IMPROBABLE: _ENGINE,
}


def reason_fix(reason: str) -> str:
    """What the volunteer can do about ``reason`` (a node's bug is an update away)."""
    return REASON_FIXES.get(reason, _UPDATE)


def status_path(data_dir: Path) -> Path:
    return data_dir / STATUS_FILE


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file renamed over it. No fsync:
    after a power cut a stale or missing file is as good as the last one (the node is gone)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class WatchedNode(Protocol):
    """What the keeper reads of a running node (:class:`echo.node.worker.Node`), which owns
    the keeper: named here so that this module does not import the lease loop."""

    cfg: NodeConfig
    display: Display
    policy: PolicyFollower
    session: CoordinatorSession
    host: EchoHost | None
    identity: Identity
    engine_slot: EngineSlot
    done_groups: int

    @property
    def stats(self) -> Any: ...


class StatusKeeper:
    """Writes ``node``'s state to its data dir (see the module docstring); also what the local
    page serves (:meth:`snapshot`)."""

    def __init__(self, node: WatchedNode, ui_url: str = "") -> None:
        self.node = node
        self.path = status_path(node.cfg.data_dir)
        self.ui_url = ui_url
        self.started_at = time.time()
        self.pid = os.getpid()
        self.proc_start = _process_start(self.pid)
        self.stopped: str = ""  # why the node stopped, once it has
        self.checks: list[dict[str, Any]] = []  # doctor's local checks, run once at start
        self.credit: dict[str, Any] = {}

    def snapshot(self) -> dict[str, Any]:
        """The node's state now, as JSON-ready data (the file's and the page's contents)."""
        node = self.node
        stats, sync = node.stats, node.policy.sync
        job = (
            node.display.state.removeprefix("job ") if node.display.state.startswith("job ") else ""
        )
        reach = node.session.reachability
        fixes = [
            {"what": c["name"], "detail": c["detail"], "fix": c["fix"]}
            for c in self.checks
            if not c["ok"] and c["fix"]
        ]
        if reach is not None and not reach.reachable:
            from echo.node.doctor import reachability_check

            listen = node.host.listen_multiaddrs if node.host is not None else []
            fixes.append(
                {
                    "what": "reachability",
                    "detail": reach.verdict,
                    "fix": reachability_check(reach, listen).detail,
                }
            )
        for reason in sorted(stats.reasons):
            fixes.append(
                {
                    "what": f"rejected: {reason}",
                    "detail": f"{stats.reasons[reason]} groups",
                    "fix": reason_fix(reason),
                }
            )
        return {
            "schema": SCHEMA,
            "pid": self.pid,
            "process_start": self.proc_start,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "running": not self.stopped,
            "stopped": self.stopped,
            "node_id": node.identity.peer_id_str,
            "coordinator": node.cfg.coordinator,
            "software": ids.SOFTWARE,
            "engine": node.engine_slot.reported,
            "engine_reason": node.engine_slot.reason,
            "state": node.display.state,
            "job_id": job,
            "version": sync.version if sync is not None and sync.version >= 0 else None,
            "reachability": reach.verdict if reach is not None else None,
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "tokens": stats.tokens,
            "groups_done": node.done_groups,
            "accepted": stats.accepted,
            "rejected": stats.rejected,
            "rejected_by_reason": dict(stats.reasons),
            "recent_rejections": list(stats.recent_rejections),
            "last_error": node.display.last_error,
            "last_message": node.display.last_message,
            "fixes": fixes,
            "credit": self.credit,
            "ui": self.ui_url,
        }

    def write(self, snap: dict[str, Any] | None = None) -> None:
        try:
            write_atomically(self.path, snap or self.snapshot())
        except OSError as exc:  # a full disk must not stop the node
            self.node.display.say(f"[yellow]cannot write {self.path}:[/yellow] {exc}")

    @contextmanager
    def kept(self) -> Iterator[StatusKeeper]:
        """Write the state now, and once more on the way out with why the node stopped."""
        self.write()
        try:
            yield self
        except BaseException as exc:
            self.stopped = _why_stopped(exc)
            raise
        else:
            self.stopped = f"done: {self.node.done_groups} groups"
        finally:
            self.write()

    async def run(self) -> None:
        """Rewrite the file every WRITE_INTERVAL_S, and refresh the credit, until cancelled."""
        from echo.node.doctor import static_checks

        try:
            checks = await trio.to_thread.run_sync(static_checks, self.node.cfg)
            self.checks = [c.__dict__ for c in checks]
        except Exception as exc:  # noqa: BLE001 -- a failed check must not stop the node
            self.node.display.say(f"[yellow]the machine checks failed:[/yellow] {exc}")
        async with trio.open_nursery() as nursery:
            if self.node.cfg.api:
                nursery.start_soon(self._refresh_credit)
            while True:
                # Taken here, on trio's thread, which alone changes what it reads.
                snap = self.snapshot()
                await trio.to_thread.run_sync(self.write, snap)
                await trio.sleep(WRITE_INTERVAL_S)

    async def _refresh_credit(self) -> None:
        from echo.node.credit_view import CreditViewError, fetch_ledger
        from echo.protocol.credit import UCREDITS_PER_CREDIT

        cfg, me = self.node.cfg, self.node.identity.peer_id_str
        while True:
            try:
                with trio.fail_after(CREDIT_TIMEOUT_S):
                    got = await trio.to_thread.run_sync(
                        fetch_ledger, cfg.api, me, cfg.coordinator, abandon_on_cancel=True
                    )
                self.credit = {
                    "credits": got.ledger.total / UCREDITS_PER_CREDIT,
                    "entries": len(got.ledger.entries),
                    "verified": True,
                    "at": time.time(),
                    "error": "",
                }
            except (CreditViewError, trio.TooSlowError) as exc:
                self.credit = {**self.credit, "error": str(exc) or "timed out", "at": time.time()}
            await trio.sleep(CREDIT_INTERVAL_S)


def _why_stopped(exc: BaseException) -> str:
    from echo.node.errors import NodeError

    if isinstance(exc, BaseExceptionGroup):
        from echo.p2p.lifecycle import exception_leaves

        leaves = [e for e in exception_leaves(exc) if not isinstance(e, trio.Cancelled)]
        if not leaves:
            return "stopped (Ctrl-C or a stop signal)"
        exc = leaves[0]
    if isinstance(exc, trio.Cancelled | KeyboardInterrupt):
        return "stopped (Ctrl-C or a stop signal)"
    if isinstance(exc, NodeError):
        return f"error: {exc}"
    return f"crashed: {type(exc).__name__}: {exc}"


@dataclass
class ReadStatus:
    """What :func:`read_status` found: the file's data and whether its node runs now."""

    data: dict[str, Any]
    running: bool
    why: str  # how ``running`` was decided, in words
    age_s: float


class StatusFileError(RuntimeError):
    """No status file, or one that is not a node's; the message says what to do."""


def read_status(data_dir: Path, now: float | None = None) -> ReadStatus:
    """Read ``DATA_DIR/status.json`` and decide whether its node runs (see the module docstring).

    :raises StatusFileError: no file, too large, or not a node status.
    """
    path = status_path(data_dir)
    try:
        size = path.stat().st_size
        if size > MAX_STATUS_BYTES:
            raise StatusFileError(f"{path} is {size} bytes: not a node status file")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StatusFileError(
            f"no node has run with data dir {data_dir} (no {STATUS_FILE}): start one with "
            "echo-node join, or pass the --data-dir it uses"
        ) from None
    except (OSError, ValueError) as exc:
        raise StatusFileError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise StatusFileError(f"{path} is not a node status file (schema {SCHEMA})")
    now = time.time() if now is None else now
    age = now - float(data.get("updated_at", 0))
    if not data.get("running"):
        return ReadStatus(data, False, data.get("stopped") or "stopped", age)
    start = _process_start(int(data.get("pid", 0)))
    recorded = data.get("process_start")
    if start is None or recorded is None or abs(start - float(recorded)) > 1.0:
        return ReadStatus(
            data,
            False,
            "its process is gone without saying why: killed, or crashed hard (see the node's log)",
            age,
        )
    if age > STALE_AFTER_S:
        return ReadStatus(
            data, False, f"its process lives but has not reported for {age:.0f} s (stuck?)", age
        )
    return ReadStatus(data, True, "running", age)
