"""The demo's background llama.cpp build watcher (echo.tools.late_build): the swarm starts a
llama.cpp node once the build process has ended and the binding imports."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo.tools import late_build
from echo.tools.late_build import LateBuild, build_running


def test_a_missing_or_stale_pid_file_is_no_build(tmp_path: Path) -> None:
    pid_file = tmp_path / late_build.PID_FILE
    assert not build_running(pid_file)
    pid_file.write_text("not a pid")
    assert not build_running(pid_file)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    pid_file.write_text(str(done.pid))
    assert not build_running(pid_file)


def test_the_watcher_waits_for_the_build_then_says_done(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("llama_cpp")  # done() asks this interpreter to import the binding
    monkeypatch.setattr(late_build, "CHECK_EVERY_S", 0.0)
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    (tmp_path / late_build.PID_FILE).write_text(str(build.pid))
    watcher = LateBuild(tmp_path)
    assert build_running(watcher.pid_file)
    assert not watcher.done()
    assert "building llama.cpp in the background" in watcher.line()
    build.wait()
    deadline = time.time() + 60
    while not watcher.done():
        assert time.time() < deadline and not watcher.failed
        time.sleep(0.2)
    assert not watcher.failed


def test_a_build_that_ends_without_the_binding_is_a_failure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(late_build, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(late_build, "llamacpp_importable", lambda python=sys.executable: False)
    watcher = LateBuild(tmp_path)  # no pid file: the build has ended
    assert not watcher.done()
    assert watcher.failed
    assert str(tmp_path / late_build.LOG_FILE) in watcher.line()
    assert "failed" in watcher.line()


def test_nothing_to_watch_when_the_binding_already_imports(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / late_build.PID_FILE).write_text(str(sleeper.pid))
        assert LateBuild.watch(tmp_path) is None
    finally:
        sleeper.kill()
        sleeper.wait()
