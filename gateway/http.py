"""The gateway's HTTP server: FastAPI routes of the OpenAI-compatible API, run by uvicorn
inside the gateway's own asyncio loop (``HttpServer``).

``POST /v1/completions``, ``POST /v1/chat/completions`` (openai_door.py), ``POST /v1/responses``
(responses_api.py), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (openai_tokenize.py), ``GET /v1/models/{model}``, ``GET /health`` (503 while Redis does not answer),
``GET /version``, ``GET|POST /ping`` (as ``/health``, for load balancers that probe it), ``GET
/metrics`` (the gateway's Prometheus metrics, as on ``--metrics-port``; summed over the
processes of ``--processes``). Every response is counted by route and status
(``pagefleet:gateway_http_requests_total``); completion requests are also counted and
traced as Generate calls are (observe.py).

CORS (``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``,
vLLM's flags and defaults: every origin, no credentials) answers browsers' preflights first.

Guards, outside the routes (``Doors``, guard.py): with keys, every path but ``/health`` and ``/ping`` needs
``Authorization: Bearer <key>`` (else 401, before the body is read); a body past
``--max-request-bytes`` is refused with 413; with ``--tls-cert`` the server speaks only TLS
(and with ``--tls-client-ca`` wants a client certificate). Connections (http_conn.py): at most
``--max-connections`` open, headers within ``--http-header-timeout``, body pieces within
``--http-body-timeout`` of each other; else 503 or 408 and closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import socket
import ssl
import time
from typing import Any

import prometheus_client
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from pagefleet import __version__
from pagefleet.common.api_keys import ApiKeys, Unauthenticated, caller
from pagefleet.common.chat_template import load_chat_template

from .core import GatewayCore
from .guard import Doors
from .http_conn import guarded_protocol
from .limits import Limits, TooLarge
from .models import Router, UnknownModel
from .openai_door import ApiError, OpenAIDoor
from .openai_request import parse_chat, parse_completion
from .openai_tokenize import detokenize, tokenize
from .reasoning import REASONING_PARSERS
from .responses_api import parse_responses
from .tool_parsers import TOOL_CALL_PARSERS

log = structlog.get_logger("gateway")

# FastAPI versions with built-in OpenTelemetry would add a second SERVER span to every
# request (and spans of their own inside it): the gateway's spans are observe.py's.
_NO_NATIVE_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
)


def add_http_flags(parser) -> None:
    """The OpenAI door's own flags (the limits on its connections are limits.py's)."""
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="the model's tool-call format, parsed into tool_calls (needed for tool_choice auto)")
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split <think>...</think> output into reasoning_content")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        parser.add_argument(flag, type=_json_list(flag), default=["*"], metavar="JSON",
                            help=f"CORS: the {what} browsers may use, a JSON list of strings (default [\"*\"]: any)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send credentials (cookies, auth headers) cross-origin")


def _json_list(flag: str):
    """A flag's value read as a JSON list of strings (vLLM's CORS flags take them so)."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings such as '[\"*\"]', got {text!r}")
        return value
    return parse


def cors_options(args) -> dict[str, Any]:
    """Starlette's ``CORSMiddleware`` arguments from the flags (their defaults without them)."""
    return {"allow_origins": getattr(args, "allowed_origins", ["*"]),
            "allow_methods": getattr(args, "allowed_methods", ["*"]),
            "allow_headers": getattr(args, "allowed_headers", ["*"]),
            "allow_credentials": bool(getattr(args, "allow_credentials", False))}


def _metrics_registry(core: GatewayCore):
    """What ``/metrics`` shows: every gateway process's metrics summed (prometheus-client's
    multiprocess mode, under ``--processes``), else this one's registry."""
    import os

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return core.metrics.registry
    from prometheus_client import multiprocess

    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


class ModelDoors:
    """An ``OpenAIDoor`` per served model; a request goes to the door of the model its body
    names (``model``). With one model that door takes everything (it refuses other names
    itself); with several, a body that names no served model is a 404 naming them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.doors = {name: OpenAIDoor(core, name, load_chat_template(core.model))
                      for name, core in router.cores.items()}
        self.default = self.doors[router.default.name]

    async def pick(self, request: Request) -> OpenAIDoor | Response:
        """The door of the body's model, or a 404 / 400 to answer with."""
        if len(self.doors) == 1:
            return self.default
        try:
            body = json.loads(await request.body())
        except Exception:  # too large, not JSON, the client gone: the door's own parse answers
            return self.default
        if not isinstance(body, dict):
            return self.default  # the door's parse explains
        model = body.get("model")
        if model is None:  # as gRPC refuses it: no model is the default while several are served
            return ApiError(400, f"model is required: this server serves {', '.join(self.doors)}",
                            "invalid_request_error", "model", "missing_required_parameter").response()
        if not isinstance(model, str):
            return self.default  # a mistyped model: the door's parse explains
        try:
            return self.doors[self.router.core_for(model).name]
        except UnknownModel as e:
            return ApiError(404, str(e), "invalid_request_error", "model", "model_not_found").response()


