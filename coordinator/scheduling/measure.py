"""The per-job terms of the capacity model, as measured, and how busy each learner really is.

:func:`job_terms` reads a job's recent versions from the store: the learner's time per version
(its step and the publish's encoding, ``step_s + encode_s`` in the metrics it reports), the
time until every node serving the job held a version, and the rollout length; from these the
capacity model gives the job's need
(:func:`echo.coordinator.scheduling.capacity.required_throughput`).
:func:`learner_busy` is the measured counterpart of the model's ``learner_busy``: the share of
the wall time between versions the learner spent computing them rather than waiting for
rollouts. Both raise nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from echo.coordinator.scheduling.capacity import required_throughput
from echo.coordinator.store import Store
from echo.coordinator.store.rows import VersionRow

# The terms are medians over this many recent versions: a job's pace changes as it runs.
RECENT = 10


def learner_seconds(metrics: dict[str, float]) -> float:
    """The learner's own time on one version: the step and the publish's encoding."""
    return float(metrics.get("step_s", 0.0)) + float(metrics.get("encode_s", 0.0))


def learner_busy(points: Sequence[tuple[float, float]]) -> float | None:
    """Measured utilization from ``(published_at, learner_seconds)`` of consecutive versions:
    the learner seconds of every version after the first over the wall time they spanned
    (None with fewer than two versions). Capped at 1."""
    if len(points) < 2:
        return None
    span = points[-1][0] - points[0][0]
    if span <= 0:
        return None
    return min(1.0, sum(s for _, s in points[1:]) / span)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


@dataclass(frozen=True)
class JobTerms:
    """The capacity model's terms for one job, measured over its recent versions."""

    R: int  # rollouts (completions) per update
    t_train_s: float  # the learner's seconds per version (0: none trained yet)
    t_bcast_s: float  # time until every node serving the job held a version
    kappa: int
    tokens_per_rollout: float
    busy: float | None  # measured learner utilization over the recent versions

    @property
    def need_rps(self) -> float | None:
        """Rollouts/s that keep the learner busy; None while not measured, or when broadcast
        alone outlasts kappa steps (then no throughput suffices: the job takes what fits)."""
        if self.t_train_s <= 0:
            return None
        need = required_throughput(self.R, self.t_train_s, self.t_bcast_s, self.kappa)
        return need if math.isfinite(need) else None


def terms_from_versions(
    versions: Sequence[VersionRow], R: int, staleness: int, tokens_per_rollout: float
) -> JobTerms:
    """:class:`JobTerms` from a job's published versions (oldest first). Version 0 is the base
    policy (no step), so it only anchors the wall time."""
    recent = list(versions[-(RECENT + 1) :])
    trained = [learner_seconds(v.metrics) for v in recent if v.version > 0]
    trained = [s for s in trained if s > 0]
    # Version 0's time to all nodes is the nodes starting or switching in (engine start, model
    # download: 25-37 s in benchmarks/scheduling.py), not dissemination; counted, it was the
    # median T_bcast of a short job and made its need unreachable ("broadcast too slow").
    tta = [v.all_nodes_at - v.published_at for v in recent if v.all_nodes_at and v.version > 0]
    busy = learner_busy([(v.published_at, learner_seconds(v.metrics)) for v in recent])
    return JobTerms(
        R=R,
        t_train_s=_median(trained),
        t_bcast_s=_median(tta),
        kappa=max(1, staleness - 1),
        tokens_per_rollout=tokens_per_rollout,
        busy=busy,
    )


def job_terms(store: Store, job_id: str, spec: dict, max_new_tokens: int) -> JobTerms:
    """The terms of ``job_id`` (``spec``: its stored JobSpec as JSON) from the store; a job
    with no rollouts yet counts ``max_new_tokens`` per rollout."""
    tpr = store.mean_tokens_per_rollout(job_id) or float(max_new_tokens)
    R = int(spec["batch_groups"]) * int(spec["group_size"])
    return terms_from_versions(store.versions(job_id), R, int(spec["staleness"]), tpr)
