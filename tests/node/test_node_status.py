"""The node's status file and its reader, the local page's guard, and the systemd unit that
``echo-node service install`` writes (checked by systemd-analyze where it is installed). The
live path, a real node read by ``echo-node status``, is tests/e2e/test_volunteer_status.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo.node import service, state
from echo.node.config import NodeConfig, load_node_config
from echo.node.state import StatusFileError, read_status, write_atomically
from echo.node.ui import local_host

COORD = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWLnk7yEFHCgYuzGb8SxH4SWNysEJEgmzfS8VL6pGnkZpW"


def _file(tmp: Path, **over) -> dict:
    me = os.getpid()
    data = {
        "schema": state.SCHEMA, "pid": me, "process_start": state._process_start(me),
        "updated_at": time.time(), "running": True, "stopped": "", **over,
    }
    write_atomically(tmp / state.STATUS_FILE, data)
    return data


def test_a_live_process_with_a_fresh_file_is_running(tmp_path: Path) -> None:
    _file(tmp_path)
    got = read_status(tmp_path)
    assert got.running and got.why == "running"
    assert [p.name for p in tmp_path.iterdir()] == [state.STATUS_FILE]  # no temporary left


def test_a_killed_node_is_not_running(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _file(tmp_path, pid=gone.pid, process_start=time.time() - 5)
    got = read_status(tmp_path)
    assert not got.running and "process is gone" in got.why


def test_a_reused_pid_is_not_the_node(tmp_path: Path) -> None:
    # Our own live pid, but started at another time than the file says: another program.
    _file(tmp_path, process_start=state._process_start(os.getpid()) - 100)
    assert not read_status(tmp_path).running


def test_a_stuck_node_and_a_stopped_one(tmp_path: Path) -> None:
    _file(tmp_path, updated_at=time.time() - state.STALE_AFTER_S - 5)
    got = read_status(tmp_path)
    assert not got.running and "has not reported" in got.why
    _file(tmp_path, running=False, stopped="error: cannot reach the job's learner")
    got = read_status(tmp_path)
    assert not got.running and got.why == "error: cannot reach the job's learner"


def test_missing_foreign_and_oversized_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(StatusFileError, match="no node has run with data dir"):
        read_status(tmp_path)
    (tmp_path / state.STATUS_FILE).write_text(json.dumps({"schema": 99}))
    with pytest.raises(StatusFileError, match="not a node status file"):
        read_status(tmp_path)
    (tmp_path / state.STATUS_FILE).write_text("{" * 10)
    with pytest.raises(StatusFileError, match="cannot read"):
        read_status(tmp_path)
    (tmp_path / state.STATUS_FILE).write_bytes(b" " * (state.MAX_STATUS_BYTES + 1))
    with pytest.raises(StatusFileError, match="not a node status file"):
        read_status(tmp_path)


def test_status_cli_exit_codes(tmp_path: Path) -> None:
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "echo.node.cli", "status", "--data-dir", str(tmp_path),
             "--json"], capture_output=True, text=True, timeout=120,
        )

    assert run().returncode == 2
    _file(tmp_path, running=False, stopped="done: 4 groups")
    out = run()
    assert out.returncode == 3 and json.loads(out.stdout)["why"] == "done: 4 groups"


@pytest.mark.parametrize(
    ("host", "ok"),
    [("127.0.0.1:8710", True), ("localhost:8710", True), ("[::1]:8710", True),
     ("LOCALHOST", True), ("evil.example:8710", False), ("127.0.0.1.evil.example", False),
     ("", False)],
)
def test_the_page_answers_loopback_names_only(host: str, ok: bool) -> None:
    assert local_host(host) is ok


def test_every_rejection_reason_has_advice() -> None:
    from echo.protocol import reasons as R

    codes = [v for k, v in vars(R).items() if k.isupper() and isinstance(v, str)]
    assert codes and all(state.reason_fix(c) for c in codes)


def test_service_config_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    cfg = NodeConfig(coordinator=COORD, data_dir=tmp_path / "d", threads=3, ui_port=8710,
                     schedule="22:00-07:00", api="http://127.0.0.1:8000", max_tokens_per_s=50.5)
    config_path, unit_path = _install(tmp_path, cfg)
    assert load_node_config(config_path, {}) == cfg
    assert unit_path == tmp_path / "xdg" / "systemd" / "user" / "echo-node.service"


def _install(tmp: Path, cfg: NodeConfig) -> tuple[Path, Path]:
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    try:
        return service.install(cfg, "12D3KooWnode")
    finally:
        if old is None:
            del os.environ["XDG_CONFIG_HOME"]
        else:
            os.environ["XDG_CONFIG_HOME"] = old


def test_unit_runs_join_with_the_saved_config_and_restarts_on_failure(tmp_path: Path) -> None:
    cfg_path = tmp_path / "my data 100%" / "node.toml"
    text = service.unit_text(cfg_path, "12D3KooWnode", python="/opt/py/bin/python")
    lines = text.splitlines()
    assert (
        'ExecStart=/opt/py/bin/python -m echo.node.cli join --config '
        f'"{tmp_path}/my data 100%%/node.toml"'
    ) in lines
    for want in ("Restart=on-failure", "RestartPreventExitStatus=2", "WantedBy=default.target"):
        assert want in lines


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    cfg = NodeConfig(coordinator=COORD, data_dir=tmp_path / "with space")
    config_path, _ = _install(tmp_path, cfg)
    unit = tmp_path / service.UNIT_NAME
    unit.write_text(service.unit_text(config_path, "12D3KooWnode"))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60)
    # It exits 0 on warnings too: any line about our file is a unit it would misread.
    assert out.returncode == 0 and str(unit) not in out.stderr + out.stdout, out.stderr
    bad = tmp_path / "bad.service"
    bad.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    out = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert str(bad) in out.stderr  # the check above can fail


def test_a_nodes_rejections_problems_and_failure_reach_its_status(tmp_path: Path) -> None:
    """A real Node (not started: no network needed) through its real Display and StatusKeeper:
    a rejection with its reason and advice, the last problem it printed, and a NodeError that
    stops it, as ``echo-node status`` shows them."""
    from rich.console import Console

    from echo.node.errors import NodeError
    from echo.node.state import StatusKeeper
    from echo.node.status_view import show_status
    from echo.node.worker import Node
    from echo.protocol import messages as m
    from echo.protocol import reasons as R

    node = Node(NodeConfig(coordinator=COORD, data_dir=tmp_path, engine="torch"),
                Console(file=open(os.devnull, "w")))  # noqa: SIM115 -- the node's own console
    node.display.show(m.SubmitReply(accepted=True, reason="ok"))
    node.display.show(m.SubmitReply(accepted=False, reason=R.STALE_VERSION,
                                    detail="v3 is older than the window (v7-2)"))
    node.display.say("[yellow]lease request failed:[/yellow] stream reset")
    node.display.say("registered · job demo at v7")
    keeper = StatusKeeper(node)
    with pytest.raises(NodeError), keeper.kept():
        snap = read_status(tmp_path)
        assert snap.running and snap.data["accepted"] == 1 and snap.data["rejected"] == 1
        raise NodeError("the coordinator excluded this node: too many failures")
    got = read_status(tmp_path)
    assert not got.running
    assert got.why == "error: the coordinator excluded this node: too many failures"
    d = got.data
    assert d["rejected_by_reason"] == {R.STALE_VERSION: 1}
    assert [(r["reason"], r["detail"]) for r in d["recent_rejections"]] == [
        (R.STALE_VERSION, "v3 is older than the window (v7-2)")]
    assert {"what": "rejected: stale_version", "detail": "1 groups",
            "fix": state.reason_fix(R.STALE_VERSION)} in d["fixes"]
    assert d["last_error"]["text"] == "lease request failed: stream reset"
    assert d["last_message"]["text"] == "registered · job demo at v7"

    shown = Console(record=True, width=240, file=open(os.devnull, "w"))  # noqa: SIM115
    show_status(shown, got)
    text = shown.export_text()
    assert "not running: error: the coordinator excluded this node: too many failures" in text
    assert "groups: 1 accepted · 1 rejected (stale_version 1)" in text
    assert "last problem" in text and "lease request failed: stream reset" in text
    assert "stale_version" in text and "v3 is older than the window (v7-2)" in text
    assert "lower --leases-at-once" in " ".join(text.split())  # the advice, however wrapped


def test_a_taken_ui_port_stops_join_with_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "echo.node.cli", "join", "--coordinator", COORD,
             "--data-dir", str(tmp_path), "--engine", "torch", "--ui-port", str(port)],
            capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": "240"},
        )
    want = f"cannot serve the status page on 127.0.0.1:{port} (Address already in use)"
    assert out.returncode == 1 and want in out.stderr, out.stderr[-2000:]
    got = read_status(tmp_path)
    assert not got.running and got.why.startswith(f"error: {want}")
