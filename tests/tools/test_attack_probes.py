"""The attack benchmark's readings outside the swarm: the timed node's files read back by time
window (tools/timed_node.py), a process's waits for a core and its children
(tools/swarm_probe.py), and the attackers' counters (tools/attackers/launch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from echo.tools import swarm_probe
from echo.tools.attackers.launch import AUTOGROUP_NICE, Fleet, _lowest_autogroup
from echo.tools.timed_node import grants, rpc_times


def test_timed_calls_and_grants_are_read_by_window(tmp_path: Path) -> None:
    (tmp_path / "11.txt").write_text("100.0 0.010 lease\n105.0 0.500 submit\n120.0 0.020 lease\n")
    (tmp_path / "12.txt").write_text("101.0 0.030 lease\n")
    (tmp_path / "11.grants").write_text("100.0 2 -\n104.0 0 update\n106.0 0 update\n130.0 0 x\n")
    assert sorted(rpc_times(tmp_path, "lease", [(99.0, 110.0)])) == [0.010, 0.030]
    assert rpc_times(tmp_path, "lease", [(99.0, 100.5), (119.0, 121.0)]) == [0.010, 0.020]
    assert rpc_times(tmp_path, "submit", [(106.0, 200.0)]) == []
    assert grants(tmp_path, (99.0, 110.0)) == (2, {"update": 2})


def test_run_queue_waits_and_children_of_a_real_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = psutil.Process(os.getpid())
        assert swarm_probe.learner(me) is None  # a child, but not a learner
        assert swarm_probe.sandbox_cpu(me) == {}
        before = swarm_probe.runq_wait_s(os.getpid())
        assert before >= 0.0
        assert swarm_probe.runq_wait_s(os.getpid()) >= before
        assert swarm_probe.runq_wait_s(2**22 + 1) == 0.0  # no such process
    finally:
        child.kill()
        child.wait()


def test_attacker_counters_skip_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "attack-churn.json").write_text(json.dumps({"identities": 3}))
    (tmp_path / "attack-junk.json").write_text("{half")  # being written
    fleet = Fleet(tmp_path, "/ip4/127.0.0.1/tcp/1/p2p/x", "j", [], tmp_path)
    assert fleet.stats() == {"churn": {"identities": 3}}
    assert fleet.dead() == []


def _tree(child_code: str, **popen) -> subprocess.Popen:
    """A process that starts one child running ``child_code`` and sleeps."""
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}]); time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", parent], **popen)


def _kill(tree: subprocess.Popen) -> None:
    for proc in psutil.Process(tree.pid).children(recursive=True):
        proc.kill()
    tree.kill()
    tree.wait()


def test_cpu_of_a_process_tree_counts_its_grandchildren() -> None:
    """What attack.py reports of each part: a tree's CPU between two snapshots, a spinning
    grandchild's included (:func:`swarm_probe.cpu_pct`)."""
    spin = "import time\nwhile time.process_time() < 0.3: pass\ntime.sleep(60)"
    me = psutil.Process(os.getpid())
    cores = os.sched_getaffinity(0)
    before = swarm_probe.cpu_snapshot(me, [], [], cores)
    tree = _tree(spin)
    try:
        deadline = time.time() + 30
        while swarm_probe.tree_cpu_s([tree.pid]) < 0.3 and time.time() < deadline:
            time.sleep(0.1)
        after = swarm_probe.cpu_snapshot(me, [tree.pid], [], cores)
        seconds = after["time"][-1] - before["time"][-1]
        pct = swarm_probe.cpu_pct(before, after)
        # Started after the first snapshot: counted from 0, its grandchild's 0.3 s included.
        assert pct["honest_nodes_cpu_pct"] * seconds / 100 >= 0.3
        assert pct["attackers_cpu_pct"] == 0.0 and pct["learner_cpu_pct"] == 0.0
        assert pct["swarm_cores_busy_pct"] >= pct["honest_nodes_cpu_pct"] - 5.0
    finally:
        _kill(tree)


def test_placement_of_an_attacker_tree() -> None:
    """Started as the attackers are (tools/attackers/launch.py): pinned, SCHED_IDLE, a session
    of its own whose autogroup is at the lowest weight; its child inherits all of it."""
    core = max(os.sched_getaffinity(0))

    def as_an_attacker() -> None:
        os.sched_setaffinity(0, {core})
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _lowest_autogroup()

    tree = _tree("import time; time.sleep(60)", preexec_fn=as_an_attacker, start_new_session=True)
    try:
        deadline = time.time() + 30
        while not psutil.Process(tree.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        placed = swarm_probe.placement([tree.pid])
        nice = [AUTOGROUP_NICE] if Path("/proc/self/autogroup").exists() else []
        assert placed == {"processes": 2, "sched_idle": 2, "cores": [core], "autogroup_nice": nice}
        nobody = {"processes": 0, "sched_idle": 0, "cores": [], "autogroup_nice": []}
        assert swarm_probe.placement([2**22 + 1]) == nobody
    finally:
        _kill(tree)
