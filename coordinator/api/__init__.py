"""The coordinator's HTTP face: the Starlette app (jobs, reports, exports, /metrics, the
dashboard), what that app and the learner supervisor may use of the coordinator (:mod:`.ports`),
and ``echo-job``, the researcher's client of the same API (:mod:`.job_cli`, which talks HTTP
only and so imports nothing else of the coordinator)."""
