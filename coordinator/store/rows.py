"""Typed rows of the coordinator's database: one frozen dataclass per table, built in one place.

Every read of :class:`~echo.coordinator.store.Store` returns these instead of ``sqlite3.Row``, so a
caller names a column as an attribute (a typo fails at once, not at the first row that has it)
and JSON and boolean columns arrive decoded. The ``*_row`` functions are the only code that reads
a ``sqlite3.Row`` by column name; they raise nothing for rows of the schema in
:mod:`echo.coordinator.schema`.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class JobRow:
    """A job: its spec, its status and the learner that trains it."""

    job_id: str
    name: str
    spec: dict[str, Any]  # the JobSpec as JSON
    status: str  # pending | running | done | cancelled | failed
    error: str
    learner_pubkey: bytes | None
    learner_peer_id: str
    learner_addrs: list[str]
    current_version: int
    next_prompt_id: int
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A registered node: what it declared, its record of results and the version it holds."""

    node_id: str
    public_key: bytes
    engine: str
    hardware: dict[str, Any]
    tokens_per_s: float
    upload_bps: float
    download_bps: float
    accepted: int
    rejected: int
    streak: int  # consecutive valid results (reputation)
    failures: int  # verification failures (not transport noise)
    excluded: bool
    version: int
    state_digest: str
    first_seen: float
    last_seen: float


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One lease: a GRPO group of one prompt, owed by one node before its deadline."""

    lease_id: str
    job_id: str
    node_id: str
    prompt_id: int
    group_size: int
    max_new_tokens: int
    seed: int
    min_version: int
    issued_at: float
    deadline: float
    status: str  # open | submitted | expired
    # The prompt's token ids as the signed lease carries them, rendered once when it was issued:
    # the accepted group takes them from here (schema 3).
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RolloutRow:
    """An accepted group's ledger entry (its completions and envelope are read separately)."""

    rollout_id: str  # = the lease id: one submission per lease
    job_id: str
    node_id: str
    version: int
    prompt_id: int
    engine: str
    status: str  # accepted | in_batch | trained | rejected | dropped
    reason: str
    rewards: list[float]
    mean_reward: float
    tokens: int
    content_hash: bytes
    created_at: float
    batch_at: float | None
    trained_version: int | None


@dataclass(frozen=True, slots=True)
class BatchRow:
    """A group handed to the learner: its ledger entry and the encoded
    :class:`~echo.protocol.messages.TrainingGroup` stored when it was accepted."""

    rollout: RolloutRow
    group: bytes


@dataclass(frozen=True, slots=True)
class VersionRow:
    """A published version: its signed manifest and when every active node held it."""

    job_id: str
    version: int
    kind: str
    manifest: bytes  # the learner-signed Manifest envelope
    state_digest: str
    total_size: int
    trained_count: int
    metrics: dict[str, float]
    published_at: float
    all_nodes_at: float | None


def job_row(r: sqlite3.Row) -> JobRow:
    """A ``jobs`` row, JSON columns decoded."""
    return JobRow(
        job_id=r["job_id"],
        name=r["name"],
        spec=json.loads(r["spec_json"]),
        status=r["status"],
        error=r["error"],
        learner_pubkey=bytes(r["learner_pubkey"]) if r["learner_pubkey"] is not None else None,
        learner_peer_id=r["learner_peer_id"],
        learner_addrs=json.loads(r["learner_addrs_json"]),
        current_version=int(r["current_version"]),
        next_prompt_id=int(r["next_prompt_id"]),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


def node_row(r: sqlite3.Row) -> NodeRow:
    """A ``nodes`` row, JSON columns decoded."""
    return NodeRow(
        node_id=r["node_id"],
        public_key=bytes(r["public_key"]),
        engine=r["engine"],
        hardware=json.loads(r["hardware_json"]),
        tokens_per_s=r["tokens_per_s"],
        upload_bps=r["upload_bps"],
        download_bps=r["download_bps"],
        accepted=int(r["accepted"]),
        rejected=int(r["rejected"]),
        streak=int(r["streak"]),
        failures=int(r["failures"]),
        excluded=bool(r["excluded"]),
        version=int(r["version"]),
        state_digest=r["state_digest"],
        first_seen=r["first_seen"],
        last_seen=r["last_seen"],
    )


def lease_row(r: sqlite3.Row) -> LeaseRow:
    """A ``leases`` row (its columns are the fields; the prompt is stored packed)."""
    fields = dict(r)
    fields["prompt_ids"] = tuple(np.frombuffer(fields.pop("prompt_tokens"), "<i4").tolist())
    return LeaseRow(**fields)


def lease_values(row: LeaseRow) -> tuple:
    """The ``leases`` columns of ``row``, in table order (the prompt packed int32)."""
    *head, prompt_ids = dataclasses.astuple(row)
    return (*head, np.asarray(prompt_ids, dtype="<i4").tobytes())


def rollout_row(r: sqlite3.Row) -> RolloutRow:
    """A ``rollouts`` row, JSON columns decoded."""
    return RolloutRow(
        rollout_id=r["rollout_id"],
        job_id=r["job_id"],
        node_id=r["node_id"],
        version=int(r["version"]),
        prompt_id=int(r["prompt_id"]),
        engine=r["engine"],
        status=r["status"],
        reason=r["reason"],
        rewards=json.loads(r["rewards_json"]),
        mean_reward=r["mean_reward"],
        tokens=int(r["tokens"]),
        content_hash=bytes(r["content_hash"]),
        created_at=r["created_at"],
        batch_at=r["batch_at"],
        trained_version=r["trained_version"],
    )


def version_row(r: sqlite3.Row) -> VersionRow:
    """A ``versions`` row, JSON columns decoded."""
    return VersionRow(
        job_id=r["job_id"],
        version=int(r["version"]),
        kind=r["kind"],
        manifest=bytes(r["manifest"]),
        state_digest=r["state_digest"],
        total_size=int(r["total_size"]),
        trained_count=int(r["trained_count"]),
        metrics=json.loads(r["metrics_json"]),
        published_at=r["published_at"],
        all_nodes_at=r["all_nodes_at"],
    )
