#!/usr/bin/env bash
# One-shot check of the vLLM engine on an NVIDIA GPU with the CUDA vllm wheel: the engine tests
# (parity with transformers, exact weights through a version chain, termination, seeding) and
# timings (vLLM tokens/s through the node path vs direct calls, time to apply a version).
#
#   scripts/gpu_check.sh          # results in $OUT if set, else runs/gpu_check
#
# Python: $ECHO_VLLM_PYTHON if set (vllm for CUDA and this project importable), else
# .venv-vllm-gpu made by scripts/vllm_env.sh with the CUDA wheel (needs the package registry).
# Files: env.txt (GPU, versions), test_vllm_engine.txt, engines.txt and engines.json (the
# benchmark's JSON line: tokens_per_s_vllm, node_tokens_per_s_vllm, direct_tokens_per_s_vllm,
# overhead_vllm, apply[].vllm_load_version_s), summary.txt. Exit status: non-zero if a step failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RES"
PY="${ECHO_VLLM_PYTHON:-}"
if [ -z "$PY" ]; then
    # The CUDA wheel brings its own torch (2.14.0) and transformers; keep torchvision & co.
    if ! ECHO_VLLM_VENV="$ROOT/.venv-vllm-gpu" ECHO_VLLM_REQ="vllm==0.33.0" ECHO_VLLM_TORCH="" \
        ECHO_VLLM_TRANSFORMERS="" ECHO_VLLM_REMOVE="" bash scripts/vllm_env.sh >"$RES/setup.txt" 2>&1; then
        echo "setup failed: see $RES/setup.txt" | tee "$RES/summary.txt"
        exit 1
    fi
    PY="$ROOT/.venv-vllm-gpu/bin/python"
fi
{
    nvidia-smi
    "$PY" -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
} >"$RES/env.txt" 2>&1

"$PY" -m pytest tests/test_vllm_engine.py -q -rA -s -p no:cacheprovider >"$RES/test_vllm_engine.txt" 2>&1
tests_rc=$?
"$PY" benchmarks/engines.py --quick --engines vllm >"$RES/engines.txt" 2>&1
bench_rc=$?
tail -n 1 "$RES/engines.txt" >"$RES/engines.json"
{
    echo "tests rc=$tests_rc: $(grep -E "[0-9]+ (passed|failed|error)" "$RES/test_vllm_engine.txt" | tail -n 1)"
    grep -E "worst \|logprob|vLLM start" "$RES/test_vllm_engine.txt"
    echo "benchmark rc=$bench_rc"
    grep -E "^  (vllm|h[0-9])" "$RES/engines.txt"
} | tee "$RES/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
