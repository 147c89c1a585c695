"""``pagefleet gateway``: the public ``pagefleet.v1.Generation`` service, and with
``--http-port`` the OpenAI-compatible HTTP API (gateway/http.py), from one process.

Stateless (any number may serve together): validate and tokenize, queue the request in
Redis, relay its output stream (gateway/core.py, shared by both doors). A client's cancel
or disconnect becomes a cancel entry in the requests stream, which the scheduler turns
into a Cancel on the request's worker. When more than ``--max-queue`` requests wait, new
ones are refused with RESOURCE_EXHAUSTED and a ``RetryInfo`` (HTTP: 429 and Retry-After).

Guards (guard.py, limits.py; all off without their flags): API keys on both doors
(``--api-key``, ``--api-keys-file``, read again on SIGHUP), TLS (``--tls-cert``, ``--tls-key``,
client certificates with ``--tls-client-ca``), and bounds on what one request may ask.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import structlog
from google.rpc import code_pb2
from redis.exceptions import RedisError

from pagefleet.common.metrics import GatewayMetrics, serve_metrics
from pagefleet.common.model_config import load_model_spec
from pagefleet.common.redis import Keys, add_redis_flags, connect_args, retry, trim_idle_connections
from pagefleet.common.service import (
    EnvArgumentParser,
    add_common_flags,
    add_health_and_reflection,
    server_options,
    set_serving,
    setup_logging,
    start_health_port,
)
from pagefleet.common.tls import add_port
from pagefleet.protos import generation_pb2 as pb
from pagefleet.protos import generation_pb2_grpc

from . import guard
from .core import DEADLINE_ERROR, GatewayCore, IdInUse, QueueUnavailable, Shed, traceparent_or_new
from .http import add_http_flags
from .limits import Limits
from .models import Router, UnknownModel, served_models
from .observe import GRPC_SERVICE, observed_generate
from .processes import MAX_PROCESSES, forget_metrics_dir
from .validate import (
    REQUEST_ID_RULE,
    BadField,
    bad_request_metadata,
    compile_ahead,
    retry_metadata,
    valid_request_id,
)

SERVICE = GRPC_SERVICE

log = structlog.get_logger("gateway")
# When Redis does not answer: the RetryInfo a client's retry policy reads (about one failover).
UNAVAILABLE_RETRY_S = 1.0
# Streams in flight when a gateway is told to stop get this long to end (``--shutdown-grace``):
# within a Kubernetes pod's default 30 s of grace and the manifests' 60.
SHUTDOWN_GRACE_S = 25.0


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet gateway", description="Run one gateway (stateless; run as many as you like).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (gRPC and HTTP)")
    p.add_argument("--port", type=int, default=50051, help="port of the Generation service")
    p.add_argument("--http-port", type=int, default=None, metavar="N",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port (0: any free port; default: off)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the model's name in requests (default: --model); once per --model, in order")
    add_redis_flags(p)
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="a model to serve: 'tiny' or a checkpoint directory (tokenizer, chat template and "
                        "config only), named NAME in requests (default: PATH); repeat for several models "
                        "(default: tiny)")
    p.add_argument("--shards", action="append", default=None, metavar="MODEL=SHARD[,SHARD...]",
                   help="the shards serving MODEL (its requests spread over them by id); default: the i-th "
                        "--model is served by shard s<i> (one model: s0); in the environment, models apart by ';' "
                        "(PAGEFLEET_SHARDS='a=s0,s1;b=s2')")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="refuse prompt + max_tokens beyond this (with several models: caps each model's context)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block of the workers: the prompt's block keys are computed with it "
                        "so the scheduler can place a request where its prefix is cached")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="refuse new requests (RESOURCE_EXHAUSTED / HTTP 429) while this many wait to be placed")
    p.add_argument("--max-stream-len", type=int, default=100_000,
                   help="most requests in the system (the requests stream's length): past it new ones are "
                        "refused like past --max-queue (the stream is never trimmed: that would drop requests)")
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds a refused client is told to wait")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="S",
                   help="on SIGTERM (a rolling restart), new calls are refused and health says NOT_SERVING at "
                        "once; streams in flight get up to S seconds to end before they are cut (a client's "
                        "own request id then runs on for its retry through another gateway)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="send a stream's tokens N at a time (its last message whenever it ends); a client "
                        "that falls behind gets what waits in one message whatever N is")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="run N gateway processes sharing --port and --http-port (SO_REUSEPORT); /metrics "
                        "sums them (gateway/processes.py)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind the ports with SO_REUSEPORT, sharing them with other processes (set by --processes)")
    guard.add_flags(p)
    add_http_flags(p)
    add_common_flags(p)
    return p


def traceparent_of(context) -> str:
    """The W3C trace context the client sent, else a new root one."""
    sent = next((value for key, value in context.invocation_metadata() or () if key == "traceparent"), None)
    return traceparent_or_new(sent)


# A message that does not parse decodes to an empty request whose request_id carries this
# mark (no valid id contains a NUL) and the parse error, so the servicer refuses it with
# INVALID_ARGUMENT: gRPC's own decoding failure would answer INTERNAL, naming nothing.
_UNDECODABLE = "\x00undecodable:"


def _lenient(message_type):
    def decode(raw: bytes):
        try:
            return message_type.FromString(raw)
        except Exception as e:  # DecodeError, or bytes that are not UTF-8 in a string field
            return message_type(request_id=f"{_UNDECODABLE}{e or type(e).__name__}")
    return decode


def add_generation_service(servicer, server) -> None:
    """``add_GenerationServicer_to_server``, with decoders that never fail (see ``_UNDECODABLE``)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel, request_deserializer=_lenient(pb.CancelRequest),
            response_serializer=pb.CancelResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


