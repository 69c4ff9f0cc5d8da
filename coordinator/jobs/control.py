"""Job control: submitting, resuming and cancelling jobs, and starting each job's local learner.

:class:`JobControl` owns the runtime context of every live job (:attr:`JobControl.jobs`, which
the RPC handlers read; only this class adds to it) and the cancel scope of each local learner
process, which runs under :func:`~echo.coordinator.jobs.learners.supervise_learner` in the nursery
given to :meth:`JobControl.resume`. Cancelling a job cancels that scope, which stops its learner.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import trio

from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.jobs import names
from echo.coordinator.jobs.context import RunningJob, load_running_job
from echo.coordinator.jobs.learners import supervise_learner
from echo.coordinator.jobs.names import check_job_name
from echo.coordinator.metrics import Metrics
from echo.coordinator.store import Store
from echo.p2p.identity import Identity
from echo.protocol.jobspec import JobSpec

log = logging.getLogger("echo.coordinator")

# Jobs that are over: cancelling one changes nothing.
FINISHED = ("done", "cancelled", "failed")


class JobControl:
    """The live jobs and their learners; see the module docstring.

    ``multiaddrs`` returns where the coordinator listens (a learner is told to dial the first).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        store: Store,
        metrics: Metrics,
        multiaddrs: Callable[[], list[str]],
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.jobs: dict[str, RunningJob] = {}
        self._multiaddrs = multiaddrs
        self._nursery: trio.Nursery | None = None
        self._learner_scopes: dict[str, trio.CancelScope] = {}

    def resume(self, nursery: trio.Nursery) -> None:
        """Load every pending or running job, and start their learners in ``nursery``.

        Jobs submitted later start theirs there too. A stored job this build cannot load (its
        task, model or dataset gone, or a spec an older build let through, such as a dataset
        outside today's ``[jobs] dataset_roots``) is marked failed with the reason, and the
        others start: one bad job never stops the coordinator.
        """
        self._nursery = nursery
        for row in self.store.jobs(["pending", "running"]):
            try:
                task = row.spec.get("task") or {}
                self.config.jobs.check_task_paths(task.get("params") or {}, self.config.data_dir)
                self.config.jobs.check_gym(task.get("name", ""), task.get("params") or {})
                self._start(row.job_id)
            except Exception as exc:  # whatever loading raised: the job fails, not the daemon
                self.jobs.pop(row.job_id, None)
                self.store.set_job_status(row.job_id, "failed", f"cannot load the job: {exc}")
                log.error("job %s cannot be loaded, marked failed: %s", row.job_id, exc)

    def _start(self, job_id: str) -> None:
        self.jobs[job_id] = load_running_job(self.store, job_id)
        row = self.store.job(job_id)
        if self.config.learner.local and row is not None and row.learner_pubkey is not None:
            scope = trio.CancelScope()
            self._learner_scopes[job_id] = scope
            assert self._nursery is not None, "resume() first"
            self._nursery.start_soon(supervise_learner, self, job_id, scope)

    def submit(self, spec: JobSpec) -> str:
        """Store a new job, pin its learner key (the spec's, or one generated in its folder),
        and start it; returns its id. Raises ValueError for a name that may not name a folder
        (see :mod:`echo.coordinator.jobs.names`), OSError if the job folder cannot be written."""
        job_id = f"{check_job_name(spec.name)[:32]}-{secrets.token_hex(4)}"
        job_dir = self.job_dir(job_id)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "job.json").write_text(spec.model_dump_json(indent=2))
        self.store.create_job(job_id, spec.name, spec.model_dump(mode="json"))
        if spec.learner_public_key:
            pub = bytes.fromhex(spec.learner_public_key)
        else:
            pub = Identity.load_or_create(job_dir / "learner.key").public_key_bytes
        self.store.set_learner_key(job_id, pub)
        self._start(job_id)
        self.metrics.jobs_submitted.inc()
        log.info("job %s submitted (%s, %d steps)", job_id, spec.task.name, spec.steps)
        return job_id

    def cancel(self, job_id: str) -> bool:
        """Cancel the job and stop its learner; False if it is unknown or already over."""
        row = self.store.job(job_id)
        if row is None or row.status in FINISHED:
            return False
        self.store.set_job_status(job_id, "cancelled")
        scope = self._learner_scopes.get(job_id)
        if scope is not None:
            scope.cancel()
        return True

    def job_dir(self, job_id: str) -> Path:
        """The job's folder: its spec, learner key, checkpoints and learner log.

        :raises ValueError: ``job_id`` cannot name a folder under ``data_dir/jobs``.
        """
        return names.job_dir(self.config.data_dir, job_id)

    def _learner_launcher(self) -> list[str]:
        """What runs ``-m echo.learner``: Python itself, or torchrun for an FSDP2 learner
        (its own rendezvous on a free local port; one failed rank ends them all, and the
        supervisor restarts the learner from its checkpoint, so torchrun restarts nothing)."""
        lc = self.config.learner
        if lc.backend != "fsdp2":
            return [sys.executable, "-m"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={lc.nproc_per_node}",
            "--max-restarts=0",
            "-m",
        ]

    def learner_command(self, job_id: str) -> list[str]:
        """The command line of the job's local learner (it dials the first listen address).

        Each call issues the job a new learner epoch (:mod:`~echo.coordinator.store.epochs`)
        and puts it on the command line: the process about to start is the only learner the
        coordinator hears from then on, and any started before (an orphan of a killed
        coordinator, a copy run by hand) is refused. Call it once per process started.
        """
        epoch = self.store.issue_learner_epoch(job_id)
        cmd = [
            *self._learner_launcher(),
            "echo.learner",
            "--job-dir",
            str(self.job_dir(job_id)),
            "--job-id",
            job_id,
            "--coordinator",
            self._multiaddrs()[0],
            "--threads",
            str(self.config.learner.torch_threads),
            "--device",
            self.config.learner.device,
            "--epoch",
            str(epoch),
        ]
        if self.config.learner.backend == "fsdp2":
            cmd += ["--backend", "fsdp2"]
            if self.config.learner.activation_checkpointing:
                cmd += ["--activation-checkpointing"]
        bc = self.config.broadcast
        if bc.learner_pace > 0:
            cmd += ["--upload-limit-bps", str(bc.learner_pace * bc.learner_upload_bps)]
        return cmd
