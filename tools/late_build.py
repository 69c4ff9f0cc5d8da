"""The llama.cpp engine built in the background while the demo runs, and its node's late join.

On a fresh machine, building llama-cpp-python from source takes about 5 minutes on 2 cores: most
of the first run's wait. ``scripts/demo`` therefore installs the project without it, starts the
build in the background (``scripts/_venv.sh``: the build's pid in ``.venv/llamacpp-build.pid``,
its output in ``.venv/llamacpp-build.log``, never on the terminal), and runs the swarm with torch
nodes; :class:`LateBuild` tells the local swarm when the build is done, and the swarm then starts a
llama.cpp node, which joins the running job the way any late volunteer does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

PID_FILE = "llamacpp-build.pid"
LOG_FILE = "llamacpp-build.log"
# How often the swarm's loop looks at the build: a check is one kill(0) and, once the build
# process is gone, one import in a child process.
CHECK_EVERY_S = 5.0


def build_running(pid_file: Path) -> bool:
    """Whether the process named in ``pid_file`` is alive (a missing or stale file: no)."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def llamacpp_importable(python: str = sys.executable) -> bool:
    """Whether ``python`` can import llama.cpp's binding and gguf: asked of a child process,
    since this one has already looked and the answer would be cached."""
    probe = "import llama_cpp, gguf"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0


class LateBuild:
    """A background llama.cpp build the swarm waits for (see the module docstring)."""

    def __init__(self, venv: Path) -> None:
        self.pid_file = venv / PID_FILE
        self.log = venv / LOG_FILE
        self.started = time.time()
        self._next_check = 0.0
        self.failed = False

    @classmethod
    def watch(cls, venv: Path) -> LateBuild | None:
        """A watcher when a build is running in ``venv`` and llama.cpp is not importable yet;
        None otherwise (nothing to wait for)."""
        importlib.invalidate_caches()
        if importlib.util.find_spec("llama_cpp") is not None:
            return None
        if not build_running(venv / PID_FILE):
            return None
        return cls(venv)

    def done(self) -> bool:
        """True once the build has finished and llama.cpp imports; a build that ended without
        it sets :attr:`failed` (the swarm carries on with the nodes it has)."""
        now = time.time()
        if self.failed or now < self._next_check:
            return False
        self._next_check = now + CHECK_EVERY_S
        if build_running(self.pid_file):
            return False
        if llamacpp_importable():
            return True
        self.failed = True
        return False

    def line(self) -> str:
        """What the live view says about the build while it runs."""
        if self.failed:
            return f"the llama.cpp build failed: see {self.log}"
        return (
            f"building llama.cpp in the background ({time.time() - self.started:.0f} s; "
            f"log {self.log}): a llama.cpp node joins when it is done"
        )
