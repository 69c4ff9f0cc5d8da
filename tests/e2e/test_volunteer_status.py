"""The volunteer's own view against a live local swarm (issue 31): a real coordinator and a real
``echo-node join --ui-port 0 --api ...`` process; ``echo-node status`` read from another process
while the node runs, its local page, and the status after the node is stopped, checked against
what the coordinator's API reports for the node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from echo.tools.swarm import Swarm, job_toml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# A node importing torch and fetching v0 on a loaded 2-core machine: up to ~2 minutes.
START_S = 240.0


def _status(data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo.node.cli", "status", "--data-dir", str(data_dir), *extra],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "240"},  # one line each, as asserted
    )


def _wait(what: str, predicate, timeout: float = START_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def _file(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_status_and_local_page_of_a_live_node(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path)
    try:
        info = swarm.start_coordinator()
        http = info["http"][0]
        job_id = swarm.submit(job_toml("status", steps=6, batch_groups=4, warmup=0, eval_every=3))
        data = tmp_path / "n0"
        node = swarm.start_node(
            "n0", ["--threads", "1", "--engine", "torch", "--ui-port", "0", "--api", http]
        )
        first = _wait("accepted groups", lambda: (s := _file(data)) and s["accepted"] >= 2 and s)
        assert first["running"] and first["pid"] == node.pid and first["engine"] == "torch"
        assert first["job_id"] == job_id and first["version"] is not None

        # From another process, while the node runs.
        out = _status(data)
        assert out.returncode == 0, out.stderr
        assert f"node {first['node_id']} · running (pid {node.pid}" in out.stdout
        assert "engine torch" in out.stdout and f"doing: job {job_id}" in out.stdout
        assert first["ui"].startswith("http://127.0.0.1:")
        assert f"local page: {first['ui']}" in out.stdout

        # The local page serves the same state, on loopback only.
        page = httpx.get(first["ui"], timeout=10)
        assert page.status_code == 200 and "Echo node" in page.text
        live = httpx.get(first["ui"] + "status.json", timeout=10).json()
        assert live["node_id"] == first["node_id"] and live["accepted"] >= first["accepted"]
        rebound = httpx.get(first["ui"] + "status.json", headers={"Host": "evil.example"})
        assert rebound.status_code == 403

        st, trace = swarm.wait_finished(job_id, stall_s=120, cap_s=600)
        assert st["status"] == "done", (st, trace)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0

        out = _status(data, "--json")
        assert out.returncode == 3, out.stderr
        final = json.loads(out.stdout)
        assert not final["running"] and final["why"] == "stopped (Ctrl-C or a stop signal)"
        _wait("the page to close", lambda: _page_down(first["ui"]), 30)
        row = httpx.get(f"{http}/v1/public/nodes/{final['node_id']}", timeout=10).json()
        assert (final["accepted"], final["rejected"]) == (row["accepted"], row["rejected"])

        credit = httpx.get(f"{http}/v1/credit/{final['node_id']}", timeout=10).json()
        assert credit["credits"] > 0  # six trained versions, all from this one node
        out = _status(data, "--api", http, "--coordinator", swarm.maddr)
        assert out.returncode == 3, out.stderr
        assert "not running: stopped (Ctrl-C or a stop signal)" in out.stdout
        assert f"credit: {credit['credits']:.6f} in {credit['entries_total']} entries" in out.stdout
        assert f"groups: {row['accepted']} accepted · {row['rejected']} rejected" in out.stdout
    finally:
        swarm.stop()


def _page_down(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return True
    return False
