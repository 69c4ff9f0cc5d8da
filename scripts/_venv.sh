# Sourced by scripts/demo and scripts/test: create (once) and activate the project's .venv.
# torch is pinned and installed before the project so that pip never resolves a CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.echo-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "[setup] installing torch==2.13.0 and the project (first run only)" >&2
    python -m pip install -q --upgrade pip
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e "$ROOT[dev]"
    touch "$STAMP"
fi
