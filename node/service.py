"""``echo-node service install``: run the node as a systemd user service.

The service runs ``echo-node join`` with the settings in effect when it was installed: those
settings (``--config`` file and flags together) are written to ``DATA_DIR/node.toml`` and the
unit starts ``PYTHON -m echo.node.cli join --config DATA_DIR/node.toml`` with the Python that
installed it, so the service uses the same environment and the same identity key (in the data
dir) after every restart. systemd restarts the node when it fails (a crash, an error exit), but
not after a bad configuration (exit 2), which a restart cannot fix; a node stopped with
``systemctl --user stop`` stays stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from echo.node.config import NodeConfig

UNIT_NAME = "echo-node.service"
RESTART_SEC = 10
# The node finishes relaying the version in hand for up to 30 s when stopped (FINAL_FORWARD_S).
STOP_TIMEOUT_S = 45


def unit_dir() -> Path:
    """Where systemd looks for the user's units."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    # A JSON string is a valid TOML basic string (the same escapes).
    return json.dumps(str(v))


def config_toml(cfg: NodeConfig) -> str:
    """``cfg`` as a node.toml that loads back to the same settings (unset ones left out)."""
    lines = ["# Written by echo-node service install: the settings the service runs with."]
    for name, value in cfg.model_dump().items():
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _quote(arg: str) -> str:
    """One ExecStart argument as systemd reads it: specifiers (%) and variables ($) doubled, and
    quoted when it holds blanks, quotes or backslashes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in arg):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def unit_text(config_path: Path, node_id: str, python: str | None = None) -> str:
    """The unit that runs ``echo-node join --config config_path`` with ``python``."""
    argv = [python or sys.executable, "-m", "echo.node.cli", "join", "--config", str(config_path)]
    return f"""\
[Unit]
Description=Echo swarm volunteer node {node_id}
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart={" ".join(_quote(a) for a in argv)}
Environment=PYTHONUNBUFFERED=1
Restart=on-failure
RestartSec={RESTART_SEC}
# Exit 2 is a bad setting: restarting cannot fix it.
RestartPreventExitStatus=2
TimeoutStopSec={STOP_TIMEOUT_S}
# Keep the machine responsive for its owner.
Nice=10

[Install]
WantedBy=default.target
"""


def has_systemd() -> bool:
    """Whether this machine runs systemd with a user manager to hand the unit to."""
    return shutil.which("systemctl") is not None and Path("/run/systemd/system").is_dir()


def install(cfg: NodeConfig, node_id: str) -> tuple[Path, Path]:
    """Write ``DATA_DIR/node.toml`` and the unit; returns their paths. Existing files are
    replaced (installing again is how settings change)."""
    cfg = cfg.model_copy(update={"data_dir": cfg.data_dir.resolve()})
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    config_path = cfg.data_dir / "node.toml"
    config_path.write_text(config_toml(cfg))
    target = unit_dir()
    target.mkdir(parents=True, exist_ok=True)
    unit_path = target / UNIT_NAME
    unit_path.write_text(unit_text(config_path, node_id))
    return config_path, unit_path