async def _refuse_undecodable(request, context) -> None:
    if request.request_id.startswith(_UNDECODABLE):
        error = request.request_id.removeprefix(_UNDECODABLE)
        request.request_id = ""
        e = BadField("request", f"the message does not decode as {SERVICE} protobuf ({error})")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=bad_request_metadata(e))


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """The gRPC door: protobuf in, the core of the request's model, protobuf out; refusals as
    status codes (a model not served: NOT_FOUND naming the served ones)."""

    def __init__(self, router: Router | GatewayCore, streams: guard.StreamsPerPeer | None = None) -> None:
        """``streams``: the bound on a connection's open Generate calls (default: ``Limits()``'s)."""
        self.router = router if isinstance(router, Router) else Router([router])
        self.core = self.router.default  # metrics (shared by every model's core)
        self.streams = streams or guard.StreamsPerPeer(Limits())

    def core_for(self, request) -> GatewayCore:
        """The core of ``request.model`` (``UnknownModel`` if not served)."""
        return self.router.core_for(request.model if request.HasField("model") else None)

    @guard.limit_streams
    @observed_generate
    async def Generate(self, request, context):
        await _refuse_undecodable(request, context)
        try:
            core = self.core_for(request)
        except UnknownModel as e:
            if e.requested:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            missing = BadField("model", str(e))  # none named while several are served: a field to set
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(missing),
                                trailing_metadata=bad_request_metadata(missing))
        async for msg in self._generate(core, request, context):
            yield msg

    async def _generate(self, core: GatewayCore, request, context):
        await compile_ahead(request.sampling, core.model)
        try:
            prompt_ids = core.check(request)
        except BadField as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=bad_request_metadata(e))
        client_id = bool(request.request_id)
        if not client_id:
            request.request_id = core.new_id()
        try:
            queued, = await core.enqueue([(request, prompt_ids)], traceparent_of(context), client_ids=client_id)
        except Shed as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                trailing_metadata=retry_metadata(str(e), e.retry_after_s))
        except IdInUse as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except QueueUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e),
                                trailing_metadata=retry_metadata(str(e), UNAVAILABLE_RETRY_S, code_pb2.UNAVAILABLE))
        try:
            async for msg in core.relay(queued):
                yield msg
                if msg.finish_reason == pb.FINISH_REASON_ERROR and msg.error.startswith(DEADLINE_ERROR):
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, msg.error)
        except QueueUnavailable as e:  # Redis failed the relay past every retry: a retry by the id resumes it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e),
                                trailing_metadata=retry_metadata(str(e), UNAVAILABLE_RETRY_S, code_pb2.UNAVAILABLE))

    async def Cancel(self, request, context):
        await _refuse_undecodable(request, context)
        if not request.request_id or not valid_request_id(request.request_id, choice_id=True):
            # As Generate checks it: an id of other characters (a space splits the done stream's
            # list of ids, and would finish another request) or of any length is never queued.
            e = BadField("request_id", "is required" if not request.request_id else REQUEST_ID_RULE)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=bad_request_metadata(e))
        try:
            accepted = await self.router.cancel(request.request_id)
        except (OSError, RedisError) as e:  # Redis unreachable (retries spent): as Generate answers then
            refusal = str(QueueUnavailable.of(e))
            message = refusal if refusal.endswith(str(e)) else f"{refusal}: {e}"
            await context.abort(grpc.StatusCode.UNAVAILABLE, message,
                                trailing_metadata=retry_metadata(message, UNAVAILABLE_RETRY_S, code_pb2.UNAVAILABLE))
        log.info("request.cancel_requested", request_id=request.request_id, accepted=accepted)
        return pb.CancelResponse(accepted=accepted)


