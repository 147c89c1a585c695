"""``pagefleet gateway``: the public ``pagefleet.v1.Generation`` service.

Stateless (any number may serve together): validate and tokenize, queue the request in
Redis, relay its output stream. A client's cancel or disconnect becomes a cancel entry in
the requests stream, which the scheduler turns into a Cancel on the request's worker.
When more than ``--max-queue`` requests wait, new ones are refused with
RESOURCE_EXHAUSTED and a ``RetryInfo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
import uuid

import grpc
import structlog

from pagefleet.common.blocks import block_hashes
from pagefleet.common.metrics import GatewayMetrics, serve_metrics
from pagefleet.common.model_config import ModelSpec, load_model_spec
from pagefleet.common.redis import (
    IDEMPOTENCY_TTL_S,
    Keys,
    connect,
    encode_cancel_entry,
    encode_request_entry,
    retry,
)
from pagefleet.common.service import (
    SERVER_OPTIONS,
    EnvArgumentParser,
    add_common_flags,
    add_health_and_reflection,
    set_serving,
    setup_logging,
)
from pagefleet.protos import cluster_pb2, generation_pb2_grpc
from pagefleet.protos import generation_pb2 as pb

from .observe import enqueue_span, observed_generate
from .relay import relay
from .validate import BadField, bad_request_metadata, check, retry_metadata

SERVICE = "pagefleet.v1.Generation"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

log = structlog.get_logger("gateway")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet gateway", description="Run one gateway (stateless; run as many as you like).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="port of the Generation service")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to use")
    p.add_argument("--namespace", default="pf", help="prefix of every Redis key")
    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory (tokenizer and config only)")
    p.add_argument("--max-model-len", type=int, default=None, help="refuse prompt + max_tokens beyond this")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block of the workers: the prompt's block keys are computed with it "
                        "so the scheduler can place a request where its prefix is cached")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="refuse new requests (RESOURCE_EXHAUSTED) while this many wait to be placed")
    p.add_argument("--max-stream-len", type=int, default=100_000,
                   help="bound of the requests stream (MAXLEN ~); also a hard limit on requests in the system")
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds a refused client is told to wait")
    add_common_flags(p)
    return p


def traceparent_of(context) -> str:
    """The W3C trace context the client sent, else a new root one."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent" and _TRACEPARENT.match(value):
            return value
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, redis, keys: Keys, model: ModelSpec, args) -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.max_model_len = model.max_model_len(args.max_model_len)
        self.args = args
        self.metrics = GatewayMetrics()

    @observed_generate
    async def Generate(self, request, context):
        try:
            prompt_ids = check(request, self.model, self.max_model_len)
        except BadField as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=bad_request_metadata(e))
        rid = request.request_id or uuid.uuid4().hex
        traceparent = traceparent_of(context)
        log_ = log.bind(request_id=rid)
        fresh = await self._enqueue(rid, request, prompt_ids, traceparent, context, client_id=bool(request.request_id))
        if fresh:
            log_.info("request.enqueued", num_prompt_tokens=len(prompt_ids), priority=request.priority,
                      traceparent=traceparent)
        finished = False
        try:
            async for msg in relay(self.redis, self.keys, rid, len(prompt_ids)):
                finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield msg
        finally:
            if not finished:  # the client cancelled or went away: free the worker's blocks
                log_.info("request.client_gone")
                asyncio.ensure_future(self._send_cancel(rid))

    async def _enqueue(self, rid, request, prompt_ids, traceparent, context, client_id: bool) -> bool:
        """Queue the request; False when a client-chosen id was already queued (relay only)."""
        depth, length = await self._queue_depth()
        if depth >= self.args.max_queue or length >= self.args.max_stream_len:
            message = f"queue is full ({depth} waiting); retry later"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                                trailing_metadata=retry_metadata(message, self.args.retry_after))
        if client_id:
            new = await retry(lambda: self.redis.set(self.keys.idempotency(rid), 1, nx=True, ex=IDEMPOTENCY_TTL_S),
                              what="idempotency", attempts=5)
            if not new:
                return False
        deadline = int(time.time() * 1000) + request.deadline_ms if request.HasField("deadline_ms") else 0
        msg = cluster_pb2.AssignRequest(
            request_id=rid, prompt_token_ids=prompt_ids, sampling=request.sampling,
            priority=request.priority, traceparent=traceparent, deadline_unix_ms=deadline,
            block_hashes=block_hashes(prompt_ids, self.args.block_size), hash_block_size=self.args.block_size,
        )
        with enqueue_span(msg, self.keys.requests):  # sets msg.traceparent when tracing
            fields = encode_request_entry(msg, int(time.time() * 1000))
            try:
                await retry(lambda: self.redis.xadd(self.keys.requests, fields, maxlen=self.args.max_stream_len,
                                                    approximate=True), what="xadd", attempts=5)
            except Exception:
                if client_id:  # not queued: a retry with the same id must queue it, not wait for it
                    with contextlib.suppress(Exception):
                        await self.redis.delete(self.keys.idempotency(rid))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the request queue (Redis) is unreachable")
        return True

    async def _queue_depth(self) -> tuple[int, int]:
        async def read():
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(self.keys.num_waiting)
            pipe.xlen(self.keys.requests)
            return await pipe.execute()

        waiting, length = await retry(read, what="queue_depth", attempts=5)
        # No scheduler publishing its queue: everything in the stream is waiting.
        return (int(waiting) if waiting is not None else length), length

    async def _send_cancel(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            await retry(lambda: self.redis.xadd(self.keys.requests, encode_cancel_entry(rid)),
                        what="xadd_cancel", attempts=20)

    async def Cancel(self, request, context):
        if not request.request_id:
            e = BadField("request_id", "is required")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=bad_request_metadata(e))
        await retry(lambda: self.redis.xadd(self.keys.requests, encode_cancel_entry(request.request_id)),
                    what="xadd_cancel", attempts=5)
        log.info("request.cancel_requested", request_id=request.request_id)
        return pb.CancelResponse(accepted=True)


async def serve(args) -> int:
    import signal

    model = load_model_spec(args.model)
    keys = Keys(args.namespace)
    redis = connect(args.redis_url)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = GenerationService(redis, keys, model, args)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    serve_metrics(args, servicer.metrics.registry, "gateway")
    health, names, _ = add_health_and_reflection(server, [SERVICE])
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await retry(redis.ping, what="ping")
    await server.start()
    await set_serving(health, names, True)
    log.info("gateway.ready", port=port, model=args.model, max_model_len=servicer.max_model_len)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(health, names, False)
    await server.stop(grace=2.0)
    await redis.aclose()
    log.info("gateway.stopped")
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error(f"--block-size must be at least 1, got {args.block_size}")
    setup_logging("gateway", args)
    return asyncio.run(serve(args))
