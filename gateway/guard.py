"""What a gRPC call meets before the servicer: the API key, then the per-connection stream bound.

In this order:

* ``RequireApiKey`` (a ``grpc.aio`` server interceptor, only when keys are required): every
  call but health (and reflection with ``--no-auth-for reflection``) must carry
  ``authorization: Bearer <key>`` with one of the gateway's keys. A refused call
  is answered UNAUTHENTICATED before its message is even decoded: no Redis work, nothing
  queued. An accepted one runs as its key (``api_keys.caller``): the key's id is on every log
  line and span of the call, the key itself nowhere.
* ``limit_streams`` (on the servicer's ``Generate``; ``LimitStreams`` is the same as an
  interceptor): a connection may hold ``--max-concurrent-streams`` Generate calls at once; the
  next is refused with RESOURCE_EXHAUSTED naming the flag (``limits.Limits``).

An interceptor changes a call by handing back a handler of the same kind whose behaviour
wraps the servicer's (``_run_as``, ``_refusing``). ``Doors`` gathers what guards both doors (keys, TLS,
limits) from the flags; the HTTP door's own guards are in http.py.
"""

from __future__ import annotations

import argparse
import collections
import functools
from dataclasses import dataclass

import grpc
import structlog

from pagefleet.common.api_keys import ApiKeys, Unauthenticated, add_api_key_flags, caller
from pagefleet.common.service import add_door_flags, open_to_all
from pagefleet.common.tls import Tls, add_public_tls_flags, check_files, public_tls

from .limits import Limits, add_limit_flags

HEALTH = "/grpc.health.v1.Health/"
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
GENERATE = "/pagefleet.v1.Generation/Generate"

log = structlog.get_logger("gateway")

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Doors:
    """What guards the gateway's gRPC and HTTP doors and its metrics, from the flags."""

    keys: ApiKeys
    tls: Tls | None
    limits: Limits
    open_reflection: bool = False
    open_metrics: bool = False

    @classmethod
    def from_args(cls, args) -> Doors:
        """``ValueError`` naming the flag that is wrong (or the file that cannot be read)."""
        tls = public_tls(args)
        check_files(tls)
        return cls(ApiKeys.from_args(args), tls, Limits.from_args(args),
                   open_to_all(args, "reflection"), open_to_all(args, "metrics"))

    def interceptors(self, on_refused=None) -> list[grpc.aio.ServerInterceptor]:
        """The API key's, when keys are required (the stream bound is the servicer's: ``limit_streams``)."""
        if not self.keys.required:
            return []
        return [RequireApiKey(self.keys, REFLECTION if self.open_reflection else (), on_refused)]

    def metrics_guard(self) -> dict:
        """``serve_metrics``'s ``tls`` and ``authorize`` for the gateway's metrics."""
        closed = not self.open_metrics
        return {"tls": self.tls.server_context(verify_clients=closed) if self.tls else None,
                "authorize": self.keys.accepts if self.keys.required and closed else None}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the gateway's guards: keys, TLS, --health-port, --no-auth-for, limits."""
    add_api_key_flags(parser)
    add_public_tls_flags(parser)
    add_door_flags(parser, ("reflection", "metrics"))
    add_limit_flags(parser)


def _run_as(handler, kid: str):
    """``handler``, its behaviour run as the key ``kid`` (``api_keys.caller``)."""
    streaming = handler.response_streaming
    inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

    if streaming:
        async def behaviour(request, context):
            with caller(kid):
                async for response in inner(request, context):
                    yield response
    else:
        async def behaviour(request, context):
            with caller(kid):
                return await inner(request, context)

    make = _MAKERS[(handler.request_streaming, streaming)]
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler of ``handler``'s kind that answers ``code`` at once, reading nothing."""
    if handler.response_streaming:
        async def behaviour(request, context):
            await context.abort(code, message)
            yield  # an async generator, as the kind wants; never reached
    else:
        async def behaviour(request, context):
            await context.abort(code, message)

    make = _MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)


class RequireApiKey(grpc.aio.ServerInterceptor):
    """Calls but health (and ``open_prefixes``) need one of ``keys``."""

    def __init__(self, keys: ApiKeys, open_prefixes: tuple[str, ...] = (), on_refused=None) -> None:
        self.keys = keys
        self.open = (HEALTH, *open_prefixes)
        self.on_refused = on_refused or (lambda: None)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.open):
            return handler
        authorization = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        try:
            kid = self.keys.check(authorization if isinstance(authorization, str) else None)
        except Unauthenticated as e:
            self.on_refused()
            log.info("auth.refused", door="grpc", method=details.method, reason=str(e))
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, str(e))
        return _run_as(handler, kid)


class StreamsPerPeer:
    """Generate calls open per connection (a connection is its peer address: one client port),
    against ``limits.max_concurrent_streams``."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.num_open: collections.Counter[str] = collections.Counter()

    def open(self, peer: str) -> str | None:
        """Count a new call of ``peer``; why it is one too many, or None. ``close`` it either way."""
        self.num_open[peer] += 1
        return self.limits.streams_error(self.num_open[peer])

    def close(self, peer: str) -> None:
        self.num_open[peer] -= 1
        if not self.num_open[peer]:
            del self.num_open[peer]


def limit_streams(method):
    """Wrap the gRPC servicer's ``Generate`` (an async generator; the servicer has ``streams``,
    a ``StreamsPerPeer``): a call past its connection's bound is refused with RESOURCE_EXHAUSTED
    naming the flag, before anything else of it runs. In the servicer rather than an
    interceptor: grpc.aio runs a server's interceptors for every call (~50-100 µs each here)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        streams = self.streams
        peer = context.peer()
        error = streams.open(peer)
        try:
            if error:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error)
            async for response in method(self, request, context):
                yield response
        finally:
            streams.close(peer)

    return wrapper


class LimitStreams(grpc.aio.ServerInterceptor):
    """``limit_streams`` as an interceptor, for a servicer that does not bound its calls itself."""

    def __init__(self, limits: Limits) -> None:
        self.streams = StreamsPerPeer(limits)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method != GENERATE:
            return handler
        inner = handler.unary_stream
        streams = self.streams

        async def behaviour(request, context):
            peer = context.peer()
            error = streams.open(peer)
            try:
                if error:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error)
                async for response in inner(request, context):
                    yield response
            finally:
                streams.close(peer)

        return grpc.unary_stream_rpc_method_handler(behaviour, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
