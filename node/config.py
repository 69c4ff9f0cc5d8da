"""The volunteer's settings: a ``node.toml`` file and/or flags, validated with clear messages."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo.node.priority import DEFAULT_NICE
from echo.protocol.jobspec import explain_validation, read_toml


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    coordinator: str = Field(default="", description="coordinator multiaddr (/ip4/.../p2p/...)")
    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir("echo-swarm")) / "node"
    )
    engine: str = Field(default="auto", description="auto | torch | llamacpp | vllm")
    device: str = Field(default="auto", description="auto | cpu | cuda | mps (torch engine)")
    threads: int | None = Field(
        default=None, ge=1, le=1024, description="CPU threads for the engine"
    )
    gpu_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    max_tokens_per_s: float | None = Field(default=None, gt=0, description="throughput cap")
    schedule: str | None = Field(
        default=None, description="local hours to work, e.g. '22:00-07:00'; unset = always"
    )
    leases_at_once: int = Field(default=2, ge=1, le=64, description="groups generated per batch")
    max_upload_mbps: float | None = Field(
        default=None,
        gt=0,
        description="cap on the upload spent relaying weights to other nodes, MB/s (unset: no "
        "cap); behind a router without fair queueing, about 90% of your uplink keeps its queue "
        "from overflowing",
    )
    listen: str = "/ip4/127.0.0.1/tcp/0"
    keep_weights: bool = Field(
        default=False, description="write the held policy to data_dir/policy.safetensors"
    )
    cost: float = Field(
        default=1.0,
        ge=0,
        le=1e9,
        description="what an hour of this machine costs, in the operator's units (default 1.0): "
        "the coordinator's scheduler activates the cheapest nodes per unit of throughput first",
    )
    max_disk_gb: float = Field(
        default=10.0,
        ge=0,
        le=1e6,
        description="disk the weights of jobs this node no longer serves may keep, GB (oldest "
        "pruned first when the node switches jobs; 0: keep only the current job's)",
    )

    api: str = Field(
        default="",
        description="the coordinator's HTTP address (http://HOST:PORT): the node then shows its "
        "verified credit in echo-node status and on its local page",
    )
    nice: int = Field(
        default=DEFAULT_NICE,
        ge=0,
        le=19,
        description="CPU priority the node runs at, as nice (0 to 19): higher yields more of "
        "the machine to its other work; 0 runs at normal priority",
    )
    ui_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve a status page for the volunteer on http://127.0.0.1:PORT/ (localhost "
        "only; 0 picks a free port); unset: none",
    )

    @field_validator("api")
    @classmethod
    def _api(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"api {v!r} is not an http:// or https:// address")
        return v.rstrip("/")

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str | None) -> str | None:
        if v is not None:
            parse_schedule(v)
        return v

    def working_now(self, now: dt.datetime | None = None) -> bool:
        if self.schedule is None:
            return True
        start, end = parse_schedule(self.schedule)
        t = (now or dt.datetime.now()).time()
        return start <= t < end if start <= end else (t >= start or t < end)


def parse_schedule(text: str) -> tuple[dt.time, dt.time]:
    try:
        a, b = text.split("-")
        return dt.time.fromisoformat(a.strip()), dt.time.fromisoformat(b.strip())
    except ValueError:
        raise ValueError(f"schedule {text!r} is not 'HH:MM-HH:MM'") from None


def load_node_config(path: Path | None, overrides: dict) -> NodeConfig:
    data = read_toml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as exc:
        raise explain_validation(exc, str(path or "node settings")) from None