def build_app(core: GatewayCore | Router, served_model_name: str | None = None,
              keys: ApiKeys | None = None, cors: dict[str, Any] | None = None,
              open_metrics: bool = False) -> FastAPI:
    """The OpenAI-compatible app over ``core`` (one model, named ``served_model_name``) or a
    ``Router`` (every model it serves); ``cors``: ``cors_options`` (None: theirs by default);
    ``open_metrics``: ``/metrics`` needs no key (``--no-auth-for metrics``, as on ``--metrics-port``)."""
    if isinstance(core, GatewayCore):
        core.name = served_model_name or core.name
        core = Router([core])
    router = core
    doors = ModelDoors(router)
    core = router.default
    app = FastAPI(title="pagefleet", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  **_NO_NATIVE_TELEMETRY)
    # The last added runs first: count every response, then the key, then the body's size.
    app.add_middleware(LimitBody, limits=core.limits)
    if keys is not None and keys.required:
        app.add_middleware(RequireApiKey, keys=keys, on_refused=core.metrics.unauthenticated.labels("http").inc,
                           open_paths=RequireApiKey.OPEN_PATHS | ({"/metrics"} if open_metrics else set()))
    app.add_middleware(CountResponses, counter=core.metrics.http_requests)
    # Outermost: a browser's preflight (OPTIONS, no key) is answered before the key is asked for.
    app.add_middleware(CORSMiddleware, **(cors if cors is not None else cors_options(None)))

    async def routed(request: Request, serve) -> Response:
        picked = await doors.pick(request)
        return picked if isinstance(picked, Response) else await serve(picked)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, lambda d: d.completion(request, "/v1/completions", parse_completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routed(request, lambda d: d.completion(request, "/v1/chat/completions", parse_chat))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await routed(request, lambda d: d.completion(request, "/v1/responses", parse_responses))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await routed(request, lambda d: tokenize(d, request))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await routed(request, lambda d: detokenize(d, request))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [d.model_card() for d in doors.doors.values()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        found = doors.doors.get(model)
        if found is None:
            return ApiError(404, str(UnknownModel(model, router.names)), "invalid_request_error", "model",
                            "model_not_found").response()
        return JSONResponse(found.model_card())

    @app.api_route("/ping", methods=["GET", "POST"])
    @app.get("/health")
    async def health() -> Response:
        if not await core.ping():
            return ApiError(503, "the request queue (Redis) is unreachable", "service_unavailable_error",
                            code="queue_unavailable").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(_metrics_registry(core)),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

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


class RequireApiKey:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs one of ``keys`` (401 otherwise);
    the request then runs as its key (``api_keys.caller``)."""

    OPEN_PATHS = frozenset({"/health", "/ping"})

    def __init__(self, app, keys: ApiKeys, on_refused, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        try:
            kid = self.keys.check(header)
        except Unauthenticated as e:
            self.on_refused()
            log.info("auth.refused", door="http", path=scope["path"], reason=str(e))
            refusal = ApiError(401, str(e), "invalid_request_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            return await refusal.response()(scope, receive, send)
        with caller(kid):
            await self.app(scope, receive, send)


class LimitBody:
    """ASGI middleware: a body longer than ``--max-request-bytes`` is refused with 413, by its
    Content-Length before it is read, or as it streams in (the door then answers 413)."""

    def __init__(self, app, limits: Limits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        error = self.limits.body_error(int(declared) if declared.isdigit() else 0)
        if error:
            return await ApiError(413, error, "invalid_request_error", code="request_too_large").response()(
                scope, receive, send)
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if message["type"] == "http.request" and (error := self.limits.body_error(received)):
                raise TooLarge(error)
            return message

        await self.app(scope, counted, send)


class _Server(uvicorn.Server):
    """uvicorn inside the gateway's loop: the gateway owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The HTTP door on ``--host``:``--http-port`` (0: a free port; ``port`` is the bound one)."""

    def __init__(self, router: Router, args, doors: Doors | None = None) -> None:
        app = build_app(router, None, doors.keys if doors else None, cors_options(args),
                        open_metrics=bool(doors and doors.open_metrics))
        core = router.default
        tls = doors.tls if doors else None
        files = {} if tls is None else {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_ca_certs": tls.ca,
                                        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE}
        limits = core.limits
        protocol = guarded_protocol(AutoHTTPProtocol, header_timeout_s=limits.http_header_timeout,
                                    body_timeout_s=limits.http_body_timeout, max_connections=limits.max_connections)
        self.config = uvicorn.Config(app, host=args.host, port=args.http_port, log_config=None, access_log=False,
                                     lifespan="off", ws="none", timeout_graceful_shutdown=2, http=protocol, **files)
        self.server = _Server(self.config)
        self.reuse_port = bool(getattr(args, "reuse_port", False))
        self.port = 0
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> HttpServer:
        host = self.config.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:  # one of several gateway processes on this port (--processes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
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


