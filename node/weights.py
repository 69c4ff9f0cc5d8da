"""Bringing the node's policy to a target version, verified against the learner's signature.

:class:`WeightSync` owns the node's copy of the published state and its chunk store. It takes each
version's signed manifest from the node's relay when the relay carries that version (the relay
verified it), else asks the coordinator and verifies it (:func:`echo.protocol.manifest.
verify_manifest`, the check relays run too: the learner key the job pins, the job, the version,
the sizes); it makes versions only move forward, fetches each chunk from the peers that may hold
it (hash-checked against the manifest, so a relay cannot corrupt a byte unnoticed), applies the
anchor or patch, and checks every tensor hash and the state digest before the engine sees the
weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch
import trio

from echo.models.weights import from_bits, state_digest, state_digests, state_from_bytes, to_bits
from echo.node.adapter_sync import decode_adapter_version
from echo.p2p.chunkstore import ChunkHashMismatch, ChunkStore, fetch_chunk
from echo.p2p.host import EchoHost
from echo.p2p.rpc import RpcError
from echo.protocol import ids
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.limits import MAX_STATE_BYTES
from echo.protocol.manifest import verify_manifest
from echo.protocol.patch import apply_patch

log = logging.getLogger("echo.node.weights")

CHUNK_TIMEOUT_S = 60.0
MANIFEST_TIMEOUT_S = 15.0


class WeightError(ProtocolError):
    """A version that cannot be built: a missing base, a chunk no peer provides, or a state whose
    hashes differ from its signed manifest."""

    code = "weights"


ProgressFn = Callable[[int, int, int], None]  # (version, bytes done, bytes total)


class Broadcasts(Protocol):
    """What a sync needs of the versions the node's broadcasts carry
    (:class:`~echo.node.policy.PolicyFollower` answers it from its relay)."""

    def carried_manifest(self, version: int) -> tuple[m.Manifest, bytes] | None:
        """The verified manifest of ``version`` and its envelope, if a broadcast carries it."""

    def carried_versions(self) -> set[int]:
        """The versions broadcasts still carry (their chunks must stay in the store)."""


class WeightSync:
    """The node's state of ``job`` and the fetching that moves it forward (see the module
    docstring). ``coordinator`` is the coordinator's peer id; ``on_progress`` is called after
    each chunk of a version that is fetched; ``broadcasts`` answers for the versions pushed to
    the node (None: none are)."""

    def __init__(
        self,
        host: EchoHost,
        job: m.JobInfo,
        coordinator,
        store: ChunkStore,
        on_progress: ProgressFn | None = None,
        broadcasts: Broadcasts | None = None,
    ) -> None:
        self.host = host
        self.job = job
        self.coordinator = coordinator
        self.store = store
        self.on_progress = on_progress
        self.version = -1
        self.state: dict[str, torch.Tensor] | None = None
        self.digest = ""
        self.bytes_received = 0
        self.download_bps = 0.0
        self.sources: list = []  # peer ids to fetch chunks from, best first
        self.bad_peers: set = set()
        # Pushed versions come with verified manifests, and their chunks stay in the store
        # when a sync prunes it.
        self.broadcasts = broadcasts
        # A LoRA job's base model (fetched once, with version 0) and what its versions are;
        # ``state`` then holds the adapter (echo.node.adapter_sync).
        self.base: dict[str, torch.Tensor] | None = None
        self.base_digest = ""
        self.adapter: m.AdapterRef | None = None

    async def add_source_addrs(self, addrs: list[str]) -> None:
        """Add the first of ``addrs`` that can be dialled to the peers chunks are fetched from
        (none when none can)."""
        for addr in addrs:
            try:
                peer = await self.host.connect(addr)
            except (RpcError, ValueError, OSError) as exc:
                log.debug("cannot reach %s: %s", addr, exc)
                continue
            if peer not in self.sources:
                self.sources.append(peer)
            return

    async def manifest(self, version: int) -> tuple[m.Manifest, bytes]:
        """The verified manifest of ``version`` (-1: the job's current one) and its envelope:
        a broadcast's when one carries that version, else the coordinator's.

        :raises ManifestError: the coordinator's envelope does not verify (see
            :meth:`check_manifest`).
        :raises RpcError: the coordinator cannot be asked or has no such version.
        """
        carried = self.broadcasts.carried_manifest(version) if self.broadcasts else None
        if version >= 0 and carried is not None:
            return carried
        data = await self.host.request(
            self.coordinator,
            ids.PROTO_MANIFEST,
            m.encode(m.ManifestRequest(job_id=self.job.job_id, version=version)),
            timeout=MANIFEST_TIMEOUT_S,
            max_response=16 << 20,
        )
        return self.check_manifest(data, None if version < 0 else version), data

    def check_manifest(self, data: bytes, version: int | None = None) -> m.Manifest:
        """Verify a manifest envelope of this job (and of ``version``, unless None).

        :raises ManifestError: see :func:`echo.protocol.manifest.verify_manifest`.
        """
        return verify_manifest(data, self.job.learner_public_key, self.job.job_id, version)

    async def latest_version(self) -> int:
        """The newest version the coordinator has a manifest for.

        :raises ManifestError, RpcError: as :meth:`manifest`.
        """
        return (await self.manifest(-1))[0].version

    async def sync_to(self, target: int, *, rebase: bool = False) -> bool:
        """Bring the state to version ``target``; True if it changed.

        Patches chain from the version held; a node too far behind, or asked to ``rebase``
        (after a patch it could not get), starts again from the newest anchor at or before
        ``target``. The state is built aside and installed only when it reaches ``target``, so
        the held version never goes backwards and a failure changes nothing.

        :raises WeightError: a version cannot be built or does not match its manifest.
        :raises ManifestError, RpcError: as :meth:`manifest`.
        """
        if target <= self.version:
            return False
        t0 = time.perf_counter()
        latest, _ = await self.manifest(target)
        base, base_digest = self.base, self.base_digest
        if latest.adapter is not None and base_digest != latest.adapter.base_digest:
            rebase = True  # a new base: its adapters start from an anchor
            if latest.anchor_version > 0:  # the base comes with version 0, fetched once
                v0, _ = await self.manifest(0)
                base, _ = await trio.to_thread.run_sync(
                    decode_adapter_version, v0, await self._fetch_payload(v0), "", None
                )
                base_digest = latest.adapter.base_digest
        if rebase or self.version < 0 or self.version < latest.anchor_version:
            plan, state, held = range(latest.anchor_version, target + 1), None, -1
        else:
            plan, state, held = range(self.version + 1, target + 1), self.state, self.version
        received = 0
        for v in plan:
            man = latest if v == target else (await self.manifest(v))[0]
            if man.kind == "patch" and man.base_version != held:
                raise WeightError(f"patch v{man.version} is against v{man.base_version}, "
                                  f"not v{held}")
            payload = await self._fetch_payload(man)
            if man.adapter is not None:
                got, state = await trio.to_thread.run_sync(
                    decode_adapter_version, man, payload, base_digest, state
                )
                if got is not None:
                    base, base_digest = got, man.adapter.base_digest
            else:
                state = await trio.to_thread.run_sync(self._decode, man, payload, state)
            held, received = man.version, received + len(payload)
        self.state, self.version, self.digest = state, latest.version, latest.state_digest
        self.base, self.base_digest, self.adapter = base, base_digest, latest.adapter
        if latest.adapter is not None:
            self.store.pinned.add(0)  # the base's chunks, for peers that fetch it from us
        elapsed = time.perf_counter() - t0
        self.download_bps = received / max(elapsed, 1e-6)
        carried = self.broadcasts.carried_versions() if self.broadcasts else set()
        self.store.prune(keep={latest.version, latest.anchor_version} | carried)
        log.info("holding v%d (%d version(s), %.1f kB in %.2f s)", latest.version, len(plan),
                 received / 1e3, elapsed)
        return True

    def _decode(
        self, man: m.Manifest, payload: bytes, base: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """The state of ``man.version``: the anchor itself, or ``base`` patched; hash-checked."""
        if man.kind == "anchor":
            state = state_from_bytes(payload)
        else:
            if base is None:
                raise WeightError(f"patch v{man.version} needs a base state")
            bits = apply_patch(to_bits(base), payload, max_output_bytes=MAX_STATE_BYTES)
            state = from_bits(bits, base)
        if state_digests(state) != dict(man.tensor_digests):
            raise WeightError(f"v{man.version}: tensor hashes differ from the signed manifest")
        if state_digest(state) != man.state_digest:
            raise WeightError(f"v{man.version}: state digest differs from the signed manifest")
        return state

    async def _fetch_payload(self, man: m.Manifest) -> bytes:
        parts: list[bytes] = []
        done = 0
        for ref in man.chunks:
            chunk = self.store.get(ref.sha256)
            if chunk is None:
                chunk = await self._fetch_one(ref)
                self.store.put(man.version, chunk, ref.sha256)
            parts.append(chunk)
            done += ref.size
            self.bytes_received += ref.size
            if self.on_progress is not None:
                self.on_progress(man.version, done, man.total_size)
        return b"".join(parts)

    async def _fetch_one(self, ref: m.ChunkRef) -> bytes:
        errors = []
        for peer in [p for p in self.sources if p not in self.bad_peers]:
            try:
                return await fetch_chunk(self.host, peer, ref, timeout=CHUNK_TIMEOUT_S)
            except ChunkHashMismatch as exc:
                self.bad_peers.add(peer)
                errors.append(str(exc))
                log.warning("peer %s sent a bad chunk; excluded", str(peer)[-8:])
            except (RpcError, ProtocolError) as exc:
                errors.append(f"{str(peer)[-8:]}: {exc}")
        raise WeightError(
            f"no peer could provide chunk {ref.sha256.hex()[:12]}: " + "; ".join(errors[-3:])
        )
