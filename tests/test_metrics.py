"""Each component's metric set moves as its events say, and is served on /metrics."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.common.metrics import (
    GatewayMetrics,
    SchedulerMetrics,
    WorkerMetrics,
    start_metrics_server,
)


def scrape(url: str, shard_labels: bool = False) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` from a Prometheus text endpoint; without the
    ``model`` and ``shard`` labels every scheduler and worker sample carries, unless ``shard_labels``."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    dropped = () if shard_labels else ("model", "shard")
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in dropped))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stats(**kw):
    base = dict(num_blocks=100, num_free_blocks=100, num_running=0, num_waiting=0, num_preemptions_total=0)
    base.update(kw)
    return SimpleNamespace(**base)


def delta(rid, n, finish=None):
    return SimpleNamespace(request_id=rid, token_ids=[7] * n, finish_reason=finish)


def test_a_request_that_moves_between_workers_counts_once():
    """A request resumed on another worker (migrated, handed back, its worker lost) made its
    first token elsewhere: no prompt tokens, time to first token or end-to-end latency here;
    the worker it left counts no finish for it. Summed over the workers it counts as one
    request of its prompt (before: two, with a false time to first token)."""
    source, target = WorkerMetrics(), WorkerMetrics()
    source.request_added("r", num_prompt_tokens=100, arrival_time=10.0)
    source.observe_step([delta("r", 1)], None, 100, now=10.5)
    source.observe_step([delta("r", 1)], None, 1, now=10.52)
    source.request_removed("r", "migrated")
    target.request_added("r", num_prompt_tokens=100, arrival_time=11.0, resumed=True)
    target.observe_step([delta("r", 1)], None, 1, now=11.02)
    target.observe_step([delta("r", 1, "length")], None, 1, now=11.04)
    for reason in ("handed_back", "fenced_off"):
        source.request_added(reason, num_prompt_tokens=1, arrival_time=12.0)
        source.request_removed(reason, reason)

    def total(name, labels=None):
        return sum(m.registry.get_sample_value(name, labels) or 0 for m in (source, target))

    assert total("pagefleet:prompt_tokens_total") == 102
    assert total("pagefleet:time_to_first_token_seconds_count") == 1
    assert total("pagefleet:e2e_request_latency_seconds_count") == 0  # the target saw only its end
    assert total("pagefleet:inter_token_latency_seconds_count") == 3
    assert total("pagefleet:request_success_total", {"finished_reason": "length"}) == 1
    for reason in ("migrated", "handed_back", "fenced_off"):
        assert total("pagefleet:request_success_total", {"finished_reason": reason}) == 0
    assert total("pagefleet:generation_tokens_total") == 4


def test_a_process_of_several_workers_serves_every_workers_metrics():
    """``pagefleet worker --count N`` (and the simulated fleet's processes) served the first
    worker's registry alone: the others' preemptions, tokens and finishes were nowhere. Every
    worker's samples are served, each with its ``worker``, one family a name."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.common.metrics import with_labels

    workers = {"w-0": WorkerMetrics(), "w-1": WorkerMetrics()}
    workers["w-0"].request_added("a", 5)
    workers["w-1"].request_added("b", 7)
    registry = with_labels([(m.registry, {"worker": wid}) for wid, m in workers.items()], model="tiny", shard="s0")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    prompt = families["pagefleet:prompt_tokens"].samples
    assert sorted((s.labels["worker"], s.value) for s in prompt if s.name.endswith("_total")) == [
        ("w-0", 5.0), ("w-1", 7.0)]
    assert all(s.labels["model"] == "tiny" and s.labels["shard"] == "s0" for s in prompt)


def test_worker_metrics_follow_the_engine():
    m = WorkerMetrics()
    m.request_added("a", num_prompt_tokens=5, arrival_time=10.0)
    m.request_added("b", num_prompt_tokens=3, arrival_time=10.0)
    m.observe_step([], stats(num_free_blocks=90, num_running=1, num_waiting=1), 8, now=10.1)
    m.observe_step([delta("a", 1)], stats(num_free_blocks=80, num_running=2), 4, now=10.25)
    m.observe_step(
        [delta("a", 1, "length"), delta("b", 1)],
        stats(num_free_blocks=95, num_running=1, num_preemptions_total=2, num_swapped=1,
              num_swapped_out_blocks_total=6, num_swapped_in_blocks_total=0),
        2, now=10.5,
    )
    m.request_removed("b")
    m.request_removed("b")  # a second cancel counts nothing
    get = m.registry.get_sample_value
    assert get("pagefleet:num_requests_running") == 1
    assert get("pagefleet:num_requests_swapped") == 1
    assert abs(get("pagefleet:kv_cache_usage_perc") - 0.05) < 1e-9
    assert get("pagefleet:num_preemptions_total") == 2
    assert get("pagefleet:swapped_out_blocks_total") == 6
    assert get("pagefleet:swapped_in_blocks_total") == 0
    assert get("pagefleet:time_to_first_token_seconds_count") == 2
    assert abs(get("pagefleet:time_to_first_token_seconds_sum") - (0.25 + 0.5)) < 1e-9
    assert get("pagefleet:inter_token_latency_seconds_count") == 1
    assert abs(get("pagefleet:e2e_request_latency_seconds_sum") - 0.5) < 1e-9
    assert get("pagefleet:iteration_tokens_total_count") == 3
    assert get("pagefleet:iteration_tokens_total_sum") == 14
    assert get("pagefleet:prompt_tokens_total") == 8
    assert get("pagefleet:generation_tokens_total") == 3
    assert get("pagefleet:request_success_total", {"finished_reason": "length"}) == 1
    assert get("pagefleet:request_success_total", {"finished_reason": "abort"}) == 1
    # cumulative engine counters never make a Prometheus counter go down
    m.observe_stats(stats(num_preemptions_total=1))
    assert get("pagefleet:num_preemptions_total") == 2
    # the output writes are the writer's own count, read when scraped
    assert get("pagefleet:worker_output_writes_total") == 0
    writes = [0]
    m.output_writes.count(lambda: writes[0])
    writes[0] = 7
    assert get("pagefleet:worker_output_writes_total") == 7
    from prometheus_client import generate_latest
    assert b"# TYPE pagefleet:worker_output_writes_total counter" in generate_latest(m.registry)


def test_every_component_serves_its_own_metrics_only():
    worker, scheduler, gateway = WorkerMetrics(), SchedulerMetrics(), GatewayMetrics()
    servers = [start_metrics_server(0, m.registry, host="127.0.0.1") for m in (worker, scheduler, gateway)]
    try:
        scheduler.queue_length.set(3)
        scheduler.admissions.inc()
        with scheduler.decision_latency.time():
            pass
        gateway.finished(grpc.StatusCode.OK, 0.2)
        gateway.finished("RESOURCE_EXHAUSTED")
        gateway.shed.inc()
        w, s, g = (scrape(f"http://127.0.0.1:{srv.port}/metrics") for srv in servers)
    finally:
        for srv in servers:
            srv.close()
    assert ("pagefleet:num_requests_running", ()) in w
    assert not any(name.startswith("pagefleet:scheduler") for name, _ in w)
    assert s[("pagefleet:scheduler_queue_length", ())] == 3
    assert s[("pagefleet:scheduler_admissions_total", ())] == 1
    assert s[("pagefleet:scheduler_decision_latency_seconds_count", ())] == 1
    assert not any(name.startswith("pagefleet:gateway") for name, _ in s)
    assert g[("pagefleet:gateway_requests_total", (("code", "OK"),))] == 1
    assert g[("pagefleet:gateway_requests_total", (("code", "RESOURCE_EXHAUSTED"),))] == 1
    assert g[("pagefleet:gateway_shed_requests_total", ())] == 1
    assert not any(name.endswith("_created") for name, _ in g)


def test_observe_many_is_observe_repeated():
    """The worker observes equal inter-token gaps once per value; the histogram must read as
    if each had been observed alone, at every bucket edge and between them."""
    from prometheus_client import CollectorRegistry, Histogram

    from pagefleet.common.metrics import observe_many

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}

    buckets = (0.001, 0.01, 0.1, 1.0)
    one, many = CollectorRegistry(), CollectorRegistry()
    h_one = Histogram("gap", "gap", buckets=buckets, registry=one)
    h_many = Histogram("gap", "gap", buckets=buckets, registry=many)
    for value, count in ((0.0005, 3), (0.001, 2), (0.05, 1), (0.1, 4), (1.0, 5), (7.5, 2), (0.0, 3)):
        for _ in range(count):
            h_one.observe(value)
        observe_many(h_many, value, count)
    assert samples(one) == samples(many)


