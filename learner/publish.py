"""Turning a trained state into a signed, chunked policy version.

:class:`Publisher` owns the previous published state (to diff against) and the learner's chunk
store. :meth:`Publisher.publish` encodes version ``v`` as a full anchor (every ``anchor_every``
versions, and the first) or a lossless patch against ``v - 1``, splits the bytes into chunks,
stores them, and returns the signed manifest naming every chunk hash and the hash of every
tensor of the resulting state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo.models.weights import state_digest, state_digests, state_to_bytes, to_bits
from echo.p2p.chunkstore import ChunkStore, chunk_size_for, split_chunks
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.patch import encode_patch


@dataclass
class Published:
    manifest: m.Manifest
    envelope: bytes
    payload_bytes: int
    encode_s: float


class Publisher:
    def __init__(
        self, key: Ed25519PrivateKey, job_id: str, store: ChunkStore, anchor_every: int
    ) -> None:
        self.key = key
        self.job_id = job_id
        self.store = store
        self.anchor_every = anchor_every
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_version = -1
        self._anchor_version = 0

    def reset(self, state: Mapping[str, torch.Tensor], version: int, anchor_version: int) -> None:
        """Continue from an already-published ``version`` (after a restart)."""
        self._prev = {k: v.clone() for k, v in state.items()}
        self._prev_version = version
        self._anchor_version = anchor_version

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> Published:
        t0 = time.perf_counter()
        anchor = (
            self._prev is None
            or version % self.anchor_every == 0
            or version != self._prev_version + 1
        )
        if anchor:
            payload = self._anchor_payload(state, version)
            kind, base = "anchor", -1
            self._anchor_version = version
        else:
            assert self._prev is not None
            payload = encode_patch(to_bits(self._prev), to_bits(state))
            kind, base = "patch", self._prev_version
        encode_s = time.perf_counter() - t0
        refs = []
        for chunk in split_chunks(payload, chunk_size_for(len(payload))):
            sha = self.store.put(version, chunk)
            refs.append(m.ChunkRef(sha256=sha, size=len(chunk)))
        manifest = m.Manifest(
            job_id=self.job_id,
            version=version,
            base_version=base,
            kind=kind,
            total_size=len(payload),
            chunks=refs,
            anchor_version=self._anchor_version,
            created_at=time.time(),
            **self._identity(state, version, kind),
        )
        envelope = signing.seal_record(self.key, manifest)
        self._prev = {k: v.clone() for k, v in state.items()}
        self._prev_version = version
        # Keep every version back to the newest anchor so a node can always catch up by patches.
        self.store.prune(keep=self._keep(version))
        return Published(manifest, envelope, len(payload), encode_s)

    # Hooks of a publisher whose versions are not whole states (echo.learner.lora).

    def _keep(self, version: int) -> set[int]:
        """The versions whose chunks stay in the store after ``version`` is published."""
        return set(range(self._anchor_version, version + 1))

    def _anchor_payload(self, state: Mapping[str, torch.Tensor], version: int) -> bytes:
        """The bytes of a full anchor of ``state``."""
        return state_to_bytes(state)

    def _identity(
        self, state: Mapping[str, torch.Tensor], version: int, kind: str
    ) -> dict[str, Any]:
        """The manifest fields that name what the version's payload rebuilds."""
        return {"tensor_digests": state_digests(state), "state_digest": state_digest(state)}
