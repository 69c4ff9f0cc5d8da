"""What the HTTP API and the learner supervisor may use of the coordinator, as protocols.

:mod:`echo.coordinator.api.app` and :mod:`echo.coordinator.jobs.learners` depend on these small
interfaces rather than on :class:`~echo.coordinator.service.Coordinator`, so neither imports the
daemon that starts them. :class:`~echo.coordinator.service.Coordinator` satisfies
:class:`ApiBackend`;
:class:`~echo.coordinator.jobs.control.JobControl` satisfies :class:`LearnerHost`. Nothing here
runs; it raises nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import Store
from echo.p2p.identity import Identity
from echo.protocol.jobspec import JobSpec

if TYPE_CHECKING:  # the dashboard's parts import the store and the scheduler, which import us
    from echo.coordinator.dashboard.data import EdgeRates
    from echo.coordinator.dashboard.live import LiveFeed
    from echo.coordinator.dissemination.planning import Dissemination
    from echo.coordinator.scheduling.placement import Placement


class LearnerHost(Protocol):
    """What supervising a job's learner process needs: where the job lives, how to start it."""

    @property
    def store(self) -> Store:
        """The coordinator's store."""

    def job_dir(self, job_id: str) -> Path:
        """The job's folder (the learner log goes there)."""

    def learner_command(self, job_id: str) -> list[str]:
        """The command line that starts the job's learner."""


class ApiBackend(Protocol):
    """What the HTTP API needs: the store to report from, the job operations, its own identity."""

    @property
    def store(self) -> Store:
        """The store every report is read from."""

    @property
    def config(self) -> CoordinatorConfig:
        """The configuration (the HTTP bind address)."""

    @property
    def token(self) -> str:
        """The bearer token ``/v1`` routes require."""

    @property
    def metrics(self) -> Metrics:
        """The Prometheus metrics ``/metrics`` exports."""

    @property
    def identity(self) -> Identity:
        """The coordinator's libp2p identity."""

    @property
    def multiaddrs(self) -> list[str]:
        """Where nodes dial the coordinator."""

    def submit_job(self, spec: JobSpec) -> str:
        """Store and start a new job; returns its id."""

    def cancel_job(self, job_id: str) -> bool:
        """Cancel a job; False if it is unknown or already over."""

    def job_dir(self, job_id: str) -> Path:
        """The job's folder (its learner log is served from there)."""

    def job_schedule(self, job_id: str) -> dict[str, Any]:
        """The job's placement: its nodes, measured need, learner starved or saturated."""

    # What the dashboard reads (echo.coordinator.dashboard.routes.DashboardHost).

    @property
    def dissemination(self) -> Dissemination:
        """The relay planner (the dashboard draws its current plans)."""

    @property
    def placement(self) -> Placement:
        """The scheduler's placement (nodes' jobs, its moves)."""

    @property
    def edge_rates(self) -> EdgeRates:
        """The measured rate of each relay edge."""

    @property
    def live(self) -> LiveFeed:
        """The dashboard's live feed."""
