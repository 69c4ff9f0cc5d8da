# Sourced by scripts/demo and scripts/test: create (once) and activate the project's .venv.
# torch is pinned and installed before the project so that pip never resolves a CUDA build.
# The llamacpp extra (llama-cpp-python, built from source: about 4-5 minutes on 2 cores the first
# time, then from pip's wheel cache) is installed too so that its engine tests run; set
# ECHO_NO_LLAMACPP=1 on machines without a C/C++ toolchain to skip it (those tests then skip).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.echo-installed"
EXTRAS="dev,tasks"
if [ "${ECHO_NO_LLAMACPP:-0}" != "1" ]; then
    EXTRAS="dev,tasks,llamacpp"
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "[setup] installing torch==2.13.0 and the project [$EXTRAS] (first run only)" >&2
    python -m pip install -q --upgrade pip
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e "$ROOT[$EXTRAS]"
    touch "$STAMP"
elif [ "$EXTRAS" = "dev,tasks,llamacpp" ] \
    && ! python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llama_cpp') and u.find_spec('gguf')))"; then
    # A venv stamped before the llamacpp extra joined the default install.
    echo "[setup] installing the llamacpp extra (builds llama-cpp-python once, ~5 min)" >&2
    python -m pip install -q -e "$ROOT[$EXTRAS]"
fi
