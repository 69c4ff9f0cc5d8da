#!/usr/bin/env bash
# Fetch, into .whl/, the wheels scripts/gpu_check.sh installs on a GPU machine that cannot reach
# a package index: what the project imports for its learner-side checks beyond an image with a
# CUDA torch, transformers, numpy, msgpack, safetensors and pytest (CPython 3.12, x86-64 Linux).
# Run it where pip can reach the index; the versions are the main .venv's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${ECHO_PY:-.venv/bin/python}"
want=()
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions zstandard \
    platformdirs; do
    want+=("$name==$("$PY" -m pip show "$name" | awk '/^Version:/ {print $2}')")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${want[@]}"
ls .whl
