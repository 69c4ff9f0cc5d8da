"""A node's side of LoRA versions: rebuilding an adapter version and checking it, and handing it
to the engine.

A LoRA job's manifests carry ``adapter`` (``messages.AdapterRef``). Version 0's payload holds the
base model's tensors beside the adapter's (``carries_base``); a node fetches it once, checks the
base's digest against the signed ``base_digest``, and keeps the base. Every other version is the
adapter alone (an anchor) or a lossless patch of the adapter's bits. Each is checked as weights
are today: every tensor hash, then the state digest, which for an adapter binds the base's
digest and the adapter's (``echo.models.lora.lora_digest``). The engine then loads the base once
and switches adapters (``Engine.load_adapter``); the digest it reports is computed from what it
loaded, so a node serving the base alone, or a stale adapter, reports a digest the coordinator
refuses (``wrong_weights``).
"""

from __future__ import annotations

import torch

from echo.models.lora import lora_digest, split_state
from echo.models.weights import from_bits, state_digest, state_digests, state_from_bytes, to_bits
from echo.node.engines.base import Engine
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.limits import MAX_STATE_BYTES
from echo.protocol.patch import apply_patch


class AdapterError(ProtocolError):
    """An adapter version that does not match its signed manifest or the base held."""

    code = "weights"


def decode_adapter_version(
    man: m.Manifest,
    payload: bytes,
    held_base_digest: str,
    prev: dict[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
    """The (base, adapter) of LoRA version ``man`` from its ``payload``: base is None unless the
    version carries it. A patch applies to ``prev``, the adapter of ``man.base_version``;
    ``held_base_digest`` is the digest of the base the node holds ("" for none), which a
    version without the base must name.

    :raises AdapterError: a hash that differs from the manifest, a patch without its base, a
        version of another base.
    """
    ref = man.adapter
    if ref is None:
        raise AdapterError(f"v{man.version} is not an adapter version")
    if man.kind == "anchor":
        try:
            state = state_from_bytes(payload)
        except ValueError as exc:
            raise AdapterError(f"v{man.version}: {exc}") from None
    else:
        if prev is None:
            raise AdapterError(f"patch v{man.version} needs the adapter of v{man.base_version}")
        try:
            bits = apply_patch(to_bits(prev), payload, max_output_bytes=MAX_STATE_BYTES)
            state = from_bits(bits, prev)
        except ValueError as exc:
            raise AdapterError(f"patch v{man.version}: {exc}") from None
    if state_digests(state) != dict(man.tensor_digests):
        raise AdapterError(f"v{man.version}: tensor hashes differ from the signed manifest")
    base, adapter = split_state(state)
    if ref.carries_base:
        if state_digest(base) != ref.base_digest:
            raise AdapterError(f"v{man.version}: the base's digest differs from the manifest's")
    else:
        if base:
            raise AdapterError(f"v{man.version} holds base tensors it does not declare")
        if held_base_digest != ref.base_digest:
            raise AdapterError(
                f"v{man.version} is an adapter of base {ref.base_digest[:12]}, this node holds "
                f"{held_base_digest[:12] or 'none'}"
            )
    if not adapter or lora_digest(ref.base_digest, adapter) != man.state_digest:
        raise AdapterError(f"v{man.version}: state digest differs from the signed manifest")
    return (base if ref.carries_base else None), adapter


def load_into_engine(
    engine: Engine,
    ref: m.AdapterRef,
    base: dict[str, torch.Tensor],
    adapter: dict[str, torch.Tensor],
    expected_digest: str,
) -> bool:
    """Make ``engine`` serve ``adapter`` on ``base`` (the base only when it does not hold it
    already), then check that what it serves, computed from its own weights, is the version's
    digest ``expected_digest``. True when the engine loaded the base (a model load), False for
    an adapter switch on the base it held.

    :raises AdapterError: the engine serves something else after loading.
    """
    held = engine.holds_base(ref.base_digest)
    engine.load_adapter(None if held else base, adapter, ref)
    if engine.lora_served != expected_digest:
        raise AdapterError(
            f"the {engine.name} engine serves digest {engine.lora_served[:12]}, the version is "
            f"{expected_digest[:12]}"
        )
    return not held


def say_base_loaded(engine: Engine, base_digest: str) -> str:
    """What the node tells the volunteer when its engine loads a base model (one line per load:
    tests count them)."""
    return f"loaded base {base_digest[:12]} into the {engine.name} engine"
