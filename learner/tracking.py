"""Experiment tracking: the learner's per-version metrics in TensorBoard, trackio or W&B.

:func:`open_tracker` turns a job's ``[job.tracking]`` table
(:class:`~echo.protocol.jobspec.TrackingSection`) into a :class:`Tracker`, or None when the job
asks for none. A tracker owns its backend's writer: :meth:`Tracker.log` records one published
version (its step is the version number) and :meth:`Tracker.close` flushes. Everything is local:
TensorBoard event files, trackio's SQLite store, W&B in offline mode (``wandb sync`` uploads it
later, if the researcher wants).

The backends' packages are optional and imported only here, when a job asks for one; a missing
package is one :class:`TrackingError` naming the extra to install (the coordinator refuses such a
job at submit already when its learner is local).

What is logged, under stable names (:data:`TAGS`): the batch's mean reward, held-out accuracy,
the loss and gradient norm, the step's off-policy figures (mean absolute log-prob mismatch
between the learner and the nodes' engines, the importance weight pi/mu and the share of tokens
outside the trust region, the clipped share), staleness, and throughput (tokens trained per
second of wall clock between versions, and per second of step). KL to the base model is not
computed by the step, so it is not logged; the mismatch and importance-weight figures are what
the step measures of how far the policy moved from the samples' policy.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from echo.protocol.jobspec import TRACKING_PACKAGES, TrackingSection

log = logging.getLogger("echo.learner")

# The learner's metric keys -> the names they are logged under (grouped for the dashboards).
TAGS = {
    "reward": "rollout/reward_mean",
    "staleness_mean": "rollout/staleness_mean",
    "staleness_max": "rollout/staleness_max",
    "tokens": "rollout/tokens",
    "rejected": "rollout/rejected_groups",
    "signal_groups": "rollout/signal_groups",
    "kl": "policy/kl_to_start",
    "eval_accuracy": "eval/accuracy",
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "clip_frac": "train/clip_frac",
    "mismatch": "policy/logprob_mismatch",
    "is_w": "policy/importance_weight_mean",
    "is_w_outside": "policy/importance_weight_outside_trust_region",
    "step_s": "time/step_s",
    "rescore_s": "time/rescore_s",
    "eval_s": "time/eval_s",
    "payload_bytes": "publish/payload_bytes",
}
# Derived here: tokens over wall-clock seconds since the previous version, and over the step.
TOKENS_PER_S = "throughput/tokens_per_s"
STEP_TOKENS_PER_S = "throughput/step_tokens_per_s"


class TrackingError(RuntimeError):
    """The job's tracking backend cannot start (its package is missing, or it refused)."""


def tracked(metrics: Mapping[str, float], wall_s: float | None) -> dict[str, float]:
    """The figures logged for one version: known keys under their :data:`TAGS` names, any other
    under ``learner/<key>``, plus throughput when ``tokens`` was reported (over ``wall_s``, the
    seconds since the previous version, when known)."""
    out = {TAGS.get(k, f"learner/{k}"): float(v) for k, v in metrics.items()}
    tokens = metrics.get("tokens")
    if tokens is not None:
        if wall_s:
            out[TOKENS_PER_S] = tokens / wall_s
        if metrics.get("step_s"):
            out[STEP_TOKENS_PER_S] = tokens / metrics["step_s"]
    return out


def _import(backend: str) -> Any:
    module, extra = TRACKING_PACKAGES[backend]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackingError(
            f"[job.tracking] backend {backend!r} needs the {module} package ({exc}): "
            f"pip install 'echo-swarm[{extra}]'"
        ) from None


class Tracker:
    """One job's tracking run; see the module docstring. Not thread-safe: one caller at a time."""

    def __init__(self, backend: str, writer: Any, folder: Path) -> None:
        self.backend = backend
        self.folder = folder
        self._writer = writer
        self._last: float | None = None

    def log(self, version: int, metrics: Mapping[str, float]) -> None:
        """Record version ``version``'s metrics (see :func:`tracked`). A backend that fails to
        write is logged and never stops training."""
        now = time.monotonic()
        values = tracked(metrics, None if self._last is None else now - self._last)
        self._last = now
        try:
            if self.backend == "tensorboard":
                for tag, value in values.items():
                    self._writer.add_scalar(tag, value, global_step=version)
                self._writer.flush()
            else:  # trackio and wandb runs share the call
                self._writer.log(values, step=version)
        except Exception as exc:  # tracking is an observer: it must not take the learner down
            log.warning("tracking (%s) failed to log v%d: %s", self.backend, version, exc)

    def close(self) -> None:
        """Flush and close the run (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close() if self.backend == "tensorboard" else writer.finish()
        except Exception as exc:
            log.warning("tracking (%s) did not close cleanly: %s", self.backend, exc)


def tracking_folder(section: TrackingSection, job_dir: Path, job_id: str) -> tuple[Path, str]:
    """The folder the run writes to and the run's name: ``dir`` under ``job_dir`` (default
    ``tracking``) and ``run_name`` (default the job id), checked to stay inside ``job_dir``
    after ``..`` and symlinks are resolved. A submitted job was checked already
    (:meth:`~echo.protocol.jobspec.TrackingSection.escape_problem`); this refuses one stored
    by an older build, or written into the job's ``job.json`` by hand.

    :raises TrackingError: naming the key whose folder is outside the job's folder.
    """
    name = section.run_name or job_id
    folder = job_dir / (section.dir or "tracking")  # an absolute dir would replace job_dir
    home = Path(os.path.realpath(job_dir))
    for key, path in (("dir", folder), ("run_name", folder / name)):
        real = Path(os.path.realpath(path))
        if real != home and not real.is_relative_to(home):
            raise TrackingError(
                f"[job.tracking] {key}: {path} is outside the job's folder {job_dir}; "
                "give a relative path without '..'"
            )
    return folder, name


def open_tracker(
    section: TrackingSection, job_dir: Path, job_id: str, config: Mapping[str, Any]
) -> Tracker | None:
    """The tracker ``section`` asks for (None for backend 'none'), writing under its ``dir``
    (relative to ``job_dir``; default ``job_dir/tracking``; see :func:`tracking_folder`);
    ``config`` is recorded as the run's hyper-parameters where the backend keeps them.

    :raises TrackingError: the folder is outside ``job_dir``, the backend's package is missing
        (naming the extra to install) or the backend refused to start.
    """
    if section.backend == "none":
        return None
    folder, name = tracking_folder(section, job_dir, job_id)
    folder.mkdir(parents=True, exist_ok=True)
    if section.backend == "trackio":  # trackio reads where its store lives when imported
        os.environ["TRACKIO_DIR"] = str(folder)
    lib = _import(section.backend)
    try:
        if section.backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            del lib  # imported only to name the extra when missing; torch's writer uses it
            writer: Any = SummaryWriter(log_dir=str(folder / name))
        elif section.backend == "wandb":
            writer = lib.init(
                project=section.project,
                name=name,
                dir=str(folder),
                mode="offline",
                config=dict(config),
            )
        else:
            writer = lib.init(project=section.project, name=name, config=dict(config))
    except Exception as exc:
        msg = f"[job.tracking] backend {section.backend!r} did not start: {exc}"
        raise TrackingError(msg) from exc
    log.info("tracking to %s in %s (run %s)", section.backend, folder, name)
    return Tracker(section.backend, writer, folder)
