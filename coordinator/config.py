"""The operator's ``coordinator.toml``, validated with messages that name the bad key."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo.models.device import DEVICE_PATTERN
from echo.protocol.jobspec import SpecError, explain_validation, is_local_path_param, read_toml

# Where datasets may live when ``[jobs] dataset_roots`` is unset: a folder of the data dir, so a
# fresh coordinator reads no file it did not create unless its operator names more.
DEFAULT_DATASET_ROOT = "datasets"


class VerificationSection(BaseModel):
    """``[verification]``: lease timing and quotas, the buffer target, rate limit, exclusion."""

    model_config = ConfigDict(extra="forbid")
    lease_timeout_s: float = Field(
        default=30.0, gt=0, description="time a node has per lease before it goes to another"
    )
    # 10 s let honest leases expire under attack on a loaded machine: a grant delivered in 2 s
    # when calm took over 10 s when the coordinator answered submissions in 5 s.
    min_lease_s: float = Field(
        default=20.0,
        gt=0,
        description="the shortest lease term: a node with delivered groups gets "
        "lease_term_factor times its slowest recent delivery, at least this, at most "
        "lease_timeout_s (a node without one gets lease_timeout_s)",
    )
    lease_term_factor: float = Field(default=4.0, ge=1)
    proven_groups: int = Field(
        default=24,
        ge=1,
        description="accepted groups that make a node proven: while one is active, nodes with "
        "fewer share fresh_lease_share of a job's lease window (not with lease_quota_ramp = 0)",
    )
    max_open_leases_per_node: int = Field(default=8, ge=1)
    lease_quota_ramp: int = Field(
        default=3,
        ge=0,
        description="a node gets one more open lease per this many valid groups in a row "
        "(0: full quota at once)",
    )
    expired_lease_window_s: float = Field(
        default=120.0,
        gt=0,
        description="a lease a node let expire costs it one open lease for this long (as many "
        "as its quota: none until they age out), unless it has submitted a later lease since",
    )
    fresh_lease_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="share of a job's lease window that nodes without an accepted group may "
        "hold together (identities are free: fresh ones never take the whole window); "
        "not applied with lease_quota_ramp = 0",
    )
    buffer_groups: int = Field(
        default=0, ge=0, description="accepted groups to keep ahead of the learner (0 = 2 batches)"
    )
    exclude_after_failures: int = Field(
        default=5, ge=1, description="verification failures before a node is excluded"
    )
    exclude_failure_share: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description=(
            "...and only while they are at least this share of its results: an honest node's "
            "rare false rejection (a checker's tail) never adds up to exclusion over a long run"
        ),
    )
    submissions_per_minute: int = Field(
        default=6000, ge=1, description="per-node rate limit (a fast node sends ~10 groups/s)"
    )


class AdmissionSection(BaseModel):
    """``[admission]``: what one peer (and one network prefix) may ask of the coordinator.

    Every node RPC is charged per (peer, rpc) and per (/24 or /48 prefix, rpc) before its request
    is read (see :mod:`echo.coordinator.rpc.budgets`); a peer over budget has its stream closed and
    serves a backoff.
    """

    model_config = ConfigDict(extra="forbid")
    requests_per_s: float = Field(
        default=20.0, gt=0, description="sustained requests/s per peer for lease, status, manifest"
    )
    burst_requests: float = Field(default=60.0, gt=0, description="burst of the same")
    registers_per_minute: float = Field(
        default=12.0, gt=0, description="registrations per peer per minute (a node registers once)"
    )
    submit_bytes_per_s: float = Field(
        default=16e6, gt=0, description="submission bytes/s per peer (a fast node sends ~1 MB/s)"
    )
    submit_burst_bytes: float = Field(
        default=16 * 1024 * 1024,
        ge=64 * 1024,
        description="submission bytes a peer may send at once (at least its largest submission)",
    )
    prefix_factor: float = Field(
        default=8.0,
        ge=1,
        description="a /24 (IPv4) or /48 (IPv6) prefix gets this many peers' budget",
    )
    backoff_s: float = Field(
        default=2.0, gt=0, description="first backoff after a violation; doubles per repeat"
    )
    max_backoff_s: float = Field(default=300.0, gt=0)
    max_tracked_peers: int = Field(
        default=20_000, ge=100, description="per-peer entries kept (least recently seen dropped)"
    )
    loopback_is_network: bool = Field(
        default=False,
        description=(
            "count each loopback address as a public network of its own: budgets, a "
            "connection cap and a handshake rate per address (a benchmark running attackers "
            "from 127.0.0.2 beside honest nodes on 127.0.0.1); off, loopback is uncapped"
        ),
    )


class RetentionSection(BaseModel):
    """``[retention]``: how long the coordinator keeps what it no longer needs (see
    :meth:`Store.prune <echo.coordinator.store.prune.Pruning.prune>`)."""

    model_config = ConfigDict(extra="forbid")
    closed_leases_s: float = Field(
        default=3600.0,
        gt=0,
        description="submitted / expired leases are deleted this long after their deadline "
        "(at least the expiry penalty window)",
    )
    trained_envelopes_s: float = Field(
        default=3600.0,
        gt=0,
        description="a trained rollout's signed envelope (kept for audit) is cleared this long "
        "after it was trained",
    )
    rejections_s: float = Field(
        default=86400.0, gt=0, description="rejection log rows older than this are deleted"
    )
    idle_nodes_s: float = Field(
        default=86400.0,
        gt=0,
        description="a node that never had a group accepted and was not heard from for this "
        "long is forgotten",
    )


class LearnerSection(BaseModel):
    """``[learner]``: whether the coordinator runs each job's learner, its torch threads, the
    device it computes on, and whether it is one process or FSDP2 ranks under torchrun."""

    model_config = ConfigDict(extra="forbid")
    local: bool = Field(default=True, description="start a learner subprocess per job")
    torch_threads: int = Field(default=1, ge=1)
    device: str = Field(
        default="auto",
        pattern=DEVICE_PATTERN,
        description="where learners train and re-score: auto (a CUDA GPU if torch sees one, "
        "else the CPU), cpu, cuda, cuda:N or mps",
    )
    backend: Literal["single", "fsdp2"] = Field(
        default="single",
        description="single: one learner process; fsdp2: nproc_per_node ranks started by "
        "torchrun, the model sharded with FSDP2 (NCCL on CUDA, gloo on the CPU)",
    )
    nproc_per_node: int = Field(
        default=1, ge=1, le=64, description="ranks of an fsdp2 learner (one per GPU on CUDA)"
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="fsdp2: each decoder layer recomputes its activations in the backward "
        "instead of keeping them (less memory, about one more forward of time)",
    )

    @model_validator(mode="after")
    def _ranks_need_fsdp2(self) -> LearnerSection:
        if self.nproc_per_node > 1 and self.backend != "fsdp2":
            raise ValueError('nproc_per_node > 1 needs backend = "fsdp2"')
        if self.activation_checkpointing and self.backend != "fsdp2":
            raise ValueError('activation_checkpointing needs backend = "fsdp2"')
        if self.backend == "fsdp2" and self.device == "mps":
            raise ValueError("backend fsdp2 runs on cuda or cpu, not mps")
        return self


class BroadcastSection(BaseModel):
    """``[broadcast]``: relay-tree planning and the uplinks it plans with."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(
        default=True, description="plan a relay tree per version (false: every node pulls)"
    )
    learner_upload_bps: float = Field(
        default=12.5e6,
        gt=0,
        description="the learner host's uplink in bytes/s (plans size the learner's fan-out by it)",
    )
    default_node_upload_bps: float = Field(
        default=2.5e6,
        gt=0,
        description="a node's uplink until it has measured its own push rate, bytes/s",
    )
    learner_pace: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="the learner caps its pushes at this fraction of learner_upload_bps (0: no "
        "cap); about 0.9 when its uplink is one drop-tail queue rather than fair-queued",
    )
    max_fanout: int = Field(default=32, ge=1, description="children per relay, at most")
    max_stripes: int = Field(default=16, ge=1, le=64, description="striped trees, at most")
    local_addrs: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="hand out loopback, private and link-local node addresses in plans: "
        "'always' (a swarm on one LAN), 'never', or 'auto': only when every address a plan "
        "announces is one (a swarm on one machine)",
    )

    def local_addrs_policy(self) -> bool | None:
        """:class:`~echo.coordinator.dissemination.planning.Dissemination`'s ``local_addrs``."""
        return {"auto": None, "always": True, "never": False}[self.local_addrs]


