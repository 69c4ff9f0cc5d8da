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
from echo.tools.attackers.launch import Fleet
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


def test_cpu_and_placement_of_an_idle_pinned_process_tree() -> None:
    """What attack.py reports of the attackers: a tree's CPU (a spinning grandchild's counted),
    its scheduling policy and its cores; :func:`swarm_probe.cpu_pct` between snapshots."""
    core = max(os.sched_getaffinity(0))
    spin = "import time; t = time.time()\nwhile time.time() - t < 1.0: pass\ntime.sleep(30)"
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {spin!r}]); time.sleep(30)"
    )

    def idle_on_core() -> None:
        os.sched_setaffinity(0, {core})
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    tree = subprocess.Popen([sys.executable, "-c", parent], preexec_fn=idle_on_core)
    try:
        me = psutil.Process(os.getpid())
        before = swarm_probe.cpu_snapshot(me, [], [tree.pid], {core})
        deadline = time.time() + 30
        while len(psutil.Process(tree.pid).children()) < 1 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # the grandchild has spun its second (on a busy core: at least part)
        placed = swarm_probe.placement([tree.pid])
        assert placed == {"processes": 2, "sched_idle": 2, "cores": [core]}
        after = swarm_probe.cpu_snapshot(me, [], [tree.pid], {core})
        pct = swarm_probe.cpu_pct(before, after)
        assert pct["attackers_cpu_pct"] > 5.0  # the grandchild's spinning, through its parent
        assert pct["honest_nodes_cpu_pct"] == 0.0 and pct["learner_cpu_pct"] == 0.0
        assert pct["swarm_cores_busy_pct"] >= pct["attackers_cpu_pct"] - 1.0
        assert swarm_probe.placement([2**22 + 1]) == {"processes": 0, "sched_idle": 0, "cores": []}
    finally:
        for proc in psutil.Process(tree.pid).children(recursive=True):
            proc.kill()
        tree.kill()
        tree.wait()
