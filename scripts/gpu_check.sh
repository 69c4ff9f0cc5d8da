#!/usr/bin/env bash
# One-shot check of the learner on an NVIDIA GPU, for a machine with a CUDA torch and
# transformers but no package index (what the project needs beyond them comes as wheels in .whl/,
# fetched beforehand by scripts/gpu_wheels.sh; the project is put on the path as it is).
#
#   scripts/gpu_check.sh        # results in $OUT if set, else runs/gpu_check
#
# ECHO_GPU_PYTHON: the interpreter (python3); ECHO_GPU_DEVICE: the device (cuda; cpu rehearses
# the script anywhere); ECHO_GPU_WHEELS=0: skip the wheels (an interpreter that has them).
#
# Steps, each with a time limit (together under 9 minutes), each logged to its own file, each
# adding its lines to summary.txt as it ends (a run cut short still says how far it got):
#   env.txt          the GPU and the versions
#   tests.txt        tests/models/test_devices.py on the device: a step against the CPU's, the prefill,
#                    a learner re-scoring CPU nodes and restarting on the CPU (and back), the
#                    torch engine
#   learn_gpu.txt    tools/grpo_local.py --device cuda (the recipe that learns on the CPU)
#   learn_cpu.txt    the same on this machine's CPU, the baseline of the same run
#   rescore.txt      benchmarks/rescore.py --quick --device cuda (its JSON line is its last line)
#   fsdp.txt         benchmarks/learner_scale.py --quick --device cuda --nproc 1: FSDP2 (NCCL,
#                    bf16 parameters, fp32 reduction) against the single learner on the same GPU:
#                    step time and peak GPU memory as ratios (one GPU: NCCL refuses two ranks on
#                    one device)
#   vllm.txt         tests/node/test_vllm_engine.py, only where vllm imports
# Exit status: 2 at once if the device is cuda and torch sees no GPU; else non-zero if a step
# failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RES"
PY="${ECHO_GPU_PYTHON:-python3}"
SITE="${TMPDIR:-/tmp}/echo-gpu-site"
DEV="${ECHO_GPU_DEVICE:-cuda}"
export ECHO_TEST_DEVICE="$DEV" PYTHONUNBUFFERED=1
SUMMARY="$RES/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# Fail fast: a machine where torch sees no GPU runs nothing (torch alone is imported for this).
if [ "$DEV" != cpu ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "NO CUDA: torch sees no GPU (device $DEV); nothing was run. ECHO_GPU_DEVICE=cpu rehearses the script."
    exit 2
fi

# The package layout of pyproject.toml's package-dir, as links: no build, no index.
rm -rf "$SITE" && mkdir -p "$SITE/echo"
cp echo_ns/__init__.py "$SITE/echo/"
for pkg in protocol p2p learner coordinator node tasks models tools; do
    ln -s "$ROOT/$pkg" "$SITE/echo/$pkg"
done
if [ "${ECHO_GPU_WHEELS:-1}" = 1 ]; then
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        say "no wheels in .whl/: run scripts/gpu_wheels.sh here, and carry .whl to the GPU machine"
        exit 1
    fi
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" .whl/*.whl >"$RES/setup.txt" 2>&1; then
        say "wheel install failed: $(tail -n 3 "$RES/setup.txt")"
        exit 1
    fi
fi
export PYTHONPATH="$SITE:$ROOT"
if ! "$PY" -c "import echo.learner.trainer, echo.coordinator.config, echo.node.engines.torch_engine" \
    >"$RES/env.txt" 2>&1; then
    say "the project does not import: $(tail -n 3 "$RES/env.txt")"
    exit 1
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} >"$RES/env.txt" 2>&1
tee -a "$SUMMARY" <"$RES/env.txt"

# The project's conftest starts coordinators and hosts (libp2p): not needed here, not installed.
timeout 150 "$PY" -m pytest tests/models/test_devices.py -q -rA -s -p no:cacheprovider --noconftest \
    >"$RES/tests.txt" 2>&1
tests_rc=$?
say "tests rc=$tests_rc: $(grep -E "[0-9]+ (passed|failed|error)" "$RES/tests.txt" | tail -n 1)"
grep -E "log-prob gap|^(FAILED|ERROR)" "$RES/tests.txt" | tee -a "$SUMMARY"

timeout 120 "$PY" -m echo.tools.grpo_local --device "$DEV" --steps 200 --no-cache \
    >"$RES/learn_gpu.txt" 2>&1
gpu_rc=$?
say "learn $DEV rc=$gpu_rc: $(grep -E "^(warm-up|done)" "$RES/learn_gpu.txt" | tr '\n' ' ')"
timeout 90 "$PY" -m echo.tools.grpo_local --device cpu --steps 200 --no-cache --threads 4 \
    >"$RES/learn_cpu.txt" 2>&1
cpu_rc=$?
say "learn cpu rc=$cpu_rc: $(grep -E "^(warm-up|done)" "$RES/learn_cpu.txt" | tr '\n' ' ')"

timeout 120 "$PY" benchmarks/rescore.py --quick --device "$DEV" >"$RES/rescore.txt" 2>&1
rescore_rc=$?
say "rescore rc=$rescore_rc:"
grep -E "^  " "$RES/rescore.txt" | tee -a "$SUMMARY"
tail -n 1 "$RES/rescore.txt" >>"$SUMMARY"

timeout 150 "$PY" benchmarks/learner_scale.py --quick --device "$DEV" --nproc 1 >"$RES/fsdp.txt" 2>&1
fsdp_rc=$?
say "fsdp2 rc=$fsdp_rc:"
grep -E "^(single|fsdp2)" "$RES/fsdp.txt" | tee -a "$SUMMARY"
tail -n 1 "$RES/fsdp.txt" >>"$SUMMARY"

vllm_rc=0
if "$PY" -c "import vllm" 2>/dev/null; then
    timeout 300 "$PY" -m pytest tests/node/test_vllm_engine.py -q -rA -s -p no:cacheprovider \
        >"$RES/vllm.txt" 2>&1
    vllm_rc=$?
    say "vllm rc=$vllm_rc: $(tail -n 1 "$RES/vllm.txt")"
fi
[ "$tests_rc" = 0 ] && [ "$gpu_rc" = 0 ] && [ "$cpu_rc" = 0 ] && [ "$rescore_rc" = 0 ] \
    && [ "$fsdp_rc" = 0 ] && [ "$vllm_rc" = 0 ]
