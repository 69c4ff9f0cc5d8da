"""The coordinator's HTTP API (Starlette on hypercorn/trio), its dashboard and /metrics.

Routes under ``/v1`` need ``Authorization: Bearer <token>``; ``/healthz``, ``/metrics``,
``/v1/info``, the dashboard's static page ``/`` and the volunteers' public routes
(:mod:`echo.coordinator.dashboard.routes`: credit, leaderboard, a node's own row) do not.
Bad job specs get 400 with one line per bad key; a body that
is not a job table (a string, null, a list, nesting past any job's depth), a tracking folder
outside the job's folder and a dataset file outside the operator's ``[jobs] dataset_roots`` are
400s too, and no 400 quotes what a dataset file holds. A submitted spec never answers 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.routing import Route

from echo.coordinator.api.exports import Exports, ExportUnavailable
from echo.coordinator.api.ports import ApiBackend
from echo.coordinator.dashboard.routes import dashboard_routes
from echo.coordinator.jobs.context import check_job
from echo.coordinator.jobs.control import FINISHED
from echo.coordinator.jobs.learners import tail
from echo.coordinator.jobs.names import check_job_name
from echo.coordinator.scheduling.capacity import (
    NodeRate,
    plan,
    recommend_staleness,
    staleness_options,
)
from echo.learner import memory as learner_memory
from echo.protocol.jobspec import JobSpec, SpecError, load_job_toml, parse_job
from echo.tasks.dataset_io import DatasetError

log = logging.getLogger("echo.coordinator.api.app")

# A job spec is a few KB; anything much larger is not one.
MAX_BODY = 256 * 1024
# Nodes heard from within this long count towards a job's capacity plan.
PLAN_NODE_ACTIVE_S = 120


def job_status(coord: ApiBackend, job_id: str) -> dict[str, Any] | None:
    """The job as ``GET /v1/jobs/{id}`` shows it: status, versions, rewards (None if unknown)."""
    row = coord.store.job(job_id)
    if row is None:
        return None
    spec = row.spec
    versions = []
    for v in coord.store.versions(job_id):
        versions.append(
            {
                "version": v.version,
                "kind": v.kind,
                "bytes": v.total_size,
                "trained_groups": v.trained_count,
                "published_at": v.published_at,
                "time_to_all_s": (v.all_nodes_at - v.published_at) if v.all_nodes_at else None,
                "metrics": v.metrics,
            }
        )
    return {
        "job_id": job_id,
        "name": row.name,
        "status": row.status,
        "error": row.error,
        "current_version": row.current_version,
        "steps": spec.get("steps"),
        "task": spec.get("task"),
        "learner_peer_id": row.learner_peer_id,
        "rollouts": coord.store.rollout_counts(job_id),
        "rejected_by_reason": coord.store.job_rejection_counts(job_id),
        "reward_by_version": [
            {"version": v, "mean_reward": r, "groups": n}
            for v, r, n in coord.store.reward_by_version(job_id)
        ],
        "versions": versions,
        "learning": learning_summary(versions),
        "schedule": {**spec.get("schedule", {}), **coord.job_schedule(job_id)},
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


# The status's learning figures summarise this many recent versions.
RECENT_VERSIONS = 10


def learning_summary(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """What asynchrony did to the recent batches, from the learner's own per-version metrics:
    how stale the trained groups were, the importance weights pi/mu (mean, share outside the
    trust region) and the held-out accuracy first and last measured."""
    recent = [v["metrics"] for v in versions[-RECENT_VERSIONS:] if "staleness_mean" in v["metrics"]]
    evals = [
        (v["version"], v["metrics"]["eval_accuracy"])
        for v in versions
        if "eval_accuracy" in v["metrics"]
    ]

    def mean(key: str) -> float | None:
        xs = [m[key] for m in recent if key in m]
        return sum(xs) / len(xs) if xs else None

    return {
        "versions": len(recent),
        "staleness_mean": mean("staleness_mean"),
        "staleness_max": max((m["staleness_max"] for m in recent), default=None),
        "is_w_mean": mean("is_w"),
        "is_w_outside_trust_region": mean("is_w_outside"),
        "clip_frac": mean("clip_frac"),
        "eval_first": evals[0][1] if evals else None,
        "eval_last": evals[-1][1] if evals else None,
        "eval_by_version": [{"version": v, "accuracy": a} for v, a in evals],
    }


def job_plan(coord: ApiBackend, job_id: str) -> dict[str, Any] | None:
    """The capacity model's terms as measured so far (medians over the published versions);
    None for an unknown job."""
    row = coord.store.job(job_id)
    if row is None:
        return None
    spec = row.spec
    versions = coord.store.versions(job_id)
    steps = sorted(s for s in (v.metrics.get("step_s") for v in versions) if s)
    tta = sorted(v.all_nodes_at - v.published_at for v in versions if v.all_nodes_at)
    tokens_per_rollout = coord.store.mean_tokens_per_rollout(job_id) or 1.0
    now = time.time()
    rates = [
        NodeRate(n.node_id, n.tokens_per_s / tokens_per_rollout)
        for n in coord.store.nodes()
        if not n.excluded and now - n.last_seen < PLAN_NODE_ACTIVE_S and n.tokens_per_s > 0
    ]
    R = spec["batch_groups"] * spec["group_size"]
    t_train = steps[len(steps) // 2] if steps else 0.0
    t_bcast = tta[len(tta) // 2] if tta else 0.0
    p = plan(R, t_train, t_bcast, spec["staleness"], rates)
    options = staleness_options(R, t_train, t_bcast, p.available_rollouts_per_s)
    recommended, why = recommend_staleness(options)
    return {
        **p.to_dict(),
        "tokens_per_rollout": tokens_per_rollout,
        "measured_versions": len(versions),
        "staleness": spec["staleness"],
        "staleness_options": [
            {**asdict(o), "period_s": o.period_s if math.isfinite(o.period_s) else None}
            for o in options
        ],
        "recommended_staleness": recommended,
        "recommendation": why,
        "learner_memory": learner_memory.plan(
            spec, coord.config.learner.backend, coord.config.learner.nproc_per_node,
            coord.config.learner.device, coord.config.learner.activation_checkpointing,
        ),  # fmt: skip
    }


def node_list(coord: ApiBackend) -> list[dict[str, Any]]:
    """Every registered node as ``GET /v1/nodes`` shows it."""
    out = []
    for n in coord.store.nodes():
        out.append(
            {
                "node_id": n.node_id,
                "engine": n.engine,
                "tokens_per_s": n.tokens_per_s,
                "accepted": n.accepted,
                "rejected": n.rejected,
                "streak": n.streak,
                "excluded": n.excluded,
                "version": n.version,
                "rejected_by_reason": coord.store.rejection_counts(n.node_id),
                "hardware": n.hardware,
                "last_seen": n.last_seen,
                "upload_bps": n.upload_bps,
            }
        )
    return out


async def read_capped(request: Request, limit: int) -> bytes | None:
    """The request body, or None when it is over ``limit`` bytes: refused on its announced
    Content-Length before a byte is read, else as soon as the streamed body passes the cap."""
    announced = request.headers.get("content-length")
    if announced is not None:
        try:
            if int(announced) > limit:
                return None
        except ValueError:
            return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def parse_submitted(body: bytes, content_type: str) -> JobSpec:
    """The job in a submit request's ``body``: JSON when ``content_type`` says so, else TOML.

    :raises SpecError: bytes that are not UTF-8, JSON or TOML that does not parse (nesting
        past the parser's recursion limit included), or a spec :func:`parse_job` refuses; the
        message says which.
    """
    try:
        text = body.decode()
    except UnicodeDecodeError as exc:
        raise SpecError(f"job spec is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    if not content_type.startswith("application/json"):
        return load_job_toml(text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"job spec is not valid JSON: {exc}") from None
    except RecursionError:  # the C decoder's own limit: far deeper than any job
        raise SpecError("job spec JSON is nested too deeply to be a job") from None
    return parse_job(data)


def check_error(exc: Exception) -> str:
    """The 400 message for what :func:`~echo.coordinator.jobs.context.check_job` raised: a dataset's
    error without the file's content (:attr:`DatasetError.public`), a ValueError or OSError as
    it says, and anything else by its type only (its text may quote what it read), logged here
    with its traceback."""
    if isinstance(exc, DatasetError):
        return exc.public
    if isinstance(exc, (ValueError, OSError)):
        return str(exc)
    log.warning("a submitted job could not be built", exc_info=exc)
    return f"the job cannot be built here ({type(exc).__name__}); the coordinator's log says more"


def merged_flag(request: Request) -> bool | None:
    """``?merged=`` of an export request: absent or "0" False, "1" True, else None (bad)."""
    raw = request.query_params.get("merged", "0")
    return {"0": False, "1": True}.get(raw)


def build_app(coord: ApiBackend) -> Starlette:
    """The Starlette app of the API, the dashboard and /metrics over ``coord``.

    Handlers answer errors as JSON (400 bad spec, 401 bad token, 404 unknown job, 413 too large);
    they raise nothing for bad requests.
    """

    expected = f"Bearer {coord.token}".encode()

    def authorized(request: Request) -> bool:
        # Constant time: how much of a guess matched must not show in the response time.
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        return hmac.compare_digest(given, expected)

    def guard(
        fn: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapper(request: Request) -> Response:
            if not authorized(request):
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            return await fn(request)

        return wrapper

    @guard
    async def submit(request: Request) -> Response:
        body = await read_capped(request, MAX_BODY)
        if body is None:
            return JSONResponse(
                {"error": f"job spec too large (at most {MAX_BODY} bytes)"}, status_code=413
            )
        try:
            spec = parse_submitted(body, request.headers.get("content-type", ""))
            coord.config.jobs.check_task_paths(spec.task.params, coord.config.data_dir)
            if spec.lora is not None and spec.lora.init is not None:  # read by the learner
                coord.config.jobs.check_local_path(
                    "job: lora.init", spec.lora.init, coord.config.data_dir
                )
            coord.config.jobs.check_gym(spec.task.name, spec.task.params)
        except SpecError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:  # the name, the task, its dataset and rewards, before anything is stored
            check_job_name(spec.name)
            await trio.to_thread.run_sync(check_job, spec)
        except Exception as exc:  # whatever building the job raised: the spec is bad, not us
            return JSONResponse({"error": check_error(exc)}, status_code=400)
        job_id = coord.submit_job(spec)
        return JSONResponse({"job_id": job_id}, status_code=201)

    @guard
    async def list_jobs(request: Request) -> Response:
        return JSONResponse(
            [
                {
                    "job_id": r.job_id,
                    "name": r.name,
                    "status": r.status,
                    "current_version": r.current_version,
                    # Placement: nodes, measured need, learner starved or saturated.
                    **coord.job_schedule(r.job_id),
                }
                for r in coord.store.jobs()
            ]
        )

    def job_route(fn):
        """A guarded route about one job: 404 for an unknown id, else ``fn(job_id, request)``."""

        @guard
        async def wrapper(request: Request) -> Response:
            job_id = request.path_params["job_id"]
            if coord.store.job(job_id) is None:
                return JSONResponse({"error": "no such job"}, status_code=404)
            return await fn(job_id, request)

        return wrapper

    @job_route
    async def get_job(job_id: str, request: Request) -> Response:
        return JSONResponse(job_status(coord, job_id))

    @job_route
    async def cancel(job_id: str, request: Request) -> Response:
        return JSONResponse({"cancelled": coord.cancel_job(job_id)})

    @job_route
    async def learner_epoch(job_id: str, request: Request) -> Response:
        """Issue the job a new learner epoch for an external learner (409 once it is over):
        every learner of the job started before is refused from now on."""
        row = coord.store.job(job_id)
        if row is None or row.status in FINISHED:
            return JSONResponse({"error": "the job is over"}, status_code=409)
        return JSONResponse({"epoch": coord.store.issue_learner_epoch(job_id)})

    @job_route
    async def logs(job_id: str, request: Request) -> Response:
        try:
            n = max(1, min(int(request.query_params.get("lines", "100")), 5000))
        except ValueError:
            return JSONResponse({"error": "lines must be an integer"}, status_code=400)
        return PlainTextResponse(tail(coord.job_dir(job_id) / "learner.log", n) + "\n")

    @job_route
    async def capacity(job_id: str, request: Request) -> Response:
        return JSONResponse(job_plan(coord, job_id))

    exports = Exports(coord.store, coord.job_dir)

    @job_route
    async def export(job_id: str, request: Request) -> Response:
        """Write (once) and list the Hugging Face folder of ``?version=N`` (default: newest;
        ``&merged=1``: a LoRA job's adapter merged into its base)."""
        raw = request.query_params.get("version")
        try:
            version = None if raw is None else int(raw)
        except ValueError:
            return JSONResponse({"error": "version must be an integer"}, status_code=400)
        merged = merged_flag(request)
        if merged is None:
            return JSONResponse({"error": "merged must be 0 or 1"}, status_code=400)
        try:
            return JSONResponse(await exports.prepare(job_id, version, merged))
        except ExportUnavailable as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    @job_route
    async def export_file(job_id: str, request: Request) -> Response:
        try:
            version = int(request.path_params["version"])
        except ValueError:
            return JSONResponse({"error": "version must be an integer"}, status_code=400)
        merged = merged_flag(request)
        if merged is None:
            return JSONResponse({"error": "merged must be 0 or 1"}, status_code=400)
        path = exports.file(job_id, version, request.path_params["name"], merged)
        if path is None:
            return JSONResponse({"error": "no such export file"}, status_code=404)
        return FileResponse(path, media_type="application/octet-stream")

    @guard
    async def nodes(request: Request) -> Response:
        return JSONResponse(node_list(coord))

    async def info(request: Request) -> Response:
        return JSONResponse(
            {"multiaddrs": coord.multiaddrs, "peer_id": str(coord.identity.peer_id)}
        )

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(coord.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/metrics", metrics),
            Route("/v1/info", info),
            Route("/v1/jobs", submit, methods=["POST"]),
            Route("/v1/jobs", list_jobs, methods=["GET"]),
            Route("/v1/jobs/{job_id}", get_job),
            Route("/v1/jobs/{job_id}/cancel", cancel, methods=["POST"]),
            Route("/v1/jobs/{job_id}/learner-epoch", learner_epoch, methods=["POST"]),
            Route("/v1/jobs/{job_id}/logs", logs),
            Route("/v1/jobs/{job_id}/plan", capacity),
            Route("/v1/jobs/{job_id}/export", export, methods=["POST"]),
            Route("/v1/jobs/{job_id}/export/{version}/{name}", export_file),
            Route("/v1/nodes", nodes),
            *dashboard_routes(coord, guard),
        ]
    )


async def serve_http(
    coord: ApiBackend, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the API until cancelled; reports the bound addresses through ``task_status``.

    Raises OSError if ``http_host:http_port`` cannot be bound.
    """
    cfg = HyperConfig()
    cfg.bind = [f"{coord.config.http_host}:{coord.config.http_port}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.graceful_timeout = 1.0
    await serve(build_app(coord), cfg, task_status=task_status)
