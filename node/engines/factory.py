"""Building the engine a node runs, by name."""

from __future__ import annotations

from echo.models.spec import ModelSpec
from echo.node.engines.base import Engine


def make_engine(name: str, spec: ModelSpec, *, device: str = "cpu", threads: int | None = None,
                dtype: str = "float32", gpu_memory_fraction: float = 0.9) -> Engine:
    if name == "torch":
        from echo.node.engines.torch_engine import TorchEngine

        return TorchEngine(spec, device=device, threads=threads, dtype=dtype)
    raise ValueError(f"engine {name!r} is not available in this build")
