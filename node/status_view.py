"""``echo-node status``: what the node is doing, read from its status file, in the terminal."""

from __future__ import annotations

import datetime
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from echo.node.state import ReadStatus, reason_fix


def _ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def show_status(
    console: Console,
    got: ReadStatus,
    credit: dict[str, Any] | None = None,
    now: float | None = None,
) -> None:
    """Print the node's state: ``credit`` (fetched now) wins over the one the node last saw."""
    d, now = got.data, time.time() if now is None else now
    if got.running:
        head = f"[green]running[/green] (pid {d['pid']}, reported {_ago(d['updated_at'], now)})"
    else:
        head = (
            f"[red]not running[/red]: {escape(got.why)} (last report {_ago(d['updated_at'], now)})"
        )
    console.print(f"node {d['node_id']} · {head}")
    console.print(
        f"software {d['software']} · engine {d['engine']} ({escape(d['engine_reason'])}) · "
        f"coordinator {d['coordinator']}"
    )
    version = "none yet" if d["version"] is None else f"v{d['version']}"
    doing = d["state"] if got.running else f"was: {d['state']}"
    console.print(
        f"doing: {escape(doing)} · policy version held {version} · "
        f"{d['tokens_per_s']:,.1f} tokens/s · reachability {d['reachability'] or 'unknown'}"
    )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(d["rejected_by_reason"].items()))
    console.print(
        f"groups: {d['accepted']} accepted · {d['rejected']} rejected"
        f"{' (' + reasons + ')' if reasons else ''} · since {_ago(d['started_at'], now)}"
    )
    c = credit if credit is not None else d.get("credit") or {}
    if "credits" in c:
        when = "now" if credit is not None else _ago(c["at"], now)
        console.print(
            f"credit: [bold]{c['credits']:.6f}[/bold] in {c['entries']} entries, every one "
            f"signed by the coordinator and verified ({when})"
        )
    elif c.get("error"):
        console.print(f"credit: [yellow]unavailable[/yellow]: {escape(c['error'])}")
    else:
        console.print("credit: pass --api http://HOST:PORT (the coordinator's HTTP address)")
    err = d.get("last_error") or {}
    if err.get("text"):
        console.print(
            f"[yellow]last problem[/yellow] ({_ago(err['at'], now)}): {escape(err['text'])}"
        )
    if d["recent_rejections"]:
        t = Table(
            "when", "reason", "detail", "what to do", title="latest rejections (earn nothing)"
        )
        for r in reversed(d["recent_rejections"][-5:]):
            t.add_row(_ago(r["at"], now), r["reason"], escape(r["detail"]), reason_fix(r["reason"]))
        console.print(t)
    fixes = [f for f in d["fixes"] if not f["what"].startswith("rejected: ")]
    if fixes:
        console.print("what to fix (the checks of echo-node doctor):")
        for f in fixes:
            console.print(f"  {f['what']}: {escape(f['detail'])}\n    fix: {escape(f['fix'])}")
    if d.get("ui") and got.running:
        console.print(f"local page: {d['ui']}")
