"""The gateway's observability: each call's SERVER span and metrics, the PRODUCER span of the XADD.

A ``CallObserver`` follows one call whichever door it came through: the gRPC ``Generate``
(``observed_generate`` wraps the servicer method) or an HTTP completion request
(``http_call``). Both count into the same ``GatewayMetrics`` by gRPC status code; the HTTP
app also counts every response by route and HTTP status.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from pagefleet.common import telemetry
from pagefleet.common.api_keys import SPAN_ATTRIBUTE, current_key_id
from pagefleet.protos import generation_pb2 as pb

GRPC_SERVICE = "pagefleet.v1.Generation"


class CallObserver:
    """One call's metrics and (while tracing) its SERVER span.

    ``message`` for every relayed message, ``end`` exactly once with the call's status
    (a ``grpc.StatusCode``; the HTTP door passes the one its HTTP status stands for).
    """

    __slots__ = ("metrics", "span", "started", "num_output_tokens", "num_prompt_tokens", "finish_reasons", "ended")

    def __init__(self, metrics: Any, span: Any = None) -> None:
        self.metrics = metrics
        self.span = span
        self.started = time.monotonic()
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.finish_reasons: list[str] = []
        self.ended = False
        metrics.in_flight.inc()

    def describe(self, attributes: Mapping[str, Any]) -> None:
        """Add what the call asked for (known once its request is parsed) to the span."""
        if self.span is not None:
            self.span.set_attributes(dict(attributes))

    @contextlib.contextmanager
    def current(self):
        """Make the span current (the XADD's PRODUCER span becomes its child)."""
        token = None if self.span is None else telemetry.attach(self.span)
        try:
            yield
        finally:
            if token is not None:
                telemetry.detach(token)

    def message(self, msg: Any) -> None:
        if msg.token_ids and self.num_output_tokens == 0:
            self.metrics.ttft.observe(time.monotonic() - self.started)
        self.num_output_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reasons.append(pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower())
            self.num_prompt_tokens += msg.usage.prompt_tokens

    def end(self, code: Any, attributes: Mapping[str, Any] | None = None) -> None:
        """Count and close the call (only the first ``end`` counts)."""
        import grpc

        if self.ended:
            return
        self.ended = True
        self.metrics.in_flight.dec()
        self.metrics.finished(code, time.monotonic() - self.started)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.shed.inc()
        span = self.span
        if span is None:
            return
        span.set_attributes(telemetry.finish_attributes(None, self.num_output_tokens))
        if self.finish_reasons:
            span.set_attribute(telemetry.GEN_AI_RESPONSE_FINISH_REASONS, tuple(self.finish_reasons))
            span.set_attribute(telemetry.GEN_AI_USAGE_INPUT_TOKENS, self.num_prompt_tokens)
        span.set_attributes(dict(attributes or {}))
        if code != grpc.StatusCode.OK:
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, code.name))
        span.end()


def _model_name(servicer, request) -> str:
    """The name of the model ``request`` asks for (the servicer's only one if it names none)."""
    core = _model_core(servicer, request)
    return request.model if core is None else core.name


def _model_core(servicer, request):
    """The core of the model ``request`` asks for; None for a model not served (the call is
    refused with NOT_FOUND)."""
    core_for = getattr(servicer, "core_for", None)
    try:
        return core_for(request) if core_for else servicer.core
    except LookupError:
        return None


def _call_metrics(servicer, request):
    """The metrics ``request``'s call counts in: its model's (a model not served: \"\")."""
    core = _model_core(servicer, request)
    return servicer.core.metrics.for_model("") if core is None else core.metrics