async def serve(args, doors: guard.Doors | None = None) -> int:
    import signal

    doors = doors or guard.Doors.from_args(args)
    redis = connect_args(args)
    models = served_models(args.model, args.served_model_name, args.shards)
    metrics = GatewayMetrics(by_model=len(models) > 1)
    router = Router([GatewayCore(redis, [Keys(args.namespace, s) for s in m.shards], load_model_spec(m.path), args,
                                 doors.limits, name=m.name, metrics=metrics.for_model(m.name))
                     for m in models])
    core = router.default
    refused = core.metrics.unauthenticated.labels("grpc").inc
    server = grpc.aio.server(options=server_options(max_receive_message_length=doors.limits.max_request_bytes,
                                                    max_concurrent_streams=doors.limits.grpc_max_streams,
                                                    reuse_port=bool(getattr(args, "reuse_port", False))),
                             interceptors=doors.interceptors(on_refused=refused))
    add_generation_service(GenerationService(router, guard.StreamsPerPeer(doors.limits)), server)
    serve_metrics(args, core.metrics.registry, "gateway", **doors.metrics_guard())
    health, names, _ = add_health_and_reflection(server, [SERVICE])
    port = add_port(server, f"{args.host}:{args.port}", doors.tls)
    await retry(redis.ping, what="ping")
    for c in router.cores.values():
        if len(c.shards) > 1:  # its ids go where workers are (``GatewayCore.new_id``): known from the start
            for reader in c.readers.values():
                reader.start()
    trimming = asyncio.create_task(trim_idle_connections(redis))
    http = None
    if args.http_port is not None:
        from .http import HttpServer  # FastAPI and uvicorn only where HTTP is served

        http = await HttpServer(router, args, doors).start()
    await server.start()
    health_port = await start_health_port(health, args.host, args.health_port,
                                          reuse_port=bool(getattr(args, "reuse_port", False)))
    await set_serving(health, names, True)
    log.info("gateway.ready", port=port, http_port=http.port if http else None,
             models={c.name: [k.shard for k in c.shards] for c in router.cores.values()},
             max_model_len=core.max_model_len, tls=doors.tls is not None, client_certs=bool(doors.tls and doors.tls.ca),
             key_required=doors.keys.required, num_keys=doors.keys.num_keys)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP reloads the keys file; with none it is a no-op, never the default end of the process
    # (a --processes supervisor passes it to every child).
    loop.add_signal_handler(signal.SIGHUP, doors.keys.reload if doors.keys.file is not None
                            else lambda: log.info("gateway.sighup", reloaded="nothing: no --api-keys-file"))
    await stop.wait()
    await set_serving(health, names, False)
    for c in router.cores.values():  # streams cut from here on: their clients retry elsewhere
        c.stopping = True
    grace = max(0.0, args.shutdown_grace)
    if http is not None:
        http.server.config.timeout_graceful_shutdown = grace
    # New calls are refused from here on; the streams in flight end, or are cut past the grace.
    await asyncio.gather(*(x for x in (http.stop() if http is not None else None, server.stop(grace=grace),
                                       health_port.stop(grace=0.5) if health_port is not None else None)
                           if x is not None))
    await router.stop()
    trimming.cancel()
    await redis.aclose()
    log.info("gateway.stopped")
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error(f"--block-size must be at least 1, got {args.block_size}")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    if not 0 <= args.shutdown_grace <= 3600:
        parser.error(f"--shutdown-grace must be between 0 and 3600 seconds, got {args.shutdown_grace}")
    try:
        models = served_models(args.model, args.served_model_name, args.shards)
    except ValueError as e:
        parser.error(str(e))
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            parser.error(f"--max-model-len must be at least 1, got {args.max_model_len}")
        if len(models) == 1:  # several: it caps each model's context
            try:
                load_model_spec(models[0].path).max_model_len(args.max_model_len)
            except ValueError as e:
                parser.error(f"--max-model-len: {e}")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.processes > MAX_PROCESSES:
        parser.error(f"--processes must be at most {MAX_PROCESSES}, got {args.processes}")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        parser.error(f"--http-port must be between 0 and 65535, got {args.http_port}")
    if args.http_port is not None and args.http_port and args.http_port == args.port:
        parser.error(f"--http-port {args.http_port} is the gRPC --port too")
    try:
        doors = guard.Doors.from_args(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging("gateway", args)
    if args.processes > 1:
        from .processes import supervise

        return supervise(args, argv)
    supervisor = os.getppid() if args.reuse_port else None
    try:
        return asyncio.run(serve(args, doors))
    except KeyboardInterrupt:  # Ctrl-C before its handlers were installed (e.g. while Redis is awaited)
        return 130
    finally:
        if supervisor is not None and os.getppid() != supervisor:
            forget_metrics_dir()  # the supervisor died (kill -9) without removing it
