"""A node imports its engine's libraries while it waits for its first job
(:func:`echo.node.engine_slot.preload_engine`), so that the first job's engine starts without
seconds of imports (transformers' model classes): checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, trio
from echo.node.engine_slot import preload_engine
trio.run(preload_engine, "torch")
loaded = set(sys.modules)
from echo.models.spec import ModelSpec, build_model
build_model(ModelSpec.from_dict({"kind": "tiny", "hidden": 64, "layers": 2, "heads": 4}))
print(json.dumps({
    "torch_after": "torch" in loaded,
    "imported_by_build": sorted(
        m for m in set(sys.modules) - loaded if m.startswith(("torch", "transformers"))
    ),
}))
"""


def test_the_torch_engines_preload_covers_its_first_model_build() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch_after"]
    assert got["imported_by_build"] == [], got["imported_by_build"]


def test_an_unknown_engine_preloads_nothing_and_raises_nothing() -> None:
    import trio

    from echo.node.engine_slot import preload_engine

    trio.run(preload_engine, "no-such-engine")
