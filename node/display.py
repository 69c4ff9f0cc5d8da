"""What the volunteer sees: timestamped lines, progress bars of large versions, running tallies.

:class:`Display` owns the node's console, its :class:`Stats` (groups accepted and rejected,
rejection reasons, tokens generated and the time generating them) and what the node is doing
(:attr:`Display.state`: ``"idle"`` with the reason, or the job it works for). It prints each
message with the time, shows a progress bar while a large version arrives (pulled whole, or
carried by the relay tree), and after a submission says what was rejected and why, with the
job's totals.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import trio
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.text import Text

from echo.p2p.relay import Transfer
from echo.protocol import messages as m

# Versions at least this large get a progress bar while they arrive (small patches take
# milliseconds; a bar per version would only flicker).
PROGRESS_MIN_BYTES = 16 << 20
RECENT_REJECTIONS = 20


@dataclass
class Stats:
    """The node's own tallies since it started (what its volunteer and the coordinator see)."""

    accepted: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    tokens: int = 0
    gen_seconds: float = 0.0
    # The latest rejections, newest last: {"at", "reason", "detail"} (status and the local page).
    recent_rejections: deque = field(default_factory=lambda: deque(maxlen=RECENT_REJECTIONS))

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of generation, throttling pauses included: what the node delivers
        on its current job (the coordinator's scheduler plans with it)."""
        return self.tokens / self.gen_seconds if self.gen_seconds else 0.0

    def new_job(self) -> None:
        """Start measuring the rate afresh: another job's model runs at another speed."""
        self.tokens, self.gen_seconds = 0, 0.0


class Display:
    """The node's console, its progress bars and its :class:`Stats` (see the module docstring)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.stats = Stats()
        self._bar: Progress | None = None  # of a large version being pulled
        self._bar_task = None
        self.state = "starting"  # "idle: <why>" or "job <id>"
        # What ``echo-node status`` shows: the last line said, and the last warning or error
        # (lines marked yellow or red), with their times.
        self.last_message: dict = {}
        self.last_error: dict = {}

    def idle(self, reason: str) -> None:
        """The node has nothing to do, for ``reason`` (shown once; the node polls meanwhile)."""
        self.state = f"idle: {reason}"
        self.say(f"[cyan]idle[/cyan] · {reason}")

    def working(self, job_id: str) -> None:
        """The node works for ``job_id`` from now on; its rate is measured afresh."""
        if self.state != f"job {job_id}":
            self.stats.new_job()
        self.state = f"job {job_id}"

    def say(self, text: str) -> None:
        """Print ``text`` (rich markup) to the volunteer, after the time of day."""
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")
        said = {"at": time.time(), "text": Text.from_markup(text).plain}
        self.last_message = said
        if text.startswith(("[yellow]", "[red]")):
            self.last_error = said

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=self.console,
            transient=True,
        )

    def pull_progress(self, version: int, done: int, total: int) -> None:
        """WeightSync's per-chunk callback: a bar for large versions pulled whole."""
        if total < PROGRESS_MIN_BYTES:
            return
        if self._bar is None:
            self._bar = self._progress()
            self._bar.start()
            self._bar_task = self._bar.add_task(f"policy v{version} (pull)", total=total)
        self._bar.update(
            self._bar_task, completed=done, total=total, description=f"policy v{version} (pull)"
        )
        if done >= total:
            self.close_bar()

    def close_bar(self) -> None:
        """Remove the bar of a pull that ended (done or failed); nothing if none is shown."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    async def relay_progress(self, t: Transfer, version: int) -> None:
        """Wait until the relay completes ``t`` (policy ``version``), with a bar if it is large.
        Unbounded: the caller sets the deadline."""
        if t.manifest.total_size < PROGRESS_MIN_BYTES:
            await t.done.wait()
            return
        with self._progress() as bar:
            task = bar.add_task(f"policy v{version} (relay)", total=t.manifest.total_size)
            while not t.done.is_set():
                have = sum(c.size for c, h in zip(t.manifest.chunks, t.have, strict=True) if h)
                bar.update(task, completed=have)
                with trio.move_on_after(0.25):
                    await t.done.wait()

    def show(self, reply: m.SubmitReply) -> None:
        """Count a submission's verdict; say why it was rejected, and every tenth acceptance (or
        any rejection) the job's totals for this node and its generation rate."""
        if reply.accepted:
            self.stats.accepted += 1
        else:
            self.stats.rejected += 1
            self.stats.reasons[reply.reason] += 1
            self.stats.recent_rejections.append(
                {"at": time.time(), "reason": reply.reason, "detail": reply.detail}
            )
            self.say(f"[red]rejected[/red] ({reply.reason}) {reply.detail}")
        if self.stats.accepted % 10 == 1 or not reply.accepted:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(reply.rejected_by_reason.items()))
            self.say(
                f"accepted {reply.accepted_total} · rejected "
                f"{reply.rejected_total}{' (' + reasons + ')' if reasons else ''} · "
                f"{self.stats.tokens_per_s:,.0f} tok/s"
            )
