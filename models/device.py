"""Which torch device a process computes on, from the name a user wrote in a config or flag.

Torch is imported when a name is resolved, not before: configs validate names with
:data:`DEVICE_PATTERN` in processes that never compute (the coordinator).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_PATTERN", "resolve_device"]

# What a config may say: "auto" picks CUDA when torch sees a GPU, else the CPU. Apple's MPS is
# only ever asked for by name: nothing here has been checked on it.
DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:[0-9]+)?)$"


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (see :data:`DEVICE_PATTERN`) means on this machine.

    :raises ValueError: a name outside the pattern, or a device this torch cannot use (a CPU
        build asked for CUDA, a GPU index past the last one), said in words a user can act on.
    """
    import torch  # here, so that configs can read DEVICE_PATTERN without loading torch

    if not re.fullmatch(DEVICE_PATTERN, name):
        raise ValueError(f"device must be auto, cpu, mps, cuda or cuda:N, not {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r}: this torch ({torch.__version__}) sees no CUDA GPU "
                "(a CPU build, or no driver); use cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s), "
                f"numbered from 0"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: this torch sees no Apple GPU; use cpu")
    return dev
