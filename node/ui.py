"""``echo-node join --ui-port``: a status page for the volunteer, served by the node itself.

It serves the node's own state (:meth:`~echo.node.state.StatusKeeper.snapshot`, the same data as
``DATA_DIR/status.json``) as ``/status.json``, and a page (``ui_page.html``, no script
from elsewhere) that shows it and refreshes every two seconds. It binds 127.0.0.1 only and
holds no token: nothing it serves leaves the machine. A web page that the volunteer opens
elsewhere could still aim its requests at 127.0.0.1 under its own host name (DNS rebinding), so
a request whose ``Host`` header is not this machine's loopback name is refused.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from echo.node.state import StatusKeeper

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def local_host(host_header: str) -> bool:
    """Whether ``host_header`` names this machine's loopback (any port)."""
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    return name.lower() in LOOPBACK_NAMES


def build_ui(keeper: StatusKeeper) -> Starlette:
    """The page's app: ``/`` (the page) and ``/status.json`` (the node's state)."""
    page = resources.files("echo.node").joinpath("ui_page.html").read_text()

    def guarded(handler):
        async def route(request: Request) -> Response:
            if not local_host(request.headers.get("host", "")):
                return PlainTextResponse("this page answers on 127.0.0.1 only", status_code=403)
            return await handler(request)

        return route

    async def index(_: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def status(_: Request) -> Response:
        return JSONResponse(keeper.snapshot(), headers={"Cache-Control": "no-store"})

    return Starlette(routes=[Route("/", guarded(index)), Route("/status.json", guarded(status))])


async def serve_ui(
    keeper: StatusKeeper,
    port: int,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page on 127.0.0.1:``port`` (0: a free one) until cancelled; reports the bound
    address (``http://127.0.0.1:PORT``) through ``task_status``.

    :raises NodeError: the port cannot be bound (another program holds it).
    """
    from echo.node.errors import NodeError

    cfg = HyperConfig()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.graceful_timeout = 1.0
    try:
        await serve(build_ui(keeper), cfg, task_status=task_status)
    except* OSError as group:  # hypercorn binds inside its own nursery
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        why = getattr(exc, "strerror", None) or exc
        raise NodeError(
            f"cannot serve the status page on 127.0.0.1:{port} ({why}): pick "
            "another --ui-port, or 0 for a free one"
        ) from None
