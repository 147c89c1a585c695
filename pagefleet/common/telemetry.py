"""OpenTelemetry tracing for every pagefleet process.

Configured by the standard ``OTEL_*`` environment variables (and ``--otlp-traces-endpoint``,
vLLM's flag, which sets ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). Tracing is on when an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
over gRPC, or HTTP with ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=http/protobuf``) or
``OTEL_TRACES_EXPORTER=console`` prints spans, and neither ``OTEL_SDK_DISABLED=true`` nor
``OTEL_TRACES_EXPORTER=none`` says otherwise.
When it is off, :func:`enabled` is False, the tracer is OpenTelemetry's no-op tracer, and
hot loops that check :func:`enabled` first pay nothing at all.

Trace context crosses process boundaries in W3C form: as ``traceparent`` / ``tracestate``
fields of a Redis stream entry (:func:`inject` / :func:`extract`) and as gRPC metadata
(:func:`grpc_metadata` / :func:`extract_grpc`).

Prompt text is never recorded unless ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``
(the GenAI instrumentations' switch) or ``PAGEFLEET_TRACE_PROMPTS`` is true.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

__all__ = [
    "Link",
    "SpanKind",
    "Status",
    "StatusCode",
    "enabled",
    "extract",
    "extract_grpc",
    "get_tracer",
    "grpc_metadata",
    "inject",
    "record_prompts",
    "request_attributes",
    "otel_context",
    "trace",
    "setup_tracing",
    "shutdown_tracing",
]

# -- attribute names: GenAI semantic conventions where they fit -----------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # only when record_prompts()
OPERATION_TEXT_COMPLETION = "text_completion"
SYSTEM = "pagefleet"

# ... and pagefleet's own, for what the conventions do not cover.
REQUEST_ID = "pagefleet.request_id"
WORKER_ID = "pagefleet.worker_id"
NUM_FREE_BLOCKS = "pagefleet.num_free_blocks"
NUM_BLOCKS = "pagefleet.num_blocks"
NUM_TOKENS = "pagefleet.num_tokens"
NUM_REQUESTS = "pagefleet.num_requests"
NUM_COMPUTED_TOKENS = "pagefleet.num_computed_tokens"
QUEUE_WAIT_SECONDS = "pagefleet.queue_wait_seconds"
PRIORITY = "pagefleet.priority"
# The shard (and model) a span's request or process belongs to: a scheduler's and a worker's
# on their resource (every span of the process), the gateway's on its queueing span.
SHARD = "pagefleet.shard"
MODEL = "pagefleet.model"

# Fields of a Redis stream entry (and gRPC metadata keys) that carry the context.
TRACE_FIELDS = ("traceparent", "tracestate")

_TRUE = ("1", "true", "yes", "on")
_enabled = False
_provider = None


def _env_true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")


def _exporter_name(env: Mapping[str, str]) -> str:
    """``OTEL_TRACES_EXPORTER``'s first name (``otlp`` unless set)."""
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    return names[0] if names else "none"


def _protocol(env: Mapping[str, str]) -> str:
    return (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "grpc").lower()


