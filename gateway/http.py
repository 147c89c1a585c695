"""The gateway's HTTP server: FastAPI routes of the OpenAI-compatible API, run by uvicorn
inside the gateway's own asyncio loop (``HttpServer``).

``POST /v1/completions``, ``POST /v1/chat/completions`` (openai_door.py), ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health`` (503 while Redis does not answer),
``GET /version``. Every response is counted by route and status
(``pagefleet:gateway_http_requests_total``); completion requests are also counted and
traced as Generate calls are (observe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import time
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pagefleet import __version__
from pagefleet.common.chat_template import load_chat_template

from .core import GatewayCore
from .openai_door import ApiError, OpenAIDoor
from .openai_request import parse_chat, parse_completion

log = structlog.get_logger("gateway")

# FastAPI versions with built-in OpenTelemetry would add a second SERVER span to every
# request (and spans of their own inside it): the gateway's spans are observe.py's.
_NO_NATIVE_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
)


def build_app(core: GatewayCore, served_model_name: str) -> FastAPI:
    door = OpenAIDoor(core, served_model_name, load_chat_template(core.model))
    app = FastAPI(title="pagefleet", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  **_NO_NATIVE_TELEMETRY)
    app.add_middleware(CountResponses, counter=core.metrics.http_requests)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await door.completion(request, "/v1/completions", parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await door.completion(request, "/v1/chat/completions", parse_chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await door.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != served_model_name:
            return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                            "model_not_found").response()
        return JSONResponse(door.model_card())

    @app.get("/health")
    async def health() -> Response:
        if not await core.ping():
            return ApiError(503, "the request queue (Redis) is unreachable", "service_unavailable_error",
                            code="queue_unavailable").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), type_).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        log.exception("http.error", path=request.url.path)
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()

    return app


class CountResponses:
    """ASGI middleware: every HTTP response counted by route and status."""

    def __init__(self, app, counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            route = scope.get("route")
            self.counter.labels(getattr(route, "path", "other"), str(status)).inc()


class _Server(uvicorn.Server):
    """uvicorn inside the gateway's loop: the gateway owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The HTTP door on ``--host``:``--http-port`` (0: a free port; ``port`` is the bound one)."""

    def __init__(self, core: GatewayCore, args) -> None:
        app = build_app(core, args.served_model_name or args.model)
        self.config = uvicorn.Config(app, host=args.host, port=args.http_port, log_config=None, access_log=False,
                                     lifespan="off", ws="none", timeout_graceful_shutdown=2)
        self.server = _Server(self.config)
        self.port = 0
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> HttpServer:
        host = self.config.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.config.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout_s}s")
            await asyncio.sleep(0.01)
        log.info("http.serving", host=self.config.host, http_port=self.port)
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            await self._task


