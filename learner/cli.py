"""``python -m echo.learner``: the learner process's command line and exit statuses.

It parses the arguments the coordinator's supervisor (``coordinator/jobs/learners.py``) or an
operator passes, starts a :class:`~echo.learner.service.Learner`, and maps the ways it can end
to the exit statuses the supervisor acts on (:data:`~echo.learner.service.EXIT_CANNOT_RESUME`,
:data:`~echo.learner.service.EXIT_SUPERSEDED`). With ``--backend fsdp2`` the process is one rank
of a sharded learner under torchrun: rank 0 becomes the Learner, the others follow it
(:mod:`~echo.learner.fsdp.ranks`).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from echo.learner.link import Superseded
from echo.learner.lora import AdapterInitError
from echo.learner.service import EXIT_CANNOT_RESUME, EXIT_SUPERSEDED, Learner, LedgerAhead
from echo.learner.tracking import TrackingError
from echo.p2p.lifecycle import run_until_signalled

log = logging.getLogger("echo.learner")


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Echo swarm learner for one job (started by the "
        "coordinator; also runnable by hand as an external learner)."
    )
    ap.add_argument("--job-dir", type=Path, required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--coordinator", required=True, help="coordinator multiaddr")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device",
        default="auto",
        help="where the policy trains and re-scores: auto (a CUDA GPU if torch sees one), "
        "cpu, cuda, cuda:N or mps",
    )
    ap.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="the learner epoch the coordinator issued this learner (it passes it to the "
        "learners it starts; for an external learner, `echo-job learner-epoch JOB` issues "
        "one); 0: the job never issued one",
    )
    ap.add_argument(
        "--upload-limit-bps",
        type=float,
        default=None,
        help="cap on the learner's pushes to its relay children, bytes/s",
    )
    ap.add_argument(
        "--backend",
        choices=("single", "fsdp2"),
        default="single",
        help="single: one process; fsdp2: one rank of a sharded learner, started by torchrun "
        "(python -m torch.distributed.run), as the coordinator does with [learner] backend",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="fsdp2: each decoder layer recomputes its activations in the backward "
        "([learner] activation_checkpointing)",
    )
    args = ap.parse_args()
    if args.activation_checkpointing and args.backend != "fsdp2":
        ap.error("--activation-checkpointing needs --backend fsdp2")
    if args.upload_limit_bps is not None and args.upload_limit_bps <= 0:
        ap.error("--upload-limit-bps must be positive")
    if args.epoch < 0:
        ap.error("--epoch must be >= 0")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sharded = args.backend == "fsdp2"
    if sharded:
        from echo.learner.fsdp import ranks as rank_roles

    def stop(code: int, why: object) -> SystemExit:
        """Exit with ``code``, saying ``why`` in one line of learner.log."""
        log.error("%s", why)
        # torchrun exits 1 whatever a rank's status: rank 0 leaves it for the supervisor.
        if sharded and os.environ.get("RANK") == "0":
            rank_roles.leave_exit_status(args.job_dir, code, args.epoch, str(why))
        return SystemExit(code)

    ranks = None
    if sharded:
        try:
            ranks = rank_roles.start(
                args.job_dir, args.device, args.threads, args.activation_checkpointing
            )
        except ValueError as exc:  # a device it lacks, not started by torchrun
            raise stop(EXIT_CANNOT_RESUME, exc) from None
        if ranks is None:  # a follower rank: it computed alongside rank 0 until it stopped
            return

    try:
        learner = Learner(
            args.job_dir,
            args.job_id,
            args.coordinator,
            args.threads,
            args.upload_limit_bps,
            args.device,
            args.epoch,
            ranks,
        )
    except (TrackingError, ValueError) as exc:  # one clear line in learner.log, no traceback
        # A device this machine lacks, a tracker that cannot start: a restart would fail alike.
        raise stop(EXIT_CANNOT_RESUME, exc) from None
    # The coordinator stops us with SIGTERM (job cancelled, or it is shutting down).
    try:
        run_until_signalled(learner.run)
    except* LedgerAhead as group:  # one clear line in learner.log, and no restart
        raise stop(EXIT_CANNOT_RESUME, group.exceptions[0]) from None
    except* AdapterInitError as group:  # a bad [job.lora] init folder: a restart fails alike
        raise stop(EXIT_CANNOT_RESUME, group.exceptions[0]) from None
    except* Superseded as group:  # a newer learner holds the job: stop, and stay stopped
        raise stop(EXIT_SUPERSEDED, group.exceptions[0]) from None
    finally:
        if ranks is not None:  # the other ranks wait for rank 0's calls: release them
            # (a learner that failed before it built its trainer has none to stop).
            rank_roles.finish(getattr(learner, "trainer", None))
