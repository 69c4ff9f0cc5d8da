"""LoRA adapters as GGUF files for llama.cpp, beside the base model's GGUF (never touched).

llama.cpp's adapter format (what its ``convert_lora_to_gguf.py`` writes): ``general.type =
adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, the base's architecture, and per
wrapped weight two tensors named after the base tensor, ``<name>.lora_a`` (torch shape
``(r, in)``) and ``<name>.lora_b`` (``(out, r)``). llama.cpp adds ``alpha / r * B (A x)`` to that
weight's product, which is ``peft``'s LoRA. The Q/K row permutation llama.cpp's llama graph
expects applies to the rows of ``B`` as it does to the base weight's rows; ``A`` is stored as it
is. Both are stored as float32: exact for every published dtype, and an adapter is small.

:func:`write_gguf_lora` writes one with gguf-py; :func:`read_gguf_lora` reads it back (undoing the
permutation, in the published dtypes), so the digest an engine reports is of the adapter
llama.cpp actually loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from echo.node.engines.gguf_file import file_bits, tensor_from_bits
from echo.node.engines.gguf_layout import GGUFLayout, TensorSlot

_SUFFIX = {"lora_A": "lora_a", "lora_B": "lora_b"}
# An adapter GGUF holds two tensors per wrapped weight; far below this for any model.
MAX_ADAPTER_TENSORS = 4096


def _slots(layout: GGUFLayout, adapter: Mapping[str, torch.Tensor]) -> dict[str, TensorSlot]:
    """Adapter tensor name -> where it goes in the GGUF; ValueError naming the first tensor that
    wraps no weight of ``layout`` or does not fit it."""
    out: dict[str, TensorSlot] = {}
    for name in sorted(adapter):
        try:
            module, part = name.removesuffix(".weight").rsplit(".", 1)
        except ValueError:
            raise ValueError(f"adapter tensor {name!r} is not <module>.lora_A/B.weight") from None
        base = layout.slots.get(f"{module}.weight")
        if (
            part not in _SUFFIX
            or base is None
            or len(base.shape) != 2
            or not name.endswith(".weight")
        ):
            raise ValueError(f"adapter tensor {name!r} wraps no weight of the model")
        shape = tuple(adapter[name].shape)
        # A is (r, in) and shares the weight's columns; B is (out, r) and shares its rows.
        shared = 1 if part == "lora_A" else 0
        if len(shape) != 2 or shape[shared] != base.shape[shared]:
            raise ValueError(
                f"adapter tensor {name!r} has shape {shape}; the weight it wraps is {base.shape}"
            )
        permute = base.permute_heads if part == "lora_B" else None
        out[name] = TensorSlot(f"{base.gguf_name}.{_SUFFIX[part]}", shape, permute)
    return out


def write_gguf_lora(
    layout: GGUFLayout,
    adapter: Mapping[str, torch.Tensor],
    alpha: float,
    path: str | os.PathLike[str],
) -> None:
    """Write ``adapter`` (``echo.models.lora.adapter_state`` names) as llama.cpp's GGUF LoRA
    adapter of the model of ``layout``; written beside ``path`` and renamed over it.

    :raises ValueError: a tensor that wraps no weight of the model (nothing is written then).
    """
    import gguf

    slots = _slots(layout, adapter)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, layout.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, slot in slots.items():
        bits = file_bits(adapter[name], slot, "float32").reshape(slot.shape)
        w.add_tensor(slot.gguf_name, bits.view(np.float32))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)


def read_gguf_lora(
    path: str | os.PathLike[str], layout: GGUFLayout, published: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """The adapter state in the GGUF adapter at ``path``: every tensor of ``published`` (name ->
    the dtype it was published in), unpermuted and cast back to that dtype (exact: it was
    widened to float32). :raises ValueError: a tensor missing, extra or of another shape."""
    import gguf

    reader = gguf.GGUFReader(path)
    if len(reader.tensors) > MAX_ADAPTER_TENSORS:
        raise ValueError(f"{path} holds {len(reader.tensors)} tensors")
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(published):
        gguf_name = layout.slots[name.split(".lora_")[0] + ".weight"].gguf_name
        part = "lora_a" if ".lora_A." in name else "lora_b"
        t = by_name.pop(f"{gguf_name}.{part}", None)
        if t is None:
            raise ValueError(f"{path} lacks the tensor of {name!r}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        permute = None
        if part == "lora_b":
            permute = layout.slots[name.split(".lora_")[0] + ".weight"].permute_heads
        slot = TensorSlot(f"{gguf_name}.{part}", shape, permute)
        bits = np.asarray(t.data).reshape(-1).view(np.uint32)
        value = tensor_from_bits(bits, slot, "float32")
        out[name] = value if published[name] == torch.float32 else value.to(published[name])
    if by_name:
        raise ValueError(f"{path} holds tensors no adapter tensor names: {sorted(by_name)[:3]}")
    return out