class SchedulerSection(BaseModel):
    """``[scheduler]``: how nodes are placed on jobs (``echo.coordinator.scheduling.assign``)."""

    model_config = ConfigDict(extra="forbid")
    every_s: float = Field(default=2.0, gt=0, le=3600, description="seconds between passes")
    min_stay_s: float = Field(
        default=60.0,
        ge=0,
        description="a node serves a job at least this long before it is moved (each switch "
        "costs it a model download)",
    )
    min_gain: float = Field(
        default=0.15,
        ge=0,
        le=1,
        description="share of a job's need a move must gain, net of what its source loses",
    )
    headroom: float = Field(
        default=1.1,
        ge=1,
        le=10,
        description="nodes are activated until a job's throughput is this much above its need",
    )


class JobsSection(BaseModel):
    """``[jobs]``: which of the coordinator's files a submitted job may make it read."""

    model_config = ConfigDict(extra="forbid")
    dataset_roots: list[Path] | None = Field(
        default=None,
        max_length=64,
        description="folders a job's dataset files (task params path, eval_path, any *_path) "
        "must lie in, after symlinks are resolved; relative ones are relative to where the "
        "coordinator runs. Unset: <data_dir>/datasets only; []: no dataset files at all",
    )

    allow_gym: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="reasoning-gym datasets a job may use although their scorer hands answers "
        "to an interpreter no guard covers (echo.tasks.gym_guards.scorer_hazards); they are "
        "scored in the sandbox all the same",
    )

    def check_gym(self, task_name: str, params: Mapping[str, Any]) -> None:
        """Refuse a reasoning-gym dataset whose scorer is not known safe, unless allowed.

        :raises SpecError: naming the dataset, what its scorer calls, and the key that allows it.
        """
        base, _, dataset = task_name.partition(":")
        dataset = dataset or params.get("dataset", "")
        if base != "gym" or not isinstance(dataset, str) or dataset in self.allow_gym:
            return
        from echo.tasks.gym_guards import scorer_hazards

        try:
            hazards = scorer_hazards(dataset)
        except KeyError:
            return  # not a dataset: the task's own check names it
        if hazards:
            raise SpecError(
                f"job: task.name: the scorer of reasoning-gym dataset {dataset!r} calls "
                f"{', '.join(hazards)} on answers; the operator may allow it in "
                "coordinator.toml ([jobs] allow_gym)"
            )

    def roots(self, data_dir: Path) -> list[Path]:
        """The dataset roots as real absolute paths (symlinks resolved), ``data_dir``'s
        ``datasets`` folder when none are configured."""
        given = self.dataset_roots
        if given is None:
            given = [data_dir / DEFAULT_DATASET_ROOT]
        return [Path(os.path.realpath(r)) for r in given]

    def check_task_paths(self, params: Mapping[str, Any], data_dir: Path) -> None:
        """Refuse a task parameter that names a local file (``path``, ``eval_path``, ``*_path``)
        outside :meth:`roots`. Nothing is opened or stat'ed first: the answer must not tell
        whether a file exists elsewhere on this machine.

        :raises SpecError: naming the key (``job: task.params.<key>``) and the roots.
        """
        for key, value in params.items():
            if is_local_path_param(key) and value is not None:
                self.check_local_path(f"job: task.params.{key}", value, data_dir)

    def check_local_path(self, where: str, value: Any, data_dir: Path) -> None:
        """Refuse ``value`` (a job's file or folder on this machine, such as ``lora.init``)
        outside :meth:`roots`, without opening or stat'ing it. :raises SpecError: naming
        ``where``."""
        roots = self.roots(data_dir)
        if not isinstance(value, str) or not value or "\x00" in value:
            raise SpecError(f"{where}: must be a file path")
        real = Path(os.path.realpath(value))  # '..' and symlinks resolved
        if not any(real.is_relative_to(root) for root in roots):
            named = ", ".join(str(r) for r in roots) or "none"
            raise SpecError(
                f"{where}: {value} is not inside this coordinator's dataset roots "
                f"({named}; the operator sets them in coordinator.toml, [jobs] dataset_roots)"
            )


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (mode 0600, whatever the umask),
    replacing it atomically: written to a fresh ``.tmp`` file beside it (an old one, with whatever
    mode or link it had, is removed first), then renamed.

    :raises OSError: the folder is not writable.
    """
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits off, never adds: set it exactly
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


class CoordinatorConfig(BaseModel):
    """The whole ``coordinator.toml``: data dir, listen addresses, HTTP API, the sections."""

    model_config = ConfigDict(extra="forbid")
    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir("echo-swarm")) / "coordinator"
    )
    listen: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/4001"])
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    api_token: str = Field(default="", description="bearer token for the job API; empty = generate")
    verification: VerificationSection = Field(default_factory=VerificationSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    broadcast: BroadcastSection = Field(default_factory=BroadcastSection)
    admission: AdmissionSection = Field(default_factory=AdmissionSection)
    retention: RetentionSection = Field(default_factory=RetentionSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    jobs: JobsSection = Field(default_factory=JobsSection)

    def ensure_token(self) -> str:
        """The API token: configured, or generated once and kept in data_dir (mode 0600)."""
        if self.api_token:
            return self.api_token
        path = self.data_dir / "api_token"
        if path.exists():
            return path.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(24)
        write_private(path, token + "\n")
        return token


def load_config(path: Path | None) -> CoordinatorConfig:
    """Load ``path`` (TOML) or defaults; raises SpecError naming each bad key."""
    data = read_toml(path)
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        raise explain_validation(exc, str(path or "config")) from None
