"""End to end: one trace per request across gateway, scheduler and worker; live /metrics.

The cluster's processes export to a small OTLP receiver in this process (the
``opentelemetry-proto`` service definitions) and serve /metrics on fixed ports; the test
sends requests, then checks every request's spans form one tree with the right parents
and that each component's metrics moved.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from cluster_fixtures import generate_all, start_cluster, wait_for
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from test_metrics import scrape

from pagefleet.common.service import free_port

PROMPTS = ["tracing " * 9, "where did the time go?", "a b c"]
MAX_TOKENS = 6


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span with its service name, and each service's resource attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.resources: dict[str, dict[str, str]] = {}
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                self.resources[attrs.get("service.name", "")] = attrs
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, object]]:
        with self.lock:
            return list(self.spans)


@contextlib.contextmanager
def serving_receiver(num_threads: int = 4):
    """A ``Receiver`` behind an OTLP gRPC server on a free loopback port (``rx.port``)."""
    rx = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(num_threads))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rx, server)
    rx.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield rx
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def receiver():
    with serving_receiver(4) as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_cluster(receiver, tmp_path_factory):
    ports = {name: free_port() for name in ("gateway", "scheduler", "worker")}
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)  # the cluster's processes inherit it
    for k in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
        mp.delenv(k, raising=False)
    try:
        cluster = start_cluster(
            tmp_path_factory.mktemp("traced"),
            num_workers=1,
            worker_args=["--metrics-port", str(ports["worker"]), "--max-num-batched-tokens", "16"],
            scheduler_args=["--metrics-port", str(ports["scheduler"])],
            gateway_args=["--metrics-port", str(ports["gateway"])],
        )
    finally:
        mp.undo()
    cluster.metrics_urls = {k: f"http://127.0.0.1:{p}/metrics" for k, p in ports.items()}
    yield cluster
    cluster.stop()


def _hex(b: bytes) -> str:
    return b.hex()


def test_each_request_is_one_trace_across_three_processes(traced_cluster, receiver):
    before = {k: scrape(url) for k, url in traced_cluster.metrics_urls.items()}
    results = generate_all(traced_cluster.gateway_target, PROMPTS, MAX_TOKENS)
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)

    def traces():
        by_trace = defaultdict(list)
        for service, span in receiver.snapshot():
            by_trace[_hex(span.trace_id)].append((service, span))
        # Each process exports on its own schedule: wait until every part of each trace is in.
        names = ("pagefleet.v1.Generation/Generate", "send pf:{s0}:requests", "queue_wait", "assign",
                 "worker.request", "decode")
        complete = {t: s for t, s in by_trace.items()
                    if all(any(sp.name == n for _, sp in s) for n in names)}
        return complete if len(complete) >= len(PROMPTS) else None

    found = wait_for(traces, 30, "every request's spans from all three processes")
    assert len(found) == len(PROMPTS)
    request_span_ids = set()
    for spans in found.values():
        by_name = defaultdict(list)
        for service, span in spans:
            by_name[span.name].append((service, span))
        (gen_service, gen), = by_name["pagefleet.v1.Generation/Generate"]
        (send_service, send), = by_name["send pf:{s0}:requests"]
        (q_service, queue), = by_name["queue_wait"]
        (a_service, assign), = by_name["assign"]
        (w_service, work), = by_name["worker.request"]
        assert gen_service == send_service == "pagefleet-gateway"
        assert q_service == a_service == "pagefleet-scheduler"
        assert w_service == "pagefleet-worker"
        assert gen.parent_span_id == b""  # the client sent no context: the gateway's span is the root
        assert gen.kind == gen.SPAN_KIND_SERVER and send.kind == send.SPAN_KIND_PRODUCER
        assert queue.kind == queue.SPAN_KIND_CONSUMER and assign.kind == assign.SPAN_KIND_CLIENT
        assert send.parent_span_id == gen.span_id
        assert queue.parent_span_id == send.span_id
        assert assign.parent_span_id == queue.span_id
        assert work.parent_span_id == assign.span_id
        for name in ("prefill", "decode"):
            (_, phase), = by_name[name]
            assert phase.parent_span_id == work.span_id, name
        sent = {kv.key: kv.value.string_value for kv in send.attributes}
        assert (sent["pagefleet.model"], sent["pagefleet.shard"]) == ("tiny", "s0")
        a = {kv.key: kv.value for kv in assign.attributes}
        assert a["pagefleet.worker_id"].string_value == "worker-0"
        assert "pagefleet.num_free_blocks" in a
        g = {kv.key: kv.value for kv in gen.attributes}
        assert g["gen_ai.operation.name"].string_value == "text_completion"
        assert g["gen_ai.request.max_tokens"].int_value == MAX_TOKENS
        assert g["gen_ai.usage.output_tokens"].int_value == MAX_TOKENS
        assert [v.string_value for v in g["gen_ai.response.finish_reasons"].array_value.values] == ["length"]
        assert not any("tracing" in str(kv.value) for _, s in spans for kv in s.attributes), "prompt recorded"
        request_span_ids.add(work.span_id)
    # Every span of the scheduler and of the worker names their shard and model.
    for service in ("pagefleet-scheduler", "pagefleet-worker"):
        res = receiver.resources[service]
        assert (res["pagefleet.shard"], res["pagefleet.model"]) == ("s0", "tiny"), res
    # Forward passes are their own spans, linked to the requests they served.
    linked = {link.span_id for _, s in receiver.snapshot() if s.name == "forward" for link in s.links}
    assert request_span_ids <= linked
    # chunked prefill: the 16-token budget split the longest prompt
    chunks = [e for _, s in receiver.snapshot() if s.name == "prefill" for e in s.events if e.name == "prefill_chunk"]
    assert len(chunks) > len(PROMPTS)

    after = {k: scrape(url) for k, url in traced_cluster.metrics_urls.items()}

    def grew(component, name, labels=()):
        return after[component].get((name, labels), 0) - before[component].get((name, labels), 0)

    n = len(PROMPTS)
    assert grew("gateway", "pagefleet:gateway_requests_total", (("code", "OK"),)) == n
    assert grew("gateway", "pagefleet:gateway_time_to_first_token_seconds_count") == n
    assert grew("scheduler", "pagefleet:scheduler_admissions_total") == n
    assert grew("scheduler", "pagefleet:scheduler_decision_latency_seconds_count") >= n
    assert after["scheduler"][("pagefleet:scheduler_workers", ())] == 1
    assert after["scheduler"][("pagefleet:scheduler_queue_length", ())] == 0
    assert grew("worker", "pagefleet:time_to_first_token_seconds_count") == n
    assert grew("worker", "pagefleet:e2e_request_latency_seconds_count") == n
    assert grew("worker", "pagefleet:inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert grew("worker", "pagefleet:generation_tokens_total") == n * MAX_TOKENS
    assert grew("worker", "pagefleet:request_success_total", (("finished_reason", "length"),)) == n
    assert grew("worker", "pagefleet:iteration_tokens_total_count") > 0
    assert after["worker"][("pagefleet:num_requests_running", ())] == 0
    assert after["worker"][("pagefleet:kv_cache_usage_perc", ())] == 0


def test_gateway_counts_refused_requests(traced_cluster):
    from pagefleet.client import Client

    before = scrape(traced_cluster.metrics_urls["gateway"])
    with Client(traced_cluster.gateway_target) as c, pytest.raises(grpc.RpcError) as err:
        c.generate("", max_tokens=4, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 5
    key = ("pagefleet:gateway_requests_total", (("code", "INVALID_ARGUMENT"),))
    while scrape(traced_cluster.metrics_urls["gateway"]).get(key, 0) - before.get(key, 0) < 1:
        assert time.monotonic() < deadline, "the refused call was not counted"
        time.sleep(0.05)
