"""Applying a weight patch to a base state, bit for bit.

This module owns writing decoded changes: :func:`apply_patch` returns the new state as fresh
arrays; :func:`apply_patch_inplace` writes the changed elements into the caller's own arrays,
all or nothing. Both decode and validate the whole patch first
(:func:`echo.protocol.patch.decode.decode_changes`), so a bad patch writes nothing.

Errors: :class:`~echo.protocol.errors.DecodeError` on a bad patch; ``ValueError`` for a base
state the codec does not take.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from echo.protocol.patch.decode import decode_changes


def apply_patch(
    old: Mapping[str, np.ndarray], patch: bytes, *, max_output_bytes: int
) -> dict[str, np.ndarray]:
    """Apply ``patch`` to ``old`` and return the new state as fresh arrays (``old`` is untouched).

    Output arrays keep ``old``'s dtypes and are returned in the patch's tensor order. Every
    limit (tensor count, element counts, output bytes <= ``max_output_bytes``, each stream's
    decompressed size) is checked before the memory it governs is allocated.

    A patch does not name its base version: applied to a different base of the same shapes it
    yields a wrong state (or a DecodeError). Callers check the result against the tensor hashes
    of the signed manifest.

    :raises DecodeError: if the patch is malformed, exceeds a limit, or does not match ``old``
        (names, element widths, sizes).
    :raises ValueError: if ``old`` holds something that is not a supported 1-D bit view.
    """
    out: dict[str, np.ndarray] = {}
    for name, o, pos, values in decode_changes(old, patch, max_output_bytes):
        if values is None:
            res = o.copy()
        elif pos is None:
            res = values  # freshly decoded, shares nothing with old
        else:
            res = o.copy()
            res[pos] = values
        out[name] = res.view(old[name].dtype)
    return out


def apply_patch_inplace(
    state: Mapping[str, np.ndarray], patch: bytes, *, max_output_bytes: int
) -> None:
    """Apply ``patch`` by writing the changed elements into ``state``'s own arrays.

    For nodes holding large models: no second copy of the state. All or nothing: the whole patch
    is decoded and validated (as in :func:`apply_patch`) before the first element is written, so
    on any error ``state`` is unchanged.

    :raises DecodeError: as :func:`apply_patch`.
    :raises ValueError: if an array of ``state`` is not a writeable, supported 1-D bit view.
    """
    for name, a in state.items():
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"tensor {name!r}: array is read-only")
    for _, o, pos, values in decode_changes(state, patch, max_output_bytes):
        if values is None:
            continue
        if pos is None:
            o[...] = values
        else:
            o[pos] = values
