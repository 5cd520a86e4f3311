"""The gateway's ASGI app (Starlette): the routes of every API, errors as JSON in each API's own
shape, the web chat page, and `serve` to run it on uvicorn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from peerd.gateway import monitor, openai_api, petals
from peerd.gateway.bodies import MAX_BODY_BYTES, ClientGone
from peerd.gateway.guard import Exposure, Guard
from peerd.gateway.link import DaemonLink, GatewayError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away first (nobody reads it)."""


def render_error(path: str, error: GatewayError) -> Response:
    """`error` in the shape of the API that `path` belongs to."""
    if path.startswith("/v1/"):
        return openai_api.error_response(error)
    return petals.error_response(error)


def _render(request: Request, error: GatewayError) -> Response:
    return render_error(request.url.path, error)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _render(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = exc.detail
    if exc.status_code == 404:
        message = f"no such endpoint {request.url.path}: see docs/gateway.md for the APIs"
    return _render(request, GatewayError(exc.status_code, code, message))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _bug(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path)
    return _render(request, GatewayError(500, "internal", f"the gateway failed: {exc!r}"))


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def status(request: Request) -> Response:
    link: DaemonLink = request.app.state.link
    return JSONResponse({"ok": True, **await link.swarm_status()})


def create_app(
    socket_path: str | Path | None = None,
    *,
    checkpoint: str | Path | None = None,
    swarm_refresh_s: float = monitor.DEFAULT_REFRESH_S,
    exposure: Exposure | None = None,
) -> Starlette:
    """The gateway in front of the daemon on `socket_path` (default: $PEERD_SOCKET, then the
    per-user socket). `checkpoint`: the daemon's model directory when it is not the default,
    for its tokenizer and chat template. `swarm_refresh_s`: how often the /swarm page polls.
    `exposure`: who may use it (default: loopback only, no API key; guard.py)."""
    link = DaemonLink(socket_path, checkpoint)
    exposure = exposure or Exposure()
    middleware = [Middleware(Guard, exposure=exposure, render=render_error)]
    if exposure.allowed_origins:  # their pages' fetch() needs CORS answers to read anything
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=sorted(exposure.allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            facts = await link.model()
            log.info("gateway for %s (%d blocks) via %s", facts.name, facts.num_blocks, socket_path)
        except GatewayError as e:
            log.warning("%s; the gateway answers 503 until the daemon runs", e)
        yield

    app = Starlette(
        routes=[
            Route("/", page),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
            Route("/api/status", status),
            Route("/swarm", monitor.swarm_page),
            Route("/api/v1/swarm", monitor.swarm_json),
            Route("/api/v1/generate", petals.v1_generate, methods=["POST"]),
            Route("/api/v1/models", petals.v1_models),
            WebSocketRoute("/api/v2/generate", petals.v2_generate),
            Route("/v1/models", openai_api.list_models),
            Route("/v1/models/{model:path}", openai_api.get_model),
            Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
            Route("/v1/completions", openai_api.completions, methods=["POST"]),
        ],
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            ClientGone: _client_gone,
            Exception: _bug,
        },
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.link = link
    app.state.swarm_refresh_s = swarm_refresh_s
    return app


def uvicorn_config(app: Starlette, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """How the gateway runs on uvicorn (the CLI and the tests share it)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws_max_size=MAX_BODY_BYTES,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5,
    )


def serve(
    host: str,
    port: int,
    socket_path: str | Path | None,
    checkpoint: str | Path | None = None,
    log_level: str = "info",
    swarm_refresh_s: float = monitor.DEFAULT_REFRESH_S,
    exposure: Exposure | None = None,
) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn.Server(
        uvicorn_config(
            create_app(
                socket_path,
                checkpoint=checkpoint,
                swarm_refresh_s=swarm_refresh_s,
                exposure=exposure,
            ),
            host,
            port,
            log_level,
        )
    ).run()
