"""What the worker's engine loop tells observability: one call per event.

``WorkerObserver`` turns the engine loop's events (a request assigned, a step run, a
request gone) into the worker's Prometheus metrics and its request spans. It reads the
engine's requests around each step to learn what the step computed (tokens per request,
recompute preemptions, swaps), so the engine itself knows nothing of either.
Everything runs on the engine thread.
"""

from __future__ import annotations

from typing import Any

from pagefleet.common import telemetry
from pagefleet.common.metrics import WorkerMetrics

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
        self.metrics.request_added(rid, len(msg.prompt_token_ids), resumed=bool(msg.output_token_ids))
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

    def before_step(self, engine: Any) -> tuple[int | None, dict[str, tuple[Any, int, str]] | None]:
        """Call right before ``engine.step()``; pass the result to :meth:`after_step`. With no
        request traced it reads nothing (the metrics take the step's size from the engine)."""
        started_ns = self.spans.before_step()
        if started_ns is None:
            return None, None
        before = {rid: (req, req.num_computed_tokens, req.status) for rid, req in engine.requests.items()}
        return started_ns, before

    def after_step(self, token: tuple[int | None, dict | None], engine: Any, deltas: list[Any],
                   stats: Any = None) -> None:
        """``stats``: the engine's ``EngineStats`` after the step, or None if it is the one
        given last time (the gauges are not set again)."""
        started_ns, before = token
        # The step's size as the engine scheduled it (a prefix hit's cached tokens are not in it).
        num_scheduled_tokens = getattr(engine, "last_step_tokens", 0)
        if before is None:  # nothing traced: the metrics alone
            self.metrics.observe_step(deltas, stats, num_scheduled_tokens)
            return
        scheduled = []
        for rid, (req, computed, status) in before.items():
            n = req.num_computed_tokens - computed
            if n > 0:
                scheduled.append((rid, n, computed))
            elif n < 0:
                self.spans.event(rid, "preempted", mode="recompute", num_dropped_tokens=computed)
            if (now := req.status) != status and _SWAPPED in (now.name, status.name):
                name = "swap_out" if now.name == _SWAPPED else "swap_in"
                blocks = engine.kv.num_blocks_for(req.num_tokens)
                self.spans.event(rid, name, num_blocks=blocks)
        self.spans.after_step(started_ns, scheduled)
        for d in deltas if len(self.spans) else ():  # no request traced: nothing to tell the spans
            if d.token_ids:
                self.spans.on_tokens(d.request_id, len(d.token_ids))
            if d.finish_reason is not None:
                n = before[d.request_id][0].num_output_tokens if d.request_id in before else 0
                self.spans.finish(d.request_id, d.finish_reason, n)
        self.metrics.observe_step(deltas, stats, num_scheduled_tokens)

    def removed(self, request_id: str, reason: str = "abort", num_output_tokens: int = 0,
                error: str | None = None) -> None:
        """A request left without a finishing delta: cancelled (``abort``), failed (``error``),
        or gone on elsewhere (``metrics.NOT_FINISHED``: ``migrated``, ``handed_back``,
        ``fenced_off``)."""
        self.metrics.request_removed(request_id, reason)
        self.spans.finish(request_id, reason, num_output_tokens, error)

    def stopped(self) -> None:
        """The engine loop ended: what it still held ends its spans (an unended span is never exported)."""
        self.spans.finish_all("worker stopped")

    def event(self, request_id: str, name: str, **attributes: Any) -> None:
        self.spans.event(request_id, name, **attributes)