def observed_generate(method):
    """Wrap the gateway's gRPC ``Generate`` (an async generator): its SERVER span and metrics.

    The servicer needs a ``core`` (GatewayCore: its ``metrics`` and ``model``).
    """
    import grpc

    tracer = telemetry.get_tracer("gateway")

    @functools.wraps(method)
    async def wrapper(self, request, context):
        span = None
        if telemetry.enabled():
            attrs = telemetry.request_attributes(
                model=_model_name(self, request),
                max_tokens=request.sampling.max_tokens,
                temperature=request.sampling.temperature if request.sampling.HasField("temperature") else None,
                top_p=request.sampling.top_p if request.sampling.HasField("top_p") else None,
                request_id=request.request_id or None,
                prompt=request.prompt if request.WhichOneof("input") == "prompt" else None,
            )
            attrs.update({"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": "Generate"})
            attrs.update(_caller())
            span = tracer.start_span(f"{GRPC_SERVICE}/Generate", context=telemetry.extract_grpc(context),
                                     kind=telemetry.SpanKind.SERVER, attributes=attrs)
        call = CallObserver(_call_metrics(self, request), span)
        code = grpc.StatusCode.OK

        def end(code) -> None:
            attrs = {"rpc.grpc.status_code": code.value[0]}
            if request.request_id:
                attrs[telemetry.REQUEST_ID] = request.request_id
            call.end(code, attrs)

        try:
            with call.current():
                async for msg in method(self, request, _CountedAbort(context, end)):
                    call.message(msg)
                    yield msg
        except BaseException as e:
            code = _status_code(context, e)
            raise
        finally:
            end(code)  # a no-op after an abort: that one counted

    return wrapper


class _CountedAbort:
    """A servicer context whose ``abort`` ends the call's observation (its metrics and span)
    before the status goes out: grpc.aio sends an abort's status at once, and a client that
    read its metrics right after the error did not find the call counted yet."""

    __slots__ = ("_context", "_end")

    def __init__(self, context: Any, end: Callable[[Any], None]) -> None:
        self._context, self._end = context, end

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        self._end(code)
        await self._context.abort(code, details, trailing_metadata)


def http_call(metrics: Any, method: str, route: str, headers: Mapping[str, str]) -> CallObserver:
    """A ``CallObserver`` for one HTTP completion request; its span continues the
    ``traceparent`` header's trace."""
    span = None
    if telemetry.enabled():
        carrier = {k: v for k in telemetry.TRACE_FIELDS if (v := headers.get(k)) is not None}
        span = telemetry.get_tracer("gateway").start_span(
            f"{method} {route}", context=telemetry.extract(carrier), kind=telemetry.SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route,
                        telemetry.GEN_AI_SYSTEM: telemetry.SYSTEM, **_caller()},
        )
    return CallObserver(metrics, span)


def _caller() -> dict[str, str]:
    """The span attribute naming the call's API key by its id (none when no key is needed)."""
    kid = current_key_id()
    return {} if kid is None else {SPAN_ATTRIBUTE: kid}


def _status_code(context: Any, error: BaseException):
    import asyncio

    import grpc

    code = context.code() if hasattr(context, "code") else None
    if code is not None and code != grpc.StatusCode.OK:
        return code
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def enqueue_span(msg: Any, stream: str, model: str, shard: str):
    """Around the gateway's XADD: a PRODUCER span whose context ``msg.traceparent`` carries,
    naming the request's model and shard.

    A no-op context manager while tracing is off (``msg.traceparent`` stays as it was).
    """
    if not telemetry.enabled():
        return contextlib.nullcontext()
    return _enqueue_span(msg, stream, model, shard)


@contextlib.contextmanager
def _enqueue_span(msg: Any, stream: str, model: str, shard: str):
    tracer = telemetry.get_tracer("gateway")
    attrs = {telemetry.REQUEST_ID: msg.request_id, telemetry.MODEL: model, telemetry.SHARD: shard,
             "messaging.system": "redis",
             "messaging.operation.type": "send", "messaging.destination.name": stream,
             telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(msg.prompt_token_ids)}
    with tracer.start_as_current_span(f"send {stream}", kind=telemetry.SpanKind.PRODUCER,
                                      attributes=attrs) as span:
        msg.traceparent = telemetry.inject().get("traceparent", msg.traceparent)
        yield span
