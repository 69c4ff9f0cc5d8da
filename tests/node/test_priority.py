"""A node lowers its own CPU priority (echo.node.priority), in a child process each time: a
process cannot raise its priority back, so the test's own must stay as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from echo.node import priority
from echo.node.config import NodeConfig
from echo.node.priority import session_group_nice
from echo.protocol.jobspec import SpecError

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")

PROBE = """
import json, os, sys, threading
from echo.node.priority import session_group_nice, yield_cpu

start = int(sys.argv[2])
if start:
    os.nice(start)
early = threading.Event()
threading.Thread(target=early.wait, daemon=True).start()  # running before the call
done = yield_cpu(int(sys.argv[1]))
late = {}
t = threading.Thread(target=lambda: late.setdefault("nice", os.getpriority(os.PRIO_PROCESS, 0)))
t.start(); t.join()
nices = []
for tid in os.listdir("/proc/self/task"):
    try:
        nices.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
    except ProcessLookupError:  # a thread of the interpreter's that ended meanwhile
        pass
print(json.dumps({
    "done": done,
    "threads": sorted(set(nices)),
    "n_threads": len(nices),
    "late": late["nice"],
    "autogroup": session_group_nice(),
}))
"""


def _probe(nice: int, start: int = 0, own_session: bool = True) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(nice), str(start)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=own_session,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _autogroups() -> bool:
    p = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return p.exists() and p.read_text().strip() == "1"


def test_every_thread_and_its_session_group_are_lowered():
    got = _probe(7)
    assert got["n_threads"] >= 2
    assert got["threads"] == [7], "a thread already running kept its priority"
    assert got["late"] == 7, "a thread started afterwards did not inherit it"
    if _autogroups():
        assert got["done"] == ["threads", "autogroup"]
        assert got["autogroup"] == 7
    else:
        assert got["done"] == ["threads"]


def test_a_shell_started_node_leaves_the_shells_group_alone():
    ours = session_group_nice()
    got = _probe(7, own_session=False)
    assert got["threads"] == [7]
    assert got["done"] == ["threads"]
    assert got["autogroup"] == ours


def test_a_process_in_the_kernels_default_group_reads_no_group(tmp_path, monkeypatch):
    """A process whose ancestry never called setsid (some containers) is in the default group,
    whose file reads empty: that is no group of ours, not an error (CI hit it as IndexError)."""
    enabled, group = tmp_path / "enabled", tmp_path / "autogroup"
    enabled.write_text("1\n")
    group.write_text("")
    monkeypatch.setattr(priority, "AUTOGROUP_ENABLED", enabled)
    monkeypatch.setattr(priority, "AUTOGROUP", group)
    assert session_group_nice() is None
    group.write_text("/autogroup-9 nice 3\n")
    assert session_group_nice() == 3
    enabled.write_text("0\n")
    assert session_group_nice() is None


def test_never_raises_a_priority_and_zero_changes_nothing():
    got = _probe(5, start=12)
    assert got["threads"] == [12]
    # The session's group was still at 0: that one is lowered.
    assert got["done"] == (["autogroup"] if _autogroups() else [])
    got = _probe(0)
    assert got["done"] == []
    assert got["threads"] == [os.getpriority(os.PRIO_PROCESS, 0)]


def test_config_default_and_bounds():
    assert NodeConfig().nice == 10
    from echo.node.config import load_node_config

    with pytest.raises(SpecError, match="nice"):
        load_node_config(None, {"nice": 20})
    with pytest.raises(SpecError, match="nice"):
        load_node_config(None, {"nice": -1})
