"""Lossless sparse weight patches: the bits that changed between two policy versions.

A patch turns version v into v+1 exactly. Per tensor it holds *which* positions' stored bits
changed and *what* they changed to; applying it reproduces the new bits bit for bit. There are no
float deltas: the optional difference coding (``DIFF``) is a modular integer difference of the
stored bit patterns, which is exact and cannot drift. The codec works on 1-D unsigned bit views
(``uint16`` for bf16/fp16, ``uint32`` for fp32; the signed ``int16``/``int32`` views that
``torch.Tensor.view`` produces are accepted too), so it needs no torch.

The package is cut where the data flows, and each module uses only public names of those before
it:

- :mod:`~echo.protocol.patch.format`: the wire format as a specification (layout, limits, the
  shared table entry, bit packing); what encoder and decoder agree on, and nothing else.
- :mod:`~echo.protocol.patch.encode`: :func:`encode_patch` and the encoder's coding choices.
- :mod:`~echo.protocol.patch.parse`: the checked header, table and stream directory, and
  :func:`patch_stats`.
- :mod:`~echo.protocol.patch.decode`: the payload decoded against a base state, limits checked
  before allocation.
- :mod:`~echo.protocol.patch.apply`: :func:`apply_patch` and :func:`apply_patch_inplace`.

Callers import the names below from this package.
"""

from echo.protocol.patch.apply import apply_patch, apply_patch_inplace
from echo.protocol.patch.encode import encode_patch
from echo.protocol.patch.format import (
    FORMAT_VERSION,
    MAX_NAME_BYTES,
    MAX_PATCH_TENSORS,
    MAX_TENSOR_ELEMENTS,
)
from echo.protocol.patch.parse import patch_stats

__all__ = [
    "FORMAT_VERSION",
    "MAX_NAME_BYTES",
    "MAX_PATCH_TENSORS",
    "MAX_TENSOR_ELEMENTS",
    "apply_patch",
    "apply_patch_inplace",
    "encode_patch",
    "patch_stats",
]
