"""The gateway's observability: the SERVER span and metrics of ``Generate``, the PRODUCER span of the XADD."""

from __future__ import annotations

from typing import Any

from pagefleet.common import telemetry


def observed_generate(method):
    """Wrap the gateway's ``Generate`` (an async generator): its SERVER span and metrics.

    The servicer needs a ``metrics`` (GatewayMetrics) and a ``model`` (ModelSpec).
    """
    import functools

    import grpc

    tracer = telemetry.get_tracer("gateway")

    @functools.wraps(method)
    async def wrapper(self, request, context):
        import time

        metrics = self.metrics
        started = time.monotonic()
        code = grpc.StatusCode.OK
        metrics.in_flight.inc()
        span = None
        if telemetry.enabled():
            attrs = telemetry.request_attributes(
                model=self.model.name,
                max_tokens=request.sampling.max_tokens,
                temperature=request.sampling.temperature if request.sampling.HasField("temperature") else None,
                prompt=request.prompt if request.WhichOneof("input") == "prompt" else None,
            )
            attrs["rpc.system"] = "grpc"
            attrs["rpc.service"] = "pagefleet.v1.Generation"
            attrs["rpc.method"] = "Generate"
            span = tracer.start_span("pagefleet.v1.Generation/Generate", context=telemetry.extract_grpc(context),
                                     kind=telemetry.SpanKind.SERVER, attributes=attrs)
        token = None if span is None else telemetry.attach(span)
        num_output, finish, first = 0, None, True
        try:
            async for msg in method(self, request, context):
                if first and msg.token_ids:
                    first = False
                    metrics.ttft.observe(time.monotonic() - started)
                num_output += len(msg.token_ids)
                if msg.finish_reason:
                    finish = msg
                yield msg
        except BaseException as e:
            code = _status_code(context, e)
            raise
        finally:
            metrics.in_flight.dec()
            metrics.finished(code, time.monotonic() - started)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                metrics.shed.inc()
            if span is not None:
                _end_generate_span(span, request, finish, num_output, code)
                telemetry.detach(token)

    return wrapper


def _status_code(context: Any, error: BaseException):
    import asyncio

    import grpc

    code = context.code() if hasattr(context, "code") else None
    if code is not None and code != grpc.StatusCode.OK:
        return code
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _end_generate_span(span: Any, request: Any, finish: Any, num_output: int, code: Any) -> None:
    import grpc

    from pagefleet.protos import generation_pb2 as pb

    reason = pb.FinishReason.Name(finish.finish_reason).removeprefix("FINISH_REASON_").lower() if finish else None
    span.set_attributes(telemetry.finish_attributes(reason, num_output))
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if finish is not None and finish.HasField("usage"):
        span.set_attribute(telemetry.GEN_AI_USAGE_INPUT_TOKENS, finish.usage.prompt_tokens)
    if request.request_id:
        span.set_attribute(telemetry.REQUEST_ID, request.request_id)
    if code != grpc.StatusCode.OK:
        span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, code.name))
    span.end()


def enqueue_span(msg: Any, stream: str):
    """Around the gateway's XADD: a PRODUCER span whose context ``msg.traceparent`` carries.

    A no-op context manager while tracing is off (``msg.traceparent`` stays as it was).
    """
    import contextlib

    if not telemetry.enabled():
        return contextlib.nullcontext()
    return _enqueue_span(msg, stream)


def _enqueue_span(msg: Any, stream: str):
    import contextlib

    tracer = telemetry.get_tracer("gateway")

    @contextlib.contextmanager
    def span_cm():
        attrs = {telemetry.REQUEST_ID: msg.request_id, "messaging.system": "redis",
                 "messaging.operation.type": "send", "messaging.destination.name": stream,
                 telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(msg.prompt_token_ids)}
        with tracer.start_as_current_span(f"send {stream}", kind=telemetry.SpanKind.PRODUCER,
                                          attributes=attrs) as span:
            msg.traceparent = telemetry.inject().get("traceparent", msg.traceparent)
            yield span

    return span_cm()
