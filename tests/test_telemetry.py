"""Tracing setup, context propagation, the worker's spans, and structured logs."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagefleet.common import log, telemetry


@pytest.fixture(scope="module")
def exporter():
    exp = InMemorySpanExporter()
    assert telemetry.setup_tracing("test", exporter=exp)
    return exp


@pytest.fixture
def spans(exporter):
    exporter.clear()

    def finished():
        telemetry.flush_tracing()
        return exporter.get_finished_spans()

    return finished


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ],
)
def test_tracing_configured_from_otel_env(env, on):
    assert telemetry.tracing_configured(env) is on


def test_the_exporter_is_the_one_the_variables_name():
    """OTLP over gRPC by default, over HTTP when the protocol says so (before, the gRPC exporter
    spoke to an HTTP collector and every span was lost), the console when asked; a protocol or
    exporter the SDK does not have is a start-up error, not silence."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    endpoint = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"}
    assert isinstance(telemetry._make_exporter(endpoint), GrpcExporter)
    for protocol in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        assert isinstance(telemetry._make_exporter({**endpoint, protocol: "http/protobuf"}), HttpExporter)
    console = {"OTEL_TRACES_EXPORTER": "console"}
    assert telemetry.tracing_configured(console) and isinstance(telemetry._make_exporter(console), ConsoleSpanExporter)
    assert telemetry.configuration_error({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert telemetry.configuration_error({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert telemetry.configuration_error(endpoint) == ""
    env: dict[str, str] = {}
    telemetry.set_traces_endpoint("http://collector:4317", env)  # --otlp-traces-endpoint
    assert telemetry.tracing_configured(env)


def test_every_component_takes_otlp_traces_endpoint():
    from pagefleet.common.service import EnvArgumentParser, add_common_flags

    parser = EnvArgumentParser()
    add_common_flags(parser)
    assert parser.parse_args(["--otlp-traces-endpoint", "http://c:4317"]).otlp_traces_endpoint == "http://c:4317"


def test_off_without_endpoint_costs_nothing(monkeypatch):
    monkeypatch.setattr(telemetry, "_enabled", False)
    assert telemetry.inject() == {}
    assert telemetry.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is not None
    assert telemetry.grpc_metadata(metadata=[("a", "b")]) == (("a", "b"),)
    worker = telemetry.WorkerSpans("w0")
    worker.start("r1", {})
    assert worker.before_step() is None
    worker.after_step(None, [("r1", 4, 0)])
    worker.finish("r1", "stop", 1)
    assert len(worker) == 0


def test_context_crosses_redis_fields_and_grpc_metadata(spans):
    tracer = telemetry.get_tracer("test")
    with tracer.start_as_current_span("enqueue", kind=telemetry.SpanKind.PRODUCER) as producer:
        fields = telemetry.inject({"request_id": "r1"})
        metadata = telemetry.grpc_metadata(metadata=[("x-request-id", "r1")])
    assert set(fields) >= {"request_id", "traceparent"}
    assert metadata[0] == ("x-request-id", "r1") and metadata[1][0] == "traceparent"
    # redis-py hands fields back as bytes unless decode_responses is set
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    servicer_ctx = SimpleNamespace(invocation_metadata=lambda: metadata)
    for ctx in (telemetry.extract(fields), telemetry.extract(as_bytes), telemetry.extract_grpc(servicer_ctx)):
        with tracer.start_as_current_span("child", context=ctx) as child:
            assert child.parent.span_id == producer.get_span_context().span_id
            assert child.get_span_context().trace_id == producer.get_span_context().trace_id
    assert len(spans()) == 4


def test_request_attributes_hide_prompt_unless_asked(monkeypatch):
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    monkeypatch.delenv("PAGEFLEET_TRACE_PROMPTS", raising=False)
    attrs = telemetry.request_attributes(model="tiny", max_tokens=8, num_prompt_tokens=3, prompt="secret")
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.usage.input_tokens"] == 3
    assert "secret" not in json.dumps(attrs)
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    attrs = telemetry.request_attributes(model="tiny", max_tokens=8, prompt="secret")
    assert attrs[telemetry.GEN_AI_INPUT_MESSAGES] == "secret"


def test_worker_spans_form_a_tree_with_linked_forward_passes(spans):
    tracer = telemetry.get_tracer("test")
    with tracer.start_as_current_span("assign") as assign:
        carrier = telemetry.inject()
    worker = telemetry.WorkerSpans("w0")
    worker.start("a", carrier, {"gen_ai.request.max_tokens": 3})
    worker.start("b", telemetry.extract(carrier))
    worker.after_step(worker.before_step(), [("a", 4, 0), ("b", 4, 0)])  # first prefill chunks
    worker.after_step(worker.before_step(), [("a", 2, 4), ("b", 3, 4)])  # the rest of both prompts
    worker.on_tokens("a", 1)
    worker.on_tokens("b", 1)
    worker.event("b", "swap_out", num_blocks=2)
    worker.after_step(worker.before_step(), [("a", 1, 6)])
    worker.on_tokens("a", 1)
    worker.finish("a", "length", 2)
    worker.finish_all("worker stopped")
    assert len(worker) == 0

    got = spans()
    by_name: dict[str, list] = {}
    for s in got:
        by_name.setdefault(s.name, []).append(s)
    requests = {s.attributes["pagefleet.request_id"]: s for s in by_name["worker.request"]}
    for r in requests.values():
        assert r.parent.span_id == assign.get_span_context().span_id
    assert requests["a"].attributes["gen_ai.usage.output_tokens"] == 2
    assert requests["a"].attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert requests["b"].status.status_code == telemetry.StatusCode.ERROR
    assert [e.name for e in requests["b"].events] == ["swap_out"]
    assert requests["b"].events[0].attributes["pagefleet.num_blocks"] == 2
    prefill_a = next(s for s in by_name["prefill"] if s.parent.span_id == requests["a"].context.span_id)
    assert [e.name for e in prefill_a.events] == ["prefill_chunk", "prefill_chunk"]
    assert [e.attributes["pagefleet.num_tokens"] for e in prefill_a.events] == [4, 2]
    assert len(by_name["decode"]) == 2
    forwards = by_name["forward"]
    assert len(forwards) == 3  # one per step, not one per request
    assert all(f.parent is None for f in forwards)
    assert {link.context.span_id for link in forwards[0].links} == {
        requests["a"].context.span_id, requests["b"].context.span_id
    }
    assert forwards[0].attributes["pagefleet.num_tokens"] == 8


def test_an_unsampled_request_gets_no_forward_spans(spans):
    """A request whose trace is not sampled (``-00``) is in no ``forward`` span's links, and a
    step of such requests alone makes none (before, each step exported a root span of its own:
    hundreds of one-span traces per request)."""
    unsampled = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-00"}
    tracer = telemetry.get_tracer("test")
    with tracer.start_as_current_span("assign"):
        sampled = telemetry.inject()
    worker = telemetry.WorkerSpans("w0")
    worker.start("quiet", unsampled)
    for _ in range(5):
        worker.after_step(worker.before_step(), [("quiet", 1, 0)])
    worker.start("loud", sampled)
    worker.after_step(worker.before_step(), [("quiet", 1, 0), ("loud", 1, 0)])
    worker.finish_all("done")
    forwards = [s for s in spans() if s.name == "forward"]
    assert len(forwards) == 1 and len(forwards[0].links) == 1


def test_a_migrated_request_continues_its_trace_on_the_target(spans):
    """The source's request span travels with the handover (``MigrateCommitRequest.traceparent``,
    copied into the target's ``AssignRequest`` as ``worker/migration_rpc.py`` builds it): the
    target's spans are in the request's trace, under the source's (before: a new root trace)."""
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.observe import WorkerObserver

    tp = "00-" + "e1" * 16 + "-" + "f1" * 8 + "-01"
    source, target = WorkerObserver("src", model="tiny"), WorkerObserver("dst", model="tiny")
    source.assigned(cluster_pb2.AssignRequest(request_id="r1", prompt_token_ids=[1, 2, 3], traceparent=tp))
    source.spans.on_tokens("r1", 1)
    commit = cluster_pb2.MigrateCommitRequest(request_id="r1", prompt_token_ids=[1, 2, 3], output_token_ids=[5, 6],
                                              traceparent=source.spans.traceparent("r1"))
    source.removed("r1", "migrated", 2)
    target.assigned(cluster_pb2.AssignRequest(request_id="r1", prompt_token_ids=commit.prompt_token_ids,
                                              output_token_ids=commit.output_token_ids,
                                              traceparent=commit.traceparent))
    target.spans.finish("r1", "length", 4)
    requests = {s.attributes["pagefleet.worker_id"]: s for s in spans() if s.name == "worker.request"}
    assert {format(s.context.trace_id, "032x") for s in requests.values()} == {"e1" * 16}
    assert requests["dst"].parent.span_id == requests["src"].context.span_id
    assert requests["src"].attributes["gen_ai.usage.output_tokens"] == 2


def test_requests_a_stopping_worker_still_holds_end_their_spans(spans):
    """A worker that hands its requests back as it drains, or whose engine loop stops with
    requests in it, ends their spans (a span never ended is never exported)."""
    from pagefleet.common.sampling_params import SamplingParams
    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.observe import WorkerObserver
    from pagefleet.worker.sim import SimEngine

    with telemetry.get_tracer("test").start_as_current_span("assign"):
        carrier = telemetry.inject()

    def loop_holding(rids):
        loop = EngineLoop(SimEngine(time_scale=float("inf"), max_num_seqs=8), emit=lambda w: None,
                          notify=lambda: None, observer=WorkerObserver("w", model="tiny"))
        for rid in rids:
            loop.assign(cluster_pb2.AssignRequest(request_id=rid, entry_id="1-0", prompt_token_ids=[1, 2, 3],
                                                  sampling=to_proto(SamplingParams(max_tokens=100)), epoch=1,
                                                  reply_to="g", **carrier))
        return loop

    loop = loop_holding(["handed"])
    loop.pause()  # a drain hands them back
    loop = loop_holding(["left"])
    loop._stop.set()
    loop._run()  # the engine thread's loop ends (stopped) with it in the engine
    ended = {s.attributes["pagefleet.request_id"]: s for s in spans() if s.name == "worker.request"}
    assert set(ended) == {"handed", "left"}
    assert ended["handed"].attributes["gen_ai.response.finish_reasons"] == ("handed_back",)
    assert ended["left"].status.status_code == telemetry.StatusCode.ERROR


def test_the_gauges_show_an_engine_its_cancels_left_idle():
    """Requests cancelled between steps, none left: no step runs to set the gauges, which kept
    showing them running (53 of 100 cancelled, for good)."""
    from pagefleet.common.sampling_params import SamplingParams
    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.observe import WorkerObserver
    from pagefleet.worker.sim import SimEngine

    observer = WorkerObserver("w", model="tiny")
    loop = EngineLoop(SimEngine(time_scale=float("inf"), max_num_seqs=8), emit=lambda w: None, notify=lambda: None,
                      observer=observer)
    for rid in ("a", "b"):
        loop.assign(cluster_pb2.AssignRequest(request_id=rid, entry_id="1-0", prompt_token_ids=[1, 2, 3], epoch=1,
                                              sampling=to_proto(SamplingParams(max_tokens=100)), reply_to="g"))
    loop.observer.after_step(loop.observer.before_step(loop.engine), loop.engine, loop.engine.step(),
                             loop.engine.stats())
    gauge = observer.metrics.registry.get_sample_value
    assert gauge("pagefleet:num_requests_running") == 2
    for rid in ("a", "b"):
        loop.call(lambda r=rid: loop.cancel(r, notify_client=False))
    loop._run_commands(block=False)
    assert gauge("pagefleet:num_requests_running") == 0
    assert gauge("pagefleet:kv_cache_usage_perc") == 0


def _log_lines(component: str, emit) -> list[dict]:
    stream = io.StringIO()
    log.configure_logging(component, fmt="json", stream=stream)
    try:
        emit()
    finally:
        logging.getLogger().handlers.clear()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_logs_are_json_lines_with_trace_ids(spans):
    tracer = telemetry.get_tracer("test")

    def emit():
        logger = log.get_logger("pagefleet.test")
        logger.info("outside", num_blocks=3)
        with tracer.start_as_current_span("work") as span, log.bound(request_id="r9"):
            logger.warning("inside")
            logging.getLogger("grpc").error("from the standard library")
            emit.ids = telemetry.current_ids()
            assert emit.ids[1] == format(span.get_span_context().span_id, "016x")

    lines = _log_lines("gateway", emit)
    assert [line["event"] for line in lines] == ["outside", "inside", "from the standard library"]
    for line in lines:
        assert line["component"] == "gateway"
        assert {"timestamp", "level", "event"} <= set(line)
    assert lines[0]["level"] == "info" and lines[0]["num_blocks"] == 3
    assert "trace_id" not in lines[0] and "request_id" not in lines[0]
    for line in lines[1:]:
        assert line["request_id"] == "r9"
        assert (line["trace_id"], line["span_id"]) == emit.ids


def test_console_format_when_asked():
    stream = io.StringIO()
    log.configure_logging("worker", fmt="console", stream=stream)
    try:
        log.get_logger("x").info("hello", request_id="r1")
    finally:
        logging.getLogger().handlers.clear()
    text = stream.getvalue()
    assert "hello" in text and "request_id" in text
    with pytest.raises(ValueError, match="log format"):
        log.configure_logging("worker", fmt="xml")


def test_worker_observer_follows_a_real_engine(spans):
    from pagefleet import Engine, SamplingParams
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.observe import WorkerObserver

    engine = Engine(model="tiny", device="cpu", num_blocks=64, max_num_batched_tokens=16)
    obs = WorkerObserver("w0", model="tiny")
    tracer = telemetry.get_tracer("test")
    with tracer.start_as_current_span("assign") as assign:
        parent = telemetry.extract(telemetry.inject())
    for rid, prompt in (("a", list(range(3, 40))), ("b", [5, 6, 7])):
        msg = cluster_pb2.AssignRequest(request_id=rid, prompt_token_ids=prompt)
        msg.sampling.max_tokens = 4
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0), request_id=rid)
        obs.assigned(msg, parent)
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        token = obs.before_step(engine)
        obs.after_step(token, engine, engine.step(), engine.stats())
    got = spans()
    requests = {s.attributes["pagefleet.request_id"]: s for s in got if s.name == "worker.request"}
    assert set(requests) == {"a", "b"}
    assert all(r.parent.span_id == assign.get_span_context().span_id for r in requests.values())
    assert requests["a"].attributes["gen_ai.usage.output_tokens"] == 4
    prefill_a = next(s for s in got if s.name == "prefill" and s.parent.span_id == requests["a"].context.span_id)
    chunks = [e.attributes["pagefleet.num_tokens"] for e in prefill_a.events]
    assert sum(chunks) == 37 and len(chunks) >= 3  # 16-token budget: the prompt came in chunks
    assert any(s.name == "forward" and len(s.links) == 2 for s in got)
    get = obs.metrics.registry.get_sample_value
    assert get("pagefleet:request_success_total", {"finished_reason": "length"}) == 2
    assert get("pagefleet:iteration_tokens_total_sum") == 37 + 3 + 2 * 3
    assert get("pagefleet:num_requests_running") == 0