def tracing_configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether the ``OTEL_*`` variables in ``env`` ask for traces to be exported: to an OTLP
    endpoint, or to standard output (``OTEL_TRACES_EXPORTER=console``)."""
    env = os.environ if env is None else env
    if _env_true(env, "OTEL_SDK_DISABLED"):
        return False
    name = _exporter_name(env)
    if name == "console":
        return True
    if name != "otlp":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def configuration_error(env: Mapping[str, str] | None = None) -> str:
    """What is wrong with the ``OTEL_*`` tracing variables ("" if nothing): checked at start-up,
    so a process does not serve for hours exporting nowhere."""
    env = os.environ if env is None else env
    if _env_true(env, "OTEL_SDK_DISABLED"):
        return ""
    name = _exporter_name(env)
    if name not in EXPORTERS:
        return f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: one of {', '.join(EXPORTERS)}"
    if name == "otlp" and tracing_configured(env) and _protocol(env) not in PROTOCOLS:
        return (f"OTEL_EXPORTER_OTLP_PROTOCOL {_protocol(env)!r}: one of {', '.join(PROTOCOLS)} "
                "(OpenTelemetry's Python exporters have no http/json)")
    return ""


def _make_exporter(env: Mapping[str, str]) -> Any:
    """The span exporter the variables name: OTLP over gRPC (the default) or HTTP, or the console."""
    if _exporter_name(env) == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if _protocol(env) == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def set_traces_endpoint(endpoint: str | None, env: MutableMapping[str, str] | None = None) -> None:
    """``--otlp-traces-endpoint`` (vLLM's flag): the OTLP endpoint for traces, as
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (so processes started from here inherit it)."""
    if endpoint:
        (os.environ if env is None else env)["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint


def setup_tracing(component: str, env: Mapping[str, str] | None = None, *, exporter: Any = None,
                  attributes: Mapping[str, str] | None = None) -> bool:
    """Install the OTLP tracer provider for this process if configured; whether tracing is on.

    ``component`` names the service (``pagefleet-<component>``) unless ``OTEL_SERVICE_NAME``
    is set; ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*`` and the
    exporter's ``OTEL_EXPORTER_OTLP_*`` variables are read by the SDK itself.
    ``exporter`` replaces the OTLP exporter and turns tracing on (tests). ``attributes``: more
    resource attributes (a scheduler's or worker's ``SHARD`` and ``MODEL``). Calling it again
    is harmless: the first provider stays.
    """
    global _enabled, _provider
    env = os.environ if env is None else env
    if _provider is not None:
        return _enabled
    if exporter is None and not tracing_configured(env):
        return False
    if exporter is None and (error := configuration_error(env)):
        raise SystemExit(f"tracing: {error}")
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from pagefleet import __version__

    name = env.get("OTEL_SERVICE_NAME") or f"pagefleet-{component}"
    resource = Resource.create(
        {SERVICE_NAME: name, "service.namespace": "pagefleet", "service.version": __version__,
         "pagefleet.component": component, **(attributes or {})}
    )
    provider = TracerProvider(resource=resource)
    if exporter is None:
        exporter = _make_exporter(env)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _enabled = True
    return True


def flush_tracing(timeout_millis: int = 5000) -> None:
    """Export every finished span now."""
    if _provider is not None:
        _provider.force_flush(timeout_millis)


def shutdown_tracing() -> None:
    """Export what is buffered and stop (on a graceful exit; atexit does it too)."""
    global _enabled
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()
    _enabled = False


def enabled() -> bool:
    """Whether spans are exported; check it before building attributes on a hot path."""
    return _enabled


def get_tracer(component: str) -> trace.Tracer:
    from pagefleet import __version__

    return trace.get_tracer(f"pagefleet.{component}", __version__)


def record_prompts(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return _env_true(env, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT") or _env_true(
        env, "PAGEFLEET_TRACE_PROMPTS"
    )


def request_attributes(
    *,
    model: str,
    max_tokens: int,
    request_id: str | None = None,
    num_prompt_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    prompt: str | None = None,
) -> dict[str, Any]:
    """The GenAI attributes of a generation request; ``prompt`` only if record_prompts()."""
    attrs: dict[str, Any] = {
        GEN_AI_OPERATION_NAME: OPERATION_TEXT_COMPLETION,
        GEN_AI_SYSTEM: SYSTEM,
        GEN_AI_REQUEST_MODEL: model,
        GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
    }
    if request_id is not None:
        attrs[REQUEST_ID] = request_id
        attrs[GEN_AI_RESPONSE_ID] = request_id
    if num_prompt_tokens is not None:
        attrs[GEN_AI_USAGE_INPUT_TOKENS] = num_prompt_tokens
    if temperature is not None:
        attrs[GEN_AI_REQUEST_TEMPERATURE] = temperature
    if top_p is not None:
        attrs[GEN_AI_REQUEST_TOP_P] = top_p
    if prompt is not None and record_prompts():
        attrs[GEN_AI_INPUT_MESSAGES] = prompt
    return attrs


def finish_attributes(finish_reason: str | None, num_output_tokens: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {GEN_AI_USAGE_OUTPUT_TOKENS: num_output_tokens}
    if finish_reason:
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
    return attrs


# -- propagation ---------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


class _Getter:
    """Reads a carrier whose keys and values may be bytes (redis-py without decoding)."""

    def get(self, carrier: Mapping[Any, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = carrier.get(key.encode())
        return None if value is None else [_text(value)]

    def keys(self, carrier: Mapping[Any, Any]) -> list[str]:
        return [_text(k) for k in carrier]


_GETTER = _Getter()


def inject(
    carrier: MutableMapping[str, Any] | None = None, context: otel_context.Context | None = None
) -> MutableMapping[str, Any]:
    """Add ``traceparent`` (and ``tracestate``) of the current or given span to ``carrier``.

    Returns the carrier (a new dict if None); adds nothing while tracing is off.
    """
    carrier = {} if carrier is None else carrier
    if _enabled:
        propagate.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[Any, Any] | None) -> otel_context.Context:
    """The context carried by a Redis entry or metadata mapping (empty if none)."""
    if not carrier or not _enabled:
        return otel_context.Context()
    return propagate.extract(carrier, getter=_GETTER, context=otel_context.Context())


def grpc_metadata(
    context: otel_context.Context | None = None, metadata: Iterable[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the current (or given) span, after ``metadata``."""
    return tuple(metadata) + tuple(inject({}, context).items())


def extract_grpc(servicer_context: Any) -> otel_context.Context:
    """The caller's context from a (sync or asyncio) servicer context's metadata."""
    if not _enabled:
        return otel_context.Context()
    metadata = servicer_context.invocation_metadata() or ()
    return extract({m[0]: m[1] for m in metadata if m[0] in TRACE_FIELDS})


def attach(span: Span) -> object:
    """Make ``span`` current (until :func:`detach` with the returned token)."""
    return otel_context.attach(trace.set_span_in_context(span))


def detach(token: object) -> None:
    otel_context.detach(token)


def span_context_of(span_or_context: Span | otel_context.Context | None) -> trace.SpanContext | None:
    """The SpanContext of a span or of a context's current span (None if invalid)."""
    if span_or_context is None:
        return None
    if isinstance(span_or_context, Span):
        sc = span_or_context.get_span_context()
    else:
        sc = trace.get_current_span(span_or_context).get_span_context()
    return sc if sc.is_valid else None


def current_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` of the current span as hex, or None outside a span."""
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


# -- the worker's request spans --------------------------------------------------------
class _RequestSpans:
    __slots__ = ("request", "phase", "decoding", "num_chunks")

    def __init__(self, request: Span, phase: Span) -> None:
        self.request = request
        self.phase = phase  # the open "prefill" span, then the "decode" span
        self.decoding = False
        self.num_chunks = 0


class WorkerSpans:
    """The spans one worker writes for its requests.

    Per request: ``worker.request`` (child of the scheduler's assign span), under it
    ``prefill`` with a ``prefill_chunk`` event per chunk, then ``decode`` from the first
    token to the finish; preemption and swaps are events with block counts. Per engine
    step: one ``forward`` span linked to every request it served (never a copy per request).
    Every method returns at once while tracing is off.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._tracer = get_tracer("worker")
        self._requests: dict[str, _RequestSpans] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def start(self, request_id: str, parent: otel_context.Context | Mapping[Any, Any] | None,
              attributes: Mapping[str, Any] | None = None) -> None:
        """Open the request's spans; ``parent`` is a context or a carrier of trace fields."""
        if not _enabled or request_id in self._requests:
            return
        if not isinstance(parent, otel_context.Context):
            parent = extract(parent)
        attrs = {REQUEST_ID: request_id, WORKER_ID: self.worker_id, **(attributes or {})}
        span = self._tracer.start_span("worker.request", context=parent, attributes=attrs)
        phase = self._tracer.start_span("prefill", context=trace.set_span_in_context(span))
        self._requests[request_id] = _RequestSpans(span, phase)

    def before_step(self) -> int | None:
        """Call right before an engine step; hand the result to :meth:`after_step`."""
        return time.time_ns() if _enabled and self._requests else None

    def after_step(self, started_ns: int | None, scheduled: Iterable[tuple[str, int, int]]) -> None:
        """Record one engine step that began at ``started_ns`` (from :meth:`before_step`).

        ``scheduled`` holds ``(request_id, num_scheduled_tokens, num_computed_tokens)`` for
        every request the step computed; prefill chunks become events on their requests.
        """
        if started_ns is None or not _enabled:
            return
        links, num_tokens = [], 0
        for request_id, n, computed in scheduled:
            num_tokens += n
            spans = self._requests.get(request_id)
            if spans is None:
                continue
            context = spans.request.get_span_context()
            if context.trace_flags.sampled:  # an unsampled request's trace gets no forward spans
                links.append(Link(context))
            if n > 1 or not spans.decoding:
                spans.num_chunks += 1
                spans.phase.add_event(
                    "prefill_chunk" if not spans.decoding else "recompute_chunk",
                    {NUM_TOKENS: n, NUM_COMPUTED_TOKENS: computed},
                )
        if not links:
            return
        span = self._tracer.start_span(
            "forward",
            context=otel_context.Context(),  # its own trace: it serves many requests
            links=links,
            start_time=started_ns,
            attributes={WORKER_ID: self.worker_id, NUM_REQUESTS: len(links), NUM_TOKENS: num_tokens},
        )
        span.end()

    def traceparent(self, request_id: str) -> str:
        """W3C ``traceparent`` of the request's span ("" when it is not traced here): what
        another process continues its trace from (a migration's target)."""
        spans = self._requests.get(request_id) if _enabled else None
        if spans is None:
            return ""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(spans.request))
        return carrier.get("traceparent", "")

    def on_tokens(self, request_id: str, num_new_tokens: int) -> None:
        """Tokens came out for the request: the first ones close ``prefill`` and open ``decode``."""
        spans = self._requests.get(request_id) if _enabled else None
        if spans is None or spans.decoding or num_new_tokens == 0:
            return
        spans.phase.set_attribute("pagefleet.num_chunks", spans.num_chunks)
        spans.phase.end()
        spans.phase = self._tracer.start_span(
            "decode", context=trace.set_span_in_context(spans.request)
        )
        spans.decoding = True

    def event(self, request_id: str, name: str, **attributes: Any) -> None:
        """An event on the request's span: ``preempted``, ``swap_out``, ``swap_in``..."""
        spans = self._requests.get(request_id) if _enabled else None
        if spans is not None:
            spans.request.add_event(name, {f"pagefleet.{k}": v for k, v in attributes.items()})

    def finish(self, request_id: str, finish_reason: str | None, num_output_tokens: int,
               error: str | None = None) -> None:
        """Close the request's spans (finished, aborted, or failed with ``error``)."""
        spans = self._requests.pop(request_id, None) if _enabled else None
        if spans is None:
            return
        spans.phase.end()
        spans.request.set_attributes(finish_attributes(finish_reason, num_output_tokens))
        if error:
            spans.request.set_status(Status(StatusCode.ERROR, error))
        spans.request.end()

    def finish_all(self, error: str) -> None:
        for request_id in list(self._requests):
            self.finish(request_id, None, 0, error)
