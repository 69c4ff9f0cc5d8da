"""The dashboard's HTTP routes: the static page, its live feeds, and the volunteers' credit.

Public (no token) -- what a volunteer needs to see its own node and credit, and nothing about a
job's data or another node's work beyond its total:

- ``GET /`` and ``GET /dashboard/{file}``: the static bundle (coordinator/dashboard/: no data);
- ``GET /v1/credit/{node}``: the node's signed ledger entries (paged: ``?after=SEQ&limit=N``),
  its total, and its latest rejections with their reasons;
- ``GET /v1/public/nodes/{node}``: the node's row (engine, reachability, tokens/s, version held,
  last seen, accepted and rejected groups);
- ``GET /v1/leaderboard`` and the SSE stream ``GET /v1/public/events`` (leaderboard, swarm size).

Behind the API's bearer token: ``GET /v1/events`` (the operator's SSE stream: every job's
curves, relay tree, nodes and scheduler moves; :mod:`echo.coordinator.dashboard.data`) and
``GET /v1/dashboard`` (one snapshot of it as JSON). Both SSE streams refuse a viewer over the
feed's cap with 503 (:class:`~echo.coordinator.dashboard.live.LiveFeed`).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from echo.coordinator.dashboard.data import DashBackend, leaderboard, reachability
from echo.coordinator.dashboard.live import LiveFeed, sse_stream
from echo.p2p.identity import Identity
from echo.protocol.credit import UCREDITS_PER_CREDIT

# The bundle sits beside this module; only the files BUNDLE names are served from it.
STATIC = Path(__file__).parent
# The files of the bundle, by the name the page asks for (nothing else is served from there).
BUNDLE = {
    "app.js": "text/javascript",
    "style.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "LICENSE.uPlot": "text/plain",
}
MAX_ENTRIES_PAGE = 1000
MAX_NODE_ID = 128
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The page loads only its own bundle and talks only to this server: a job name or node id that
# carries markup could not load or send anything elsewhere even if it reached the page as HTML.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}

Handler = Callable[[Request], Awaitable[Response]]


class DashboardHost(DashBackend, Protocol):
    """What the routes need beyond the snapshots: the feed, and the key entries are signed by."""

    @property
    def live(self) -> LiveFeed: ...

    @property
    def identity(self) -> Identity: ...


class _FeedResponse(StreamingResponse):
    """An SSE response that gives its feed slot back as soon as it ends, however it ends (the
    client left, the server stops): its receiving channel is closed here, not whenever the
    abandoned generator is collected."""

    def __init__(self, recv: trio.MemoryReceiveChannel[bytes]) -> None:
        super().__init__(sse_stream(recv), media_type="text/event-stream", headers=SSE_HEADERS)
        self._recv = recv

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._recv.close()


def _bad(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


def _node_param(request: Request) -> str | None:
    node = request.path_params["node"]
    return node if 0 < len(node) <= MAX_NODE_ID else None


def dashboard_routes(coord: DashboardHost, guard: Callable[[Handler], Handler]) -> list[Route]:
    """The routes of the module docstring; ``guard`` wraps the token-only ones."""

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in BUNDLE:
            return _bad("no such file", 404)
        return FileResponse(STATIC / name, media_type=BUNDLE[name], headers=PAGE_HEADERS)

    def events(public: bool) -> Handler:
        async def stream(request: Request) -> Response:
            recv = coord.live.subscribe(public)
            if recv is None:
                return _bad("too many dashboard viewers; try again later", 503)
            return _FeedResponse(recv)

        return stream

    async def dashboard_json(request: Request) -> Response:
        return JSONResponse(coord.live.build_full())

    async def credit(request: Request) -> Response:
        node = _node_param(request)
        if node is None:
            return _bad(f"a node id is 1 to {MAX_NODE_ID} characters")
        try:
            after = int(request.query_params.get("after", "-1"))
            limit = int(request.query_params.get("limit", str(MAX_ENTRIES_PAGE)))
        except ValueError:
            return _bad("after and limit must be integers")
        if not 1 <= limit <= MAX_ENTRIES_PAGE:
            return _bad(f"limit must be 1 to {MAX_ENTRIES_PAGE}")
        store = coord.store
        total, count = store.credit_total(node)
        rows = store.credit_entries(node, after, limit)
        return JSONResponse(
            {
                "node_id": node,
                "total_ucredits": total,
                "credits": total / UCREDITS_PER_CREDIT,
                "entries_total": count,
                "by_kind": store.credit_by_kind(node),
                "coordinator_peer_id": coord.identity.peer_id_str,
                "coordinator_key": coord.identity.public_key_bytes.hex(),
                "entries": [
                    {
                        "seq": r.seq,
                        "kind": r.kind,
                        "job_id": r.job_id,
                        "version": r.version,
                        "amount": r.amount,
                        "at": r.at,
                        "envelope": base64.b64encode(r.envelope).decode(),
                    }
                    for r in rows
                ],
                "next_after": rows[-1].seq if rows and rows[-1].seq < count - 1 else None,
                "recent_rejections": store.recent_rejections(node),
            }
        )

    async def public_node(request: Request) -> Response:
        node = _node_param(request)
        row = coord.store.node(node) if node is not None else None
        if row is None:
            return _bad("no such node", 404)
        placed = coord.placement.nodes.get(row.node_id)
        out: dict[str, Any] = {
            "node_id": row.node_id,
            "engine": row.engine,
            "reachability": reachability(coord, row.node_id),
            "tokens_per_s": row.tokens_per_s,
            "version": row.version,
            "job": placed.job if placed is not None else None,
            "last_seen": row.last_seen,
            "seconds_since_seen": max(0.0, time.time() - row.last_seen),
            "accepted": row.accepted,
            "rejected": row.rejected,
            "excluded": row.excluded,
            "rejected_by_reason": coord.store.rejection_counts(row.node_id),
        }
        return JSONResponse(out)

    async def board(request: Request) -> Response:
        return JSONResponse(leaderboard(coord.store))

    return [
        Route("/", index),
        Route("/dashboard/{name}", static),
        Route("/v1/events", guard(events(public=False))),
        Route("/v1/dashboard", guard(dashboard_json)),
        Route("/v1/public/events", events(public=True)),
        Route("/v1/credit/{node}", credit),
        Route("/v1/public/nodes/{node}", public_node),
        Route("/v1/leaderboard", board),
    ]
