"""What the worker's engine loop tells observability: one call per event.

``WorkerObserver`` turns the engine loop's events (a request assigned, a step run, a
request gone) into the worker's Prometheus metrics and its request spans. It reads the
engine's requests around each step to learn what the step computed (tokens per request,
recompute preemptions, swaps), so the engine itself knows nothing of either.
Everything runs on the engine thread.
"""

from __future__ import annotations

from typing import Any

from pagefleet import telemetry
from pagefleet.metrics import WorkerMetrics

# Request.status values, by name (the engine's enum is not imported: no torch here).
_SWAPPED = "SWAPPED"


class WorkerObserver:
    def __init__(self, worker_id: str, metrics: WorkerMetrics | None = None, model: str = "") -> None:
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.spans = telemetry.WorkerSpans(worker_id)
        self.model = model

    def assigned(self, msg: Any, parent: Any = None) -> None:
        """An ``AssignRequest`` the engine accepted; ``parent`` the caller's trace context."""
        rid = msg.request_id
        self.metrics.request_added(rid, len(msg.prompt_token_ids))
        if not telemetry.enabled():
            return
        if telemetry.span_context_of(parent) is None and msg.traceparent:
            parent = {"traceparent": msg.traceparent}
        attrs = telemetry.request_attributes(
            model=self.model,
            max_tokens=msg.sampling.max_tokens,
            num_prompt_tokens=len(msg.prompt_token_ids),
        )
        if msg.output_token_ids:
            attrs["pagefleet.num_resumed_tokens"] = len(msg.output_token_ids)
        self.spans.start(rid, parent, attrs)

    def before_step(self, engine: Any) -> tuple[int | None, dict[str, tuple[Any, int, str]]]:
        """Call right before ``engine.step()``; pass the result to :meth:`after_step`."""
        before = {
            rid: (req, req.num_computed_tokens, req.status.name) for rid, req in engine.requests.items()
        }
        return self.spans.before_step(), before

    def after_step(self, token: tuple[int | None, dict], engine: Any, deltas: list[Any]) -> None:
        started_ns, before = token
        scheduled, num_tokens = [], 0
        for rid, (req, computed, status) in before.items():
            n = req.num_computed_tokens - computed
            if n > 0:
                scheduled.append((rid, n, computed))
                num_tokens += n
            elif n < 0 and started_ns is not None:
                self.spans.event(rid, "preempted", mode="recompute", num_dropped_tokens=computed)
            now = req.status.name
            if started_ns is not None and now != status and _SWAPPED in (now, status):
                name = "swap_out" if now == _SWAPPED else "swap_in"
                blocks = engine.kv.num_blocks_for(req.num_tokens) if hasattr(engine, "kv") else 0
                self.spans.event(rid, name, num_blocks=blocks)
        self.spans.after_step(started_ns, scheduled)
        for d in deltas:
            if d.token_ids:
                self.spans.on_tokens(d.request_id, len(d.token_ids))
            if d.finish_reason is not None:
                n = before[d.request_id][0].num_output_tokens if d.request_id in before else 0
                self.spans.finish(d.request_id, d.finish_reason, n)
        self.metrics.observe_step(deltas, engine.stats(), num_tokens)

    def removed(self, request_id: str, reason: str = "abort", num_output_tokens: int = 0,
                error: str | None = None) -> None:
        """A request left without a finishing delta (cancel, hand-back, failure)."""
        self.metrics.request_removed(request_id, reason)
        self.spans.finish(request_id, reason, num_output_tokens, error)

    def event(self, request_id: str, name: str, **attributes: Any) -> None:
        self.spans.event(request_id, name, **attributes)


# -- the gateway ---------------------------------------------------------------------------
def observed_generate(method):
    """Wrap the gateway's ``Generate`` (an async generator): its SERVER span and metrics.

    The servicer needs a ``metrics`` (GatewayMetrics) and a ``model`` with ``.name``.
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
                model=getattr(self.model, "name", "") or getattr(self.args, "model", ""),
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


# -- the scheduler ---------------------------------------------------------------------------
def assign_span(p: Any, worker: Any):
    """Around the scheduler's Assign call: the request's queue wait and the assignment.

    Writes a CONSUMER span ``queue_wait`` (from when the request joined the global queue)
    and, under it, a CLIENT span ``assign`` with the chosen worker and its free blocks.
    Yields the gRPC metadata that carries the assign span to the worker (empty while
    tracing is off).
    """
    import contextlib

    if not telemetry.enabled():
        return contextlib.nullcontext(())
    return _assign_span(p, worker)


def _assign_span(p: Any, worker: Any):
    import contextlib
    import time

    tracer = telemetry.get_tracer("scheduler")

    @contextlib.contextmanager
    def span_cm():
        parent = telemetry.extract({"traceparent": p.assign.traceparent}) if p.assign.traceparent else None
        waited_s = max(0.0, time.monotonic() - p.enqueued_at)
        start_ns = time.time_ns() - int(waited_s * 1e9)
        rid = p.request_id
        queue = tracer.start_span(
            "queue_wait", context=parent, kind=telemetry.SpanKind.CONSUMER, start_time=start_ns,
            attributes={telemetry.REQUEST_ID: rid, telemetry.QUEUE_WAIT_SECONDS: waited_s,
                        telemetry.PRIORITY: p.assign.priority,
                        "pagefleet.num_resumed_tokens": len(p.assign.output_token_ids)},
        )
        queue.end()
        report = getattr(worker, "report", None)
        attrs = {telemetry.REQUEST_ID: rid, telemetry.WORKER_ID: worker.worker_id,
                 "pagefleet.worker_address": worker.address,
                 "pagefleet.num_available_blocks": getattr(worker, "num_available_blocks", 0)}
        if report is not None:
            attrs[telemetry.NUM_FREE_BLOCKS] = report.num_free_blocks
            attrs[telemetry.NUM_BLOCKS] = report.num_blocks
        ctx = telemetry.otel_context.Context() if parent is None else parent
        with tracer.start_as_current_span(
            "assign", context=telemetry.trace.set_span_in_context(queue, ctx),
            kind=telemetry.SpanKind.CLIENT, attributes=attrs,
        ) as span:
            yield telemetry.grpc_metadata()
            span.set_attribute("pagefleet.accepted", True)

    return span_cm()
