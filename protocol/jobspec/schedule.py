"""The operator's say in where nodes go (``[job.schedule]``): priority and the largest share of
the swarm a job may hold."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ScheduleSection(BaseModel):
    """``[job.schedule]``: the operator's say in where the coordinator's scheduler puts nodes
    (``echo.coordinator.scheduling.assign``)."""

    model_config = ConfigDict(extra="forbid")
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="a job of higher priority has its measured need met before a lower one "
        "gets more than its first node; equal priorities share by how far each is from its need",
    )
    max_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="the largest fraction of the swarm's nodes this job may hold (at least one)",
    )
