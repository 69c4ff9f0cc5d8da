"""Verifying a learner-signed manifest: the one check every holder of a version runs.

A manifest names a version's chunks (hash and size each) and the state they rebuild; the learner
signs it with the key its job pins. Relays check it before they store a single chunk of the
version, nodes before they apply it: both go through :func:`verify_manifest`, so a manifest one
accepts the other accepts too. Nothing here does I/O.
"""

from __future__ import annotations

from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.errors import ProtocolError
from echo.protocol.limits import MAX_CHUNK_BYTES, MAX_MANIFEST_ENVELOPE_BYTES, MAX_STATE_BYTES


class ManifestError(ProtocolError):
    """A manifest envelope that does not verify against the job's learner key or breaks limits."""

    code = "manifest"


def verify_manifest(
    envelope: bytes, learner_key: bytes, job_id: str, version: int | None = None
) -> m.Manifest:
    """Open a learner-signed manifest envelope and check it: signed by ``learner_key``, a valid
    :class:`~echo.protocol.messages.Manifest`, for ``job_id`` and ``version`` (any version when
    None), no chunk over ``MAX_CHUNK_BYTES``, chunk sizes adding up to ``total_size``, and that
    at most ``MAX_STATE_BYTES``.

    :raises ManifestError: on any failure (signature, schema, mismatch, limits).
    """
    wanted = job_id if version is None else f"{job_id} v{version}"
    try:
        _, man = signing.open_record(envelope, m.Manifest, expected_signer=learner_key,
                                     max_bytes=MAX_MANIFEST_ENVELOPE_BYTES)
    except ProtocolError as exc:
        raise ManifestError(f"manifest for {wanted}: {exc}") from exc
    if man.job_id != job_id or (version is not None and man.version != version):
        raise ManifestError(f"manifest is {man.job_id} v{man.version}, expected {wanted}")
    if any(c.size > MAX_CHUNK_BYTES for c in man.chunks):
        raise ManifestError(f"manifest names a chunk over {MAX_CHUNK_BYTES} bytes")
    if sum(c.size for c in man.chunks) != man.total_size:
        raise ManifestError("manifest chunk sizes do not add up to total_size")
    if man.total_size > MAX_STATE_BYTES:
        raise ManifestError(f"manifest of {man.total_size} bytes exceeds {MAX_STATE_BYTES}")
    return man


__all__ = ["ManifestError", "verify_manifest"]