def test_gateway_metrics_by_model_count_each_models_calls_apart():
    one = GatewayMetrics()
    assert one.for_model("tiny") is one  # one model: no model label, series as before
    m = GatewayMetrics(by_model=True)
    a, b = m.for_model("a"), m.for_model("b")
    a.finished(grpc.StatusCode.OK, 0.1)
    b.finished("RESOURCE_EXHAUSTED")
    b.shed.inc()
    a.in_flight.inc()
    a.ttft.observe(0.05)
    srv = start_metrics_server(0, m.registry, host="127.0.0.1")
    try:
        g = scrape(f"http://127.0.0.1:{srv.port}/metrics", shard_labels=True)
    finally:
        srv.close()
    assert g[("pagefleet:gateway_requests_total", (("code", "OK"), ("model", "a")))] == 1
    assert g[("pagefleet:gateway_requests_total", (("code", "RESOURCE_EXHAUSTED"), ("model", "b")))] == 1
    assert g[("pagefleet:gateway_shed_requests_total", (("model", "b"),))] == 1
    assert g[("pagefleet:gateway_requests_in_flight", (("model", "a"),))] == 1
    assert g[("pagefleet:gateway_time_to_first_token_seconds_count", (("model", "a"),))] == 1


def test_the_steps_latencies_are_each_requests_own():
    """The latencies ``observe_step`` observes (gaps grouped by value, observed once per value)
    are those of a per-request reference (the last token's time of each request), over random
    steps where requests start, pause, make several tokens at once, finish and are removed."""
    import random

    class Reference:
        def __init__(self):
            self.arrival, self.last = {}, {}
            self.ttft, self.itl, self.e2e = [], [], []

        def step(self, deltas, now):
            for d in deltas:
                n = len(d.token_ids)
                if n:
                    last = self.last.get(d.request_id)
                    if last is None:
                        if d.request_id in self.arrival:
                            self.ttft.append(now - self.arrival[d.request_id])
                    else:
                        self.itl += [(now - last) / n] * n
                    self.last[d.request_id] = now
                if d.finish_reason is not None:
                    self.last.pop(d.request_id, None)
                    if d.request_id in self.arrival:
                        self.e2e.append(now - self.arrival.pop(d.request_id))

    rng = random.Random(7)
    m, ref = WorkerMetrics(), Reference()
    live: list[str] = []
    now = 100.0
    for step in range(400):
        now += rng.choice([0.008, 0.0125, 0.03])
        if rng.random() < 0.3:
            rid = f"r{step}"
            live.append(rid)
            m.request_added(rid, 4, arrival_time=now)
            ref.arrival[rid] = now
        deltas = []
        for rid in list(live):
            r = rng.random()
            if r < 0.15:
                continue  # paused this step (preempted, or waiting for blocks)
            n = 2 if r < 0.2 else 0 if r < 0.22 else 1
            finish = "length" if rng.random() < 0.05 else None
            deltas.append(delta(rid, n, finish))
            if finish:
                live.remove(rid)
        m.observe_step(deltas, None, now=now)
        ref.step(deltas, now)
        if live and rng.random() < 0.03:  # a cancel
            rid = live.pop(rng.randrange(len(live)))
            m.request_removed(rid)
            ref.arrival.pop(rid, None)
            ref.last.pop(rid, None)
    get = m.registry.get_sample_value
    for name, values in (("time_to_first_token", ref.ttft), ("inter_token_latency", ref.itl),
                         ("e2e_request_latency", ref.e2e)):
        assert get(f"pagefleet:{name}_seconds_count") == len(values) > 10, name
        assert abs(get(f"pagefleet:{name}_seconds_sum") - sum(values)) < 1e-6, name
    assert not m._last_token.keys() - set(live)  # nothing kept of the requests gone
