"""The scheduler's observability: the queue-wait and assign spans of one placement."""

from __future__ import annotations

from typing import Any

from pagefleet.common import telemetry


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
