"""Prometheus metrics of each component, served on ``/metrics`` on its own port.

Each component builds one set (``WorkerMetrics``, ``SchedulerMetrics``, ``GatewayMetrics``)
on its own registry and serves it with :func:`start_metrics_server`; nothing is global,
so two components in one process (tests, ``pagefleet up`` in threads) do not collide.
Names follow vLLM's (``pagefleet:`` prefix, seconds, ``_total`` counters) so existing
dashboards carry over.
"""

from __future__ import annotations

import bisect
import contextlib
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

__all__ = [
    "GatewayMetrics",
    "with_labels",
    "MetricsServer",
    "SchedulerMetrics",
    "WorkerMetrics",
    "start_metrics_server",
]

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
DECISION_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class MetricsServer:
    """A running ``/metrics`` endpoint; ``port`` is the bound one (useful with port 0)."""

    host: str
    port: int
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0", *,
                         tls: ssl.SSLContext | None = None,
                         authorize: Callable[[str | None], bool] | None = None) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; over TLS with
    ``tls``; to requests whose ``Authorization`` header ``authorize`` accepts, if given."""
    from pagefleet.common import metrics_http

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be between 0 and 65535, got {port!r}")
    disable_created_metrics()  # the *_created series only add noise to every scrape
    server = metrics_http.start(port, registry, host, tls=tls, authorize=authorize)
    return MetricsServer(host, server.server_address[1], server)


class _Labelled:
    """A collector: every sample of each registry with its labels added, one family a name."""

    def __init__(self, parts: list[tuple[CollectorRegistry, dict[str, str]]]) -> None:
        self.parts = parts

    def collect(self):
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        for registry, labels in self.parts:
            for family in registry.collect():
                out = families.get(family.name)
                if out is None:
                    out = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]
        yield from families.values()


def with_labels(registry: CollectorRegistry | list[tuple[CollectorRegistry, dict[str, str]]],
                **labels: str) -> CollectorRegistry:
    """A registry serving every sample of ``registry`` with ``labels`` added: a scheduler's or
    worker's ``model`` and ``shard``, so a dashboard sums ``by (model, shard)``. Given several
    ``(registry, labels)`` (the workers of one process, each its ``worker``), it serves them all,
    each sample with its own registry's labels too."""
    common = {k: v for k, v in labels.items() if v is not None}
    parts = registry if isinstance(registry, list) else [(registry, {})]
    outer = CollectorRegistry(auto_describe=False)
    outer.register(_Labelled([(r, {**own, **common}) for r, own in parts]))
    return outer


def _registry(registry: CollectorRegistry | None) -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True) if registry is None else registry


class _CountOf:
    """A counter whose value a function gives when scraped (``count``): for a count kept
    anyway by the code that counts, so the hot path does not also increment a metric."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._count: Callable[[], float] = lambda: 0
        registry.register(self)

    def count(self, fn: Callable[[], float]) -> None:
        self._count = fn

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(self.name, self.documentation, value=self._count())

    def describe(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(self.name, self.documentation)


# Why a request leaves a worker without finishing there (it goes on elsewhere): not a finish.
NOT_FINISHED = frozenset({"migrated", "handed_back", "fenced_off"})


class WorkerMetrics:
    """The worker's pool, queues and per-request latencies.

    The engine loop calls :meth:`request_added` when a request arrives, :meth:`observe_step`
    after each step with the step's deltas and the engine's stats, and
    :meth:`request_removed` when a request leaves without a finishing delta (cancel).
    """

    # counter -> the cumulative EngineStats field it follows (missing fields count as 0)
    _CUMULATIVE = {
        "preemptions": "num_preemptions_total",
        "swapped_out_blocks": "num_swapped_out_blocks_total",
        "swapped_in_blocks": "num_swapped_in_blocks_total",
        "prefix_cache_queries": "prefix_cache_queries_total",
        "prefix_cache_hits": "prefix_cache_hits_total",
        "sim_model_cpu_seconds": "sim_model_cpu_seconds_total",
    }

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = _registry(registry)
        self.running = Gauge("pagefleet:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("pagefleet:num_requests_waiting", "Requests waiting for blocks.", registry=r)
        self.swapped = Gauge("pagefleet:num_requests_swapped", "Requests swapped out to CPU.", registry=r)
        self.kv_cache_usage = Gauge(
            "pagefleet:kv_cache_usage_perc", "Fraction of GPU KV-cache blocks in use (0 to 1).", registry=r
        )
        self.num_blocks = Gauge("pagefleet:num_gpu_blocks", "Blocks in the GPU KV pool.", registry=r)
        self.preemptions = Counter("pagefleet:num_preemptions", "Preemptions (swap or recompute).", registry=r)
        self.swapped_out_blocks = Counter(
            "pagefleet:swapped_out_blocks", "KV blocks copied from GPU to CPU.", registry=r
        )
        self.swapped_in_blocks = Counter(
            "pagefleet:swapped_in_blocks", "KV blocks copied from CPU back to GPU.", registry=r
        )
        self.prefix_cache_queries = Counter(
            "pagefleet:prefix_cache_queries", "Tokens looked up in the prefix cache at admission.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "pagefleet:prefix_cache_hits", "Tokens looked up in the prefix cache and found cached.", registry=r
        )
        self.sim_model_cpu_seconds = Counter(
            "pagefleet:sim_model_cpu_seconds",
            "CPU seconds the engine thread spent in the simulated model (--engine sim: its cost model and "
            "token draw, what the forward pass and sampler are to a real engine; 0 on a real engine).",
            registry=r,
        )
        self.kv_transfer_peers = Gauge(
            "pagefleet:kv_transfer_peers",
            "Peers met for KV transfer, by the path this worker's reads from them take "
            "(cma: one copy between processes; tcp: ptrace rules forbid cma, 5-15x slower; network).",
            ["path"], registry=r,
        )
        self.migrations = Counter(
            "pagefleet:kv_migrations",
            "Live migrations this worker ran as the source, by outcome (migrated, gave_up, failed, expired, "
            "refused) and reason (balance, preemption, disaggregation, drain).",
            ["outcome", "reason"], registry=r,
        )
        self.migrations_received = Counter(
            "pagefleet:kv_migrations_received",
            "Migrations this worker received, by outcome (committed, aborted, expired: the lease or the "
            "deadline passed and its blocks were reclaimed).",
            ["outcome"], registry=r,
        )
        self.drained_requests = Counter(
            "pagefleet:drained_requests",
            "Requests a drain let go, by how: migrated (to a peer with their KV), recomputed (handed back "
            "to resume from their tokens) or finished (here, before the drain ended).",
            ["outcome"], registry=r,
        )
        self.ttft = Histogram(
            "pagefleet:time_to_first_token_seconds", "From arrival at the worker to the first token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "pagefleet:inter_token_latency_seconds", "Between consecutive output tokens.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "pagefleet:e2e_request_latency_seconds", "From arrival at the worker to the last token.",
            buckets=REQUEST_BUCKETS, registry=r,
        )
        self.iteration_tokens = Histogram(
            "pagefleet:iteration_tokens_total", "Tokens computed per engine step.",
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("pagefleet:prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter("pagefleet:generation_tokens", "Tokens generated.", registry=r)
        # Read from the writer's own count when scraped (``output_writes.count``): nothing a write.
        self.output_writes = _CountOf("pagefleet:worker_output_writes",
                                      "Round trips that wrote steps' output to Redis.", registry=r)
        self.request_success = Counter(
            "pagefleet:request_success", "Requests finished, by finish reason.", ["finished_reason"], registry=r
        )
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._resumed: set[str] = set()  # resumed here after tokens elsewhere (``request_added``)
        self._totals: dict[str, float] = {}

    def request_added(self, request_id: str, num_prompt_tokens: int, arrival_time: float | None = None,
                      resumed: bool = False) -> None:
        """``arrival_time`` is a ``time.monotonic()`` reading (default: now). ``resumed``: it
        made tokens elsewhere before (moved, handed back, its worker lost): its prompt was
        counted there, its first token came there (no time to first token here), and its
        latency from here would be a part of it (no end-to-end either); its finish counts here."""
        now = time.monotonic() if arrival_time is None else arrival_time
        self._arrival[request_id] = now
        if resumed:
            self._last_token[request_id] = now  # its next token is a gap, not a first token
            self._resumed.add(request_id)
        else:
            self.prompt_tokens.inc(num_prompt_tokens)

    def request_removed(self, request_id: str, finish_reason: str = "abort") -> None:
        """It left without a finishing token: cancelled or failed (a finish), or gone on
        elsewhere (``NOT_FINISHED``: counted where it ends)."""
        if self._arrival.pop(request_id, None) is not None and finish_reason not in NOT_FINISHED:
            self.request_success.labels(finish_reason).inc()
        self._last_token.pop(request_id, None)
        self._resumed.discard(request_id)

    def observe_step(self, deltas: Iterable[Any], stats: Any, num_scheduled_tokens: int = 0,
                     now: float | None = None) -> None:
        """After one step: ``deltas`` are TokenDelta-like, ``stats`` EngineStats-like (None: the
        same as last time, the gauges are left as they are).

        Runs for every step of every worker, so it touches each metric once a step, not once a
        token: the tokens generated are counted once, and the inter-token gaps, most of them
        equal (every request that made a token in the last step too), are observed once per value.
        """
        now = time.monotonic() if now is None else now
        if num_scheduled_tokens:
            self.iteration_tokens.observe(num_scheduled_tokens)
        generated = 0
        gaps: dict[float, int] = {}
        last_token, arrivals = self._last_token, self._arrival
        for d in deltas:
            rid, n = d.request_id, len(d.token_ids)
            if n:
                generated += n
                last = last_token.get(rid)
                if last is None:
                    arrival = arrivals.get(rid)
                    if arrival is not None:
                        self.ttft.observe(now - arrival)
                else:
                    gap = (now - last) / n
                    gaps[gap] = gaps.get(gap, 0) + n
                last_token[rid] = now
            if d.finish_reason is not None:
                arrival = arrivals.pop(rid, None)
                last_token.pop(rid, None)
                if arrival is not None:
                    if rid in self._resumed:
                        self._resumed.discard(rid)
                    else:
                        self.e2e.observe(now - arrival)
                    self.request_success.labels(d.finish_reason).inc()
        if generated:
            self.generation_tokens.inc(generated)
        for gap, count in gaps.items():
            observe_many(self.itl, gap, count)
        if stats is not None:
            self.observe_stats(stats)

    def observe_stats(self, stats: Any) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(getattr(stats, "num_swapped", 0))
        self.num_blocks.set(stats.num_blocks)
        used = stats.num_blocks - stats.num_free_blocks
        self.kv_cache_usage.set(used / stats.num_blocks if stats.num_blocks else 0.0)
        for counter, field in self._CUMULATIVE.items():
            total = getattr(stats, field, None)
            if total is None:
                continue
            grown = total - self._totals.get(field, 0)
            if grown > 0:
                getattr(self, counter).inc(grown)
            self._totals[field] = total


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, in one update of its sum and one bucket."""
    if count == 1:
        histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(count)


class SchedulerCounts(Protocol):
    """The public state the scheduler's gauges read (``scheduler.ledger.Ledger`` has it)."""

    @property
    def num_waiting(self) -> int: ...  # requests in the global queue

    @property
    def num_known(self) -> int: ...  # requests taken in and not finished (their entries pending)

    @property
    def num_placed(self) -> int: ...  # requests placed on a worker

    @property
    def num_workers(self) -> int: ...  # live workers

    @property
    def num_prefix_index_keys(self) -> int: ...


class SchedulerMetrics:
    """The global queue, the worker table and the scheduler's decisions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = _registry(registry)
        self.queue_length = Gauge(
            "pagefleet:scheduler_queue_length", "Requests in the global waiting queue.", registry=r
        )
        self.pending_entries = Gauge(
            "pagefleet:scheduler_pending_entries",
            "Entries of the request stream delivered to the scheduler and not yet acknowledged.",
            registry=r,
        )
        self.assigned = Gauge(
            "pagefleet:scheduler_assigned_requests", "Requests assigned to a worker and not finished.",
            registry=r,
        )
        self.workers = Gauge("pagefleet:scheduler_workers", "Live workers in the worker table.", registry=r)
        self.free_blocks = Gauge(  # set from each report; a dead worker's label is removed
            "pagefleet:scheduler_free_blocks", "Free KV blocks reported by each worker.", ["worker"], registry=r
        )
        self.admissions = Counter("pagefleet:scheduler_admissions", "Requests assigned to a worker.", registry=r)
        self.preemptions = Counter(
            "pagefleet:scheduler_preemptions", "Preemptions the scheduler directed.", registry=r
        )
        self.reassignments = Counter(
            "pagefleet:scheduler_reassignments", "Requests moved to another worker.", registry=r
        )
        self.dead_workers = Counter("pagefleet:scheduler_dead_workers", "Workers declared dead.", registry=r)
        self.transfers = Counter(
            "pagefleet:scheduler_transfers",
            "KV transfers (live migrations) the scheduler started, by reason (drain, balance, preemption, "
            "disaggregation) and outcome (migrated, gave_up, failed, expired, refused, not_found).",
            ["reason", "outcome"], registry=r,
        )
        self.decision_latency = Histogram(
            "pagefleet:scheduler_decision_latency_seconds", "Time to take one scheduling decision.",
            buckets=DECISION_BUCKETS, registry=r,
        )
        self.placements = Counter(
            "pagefleet:scheduler_placements",
            "Requests placed, by what decided the worker: cache, load, balance, round-robin, preempt.",
            ["decision"], registry=r,
        )
        self.prefix_matched_blocks = Counter(
            "pagefleet:scheduler_prefix_matched_blocks",
            "Blocks of the placed requests' prompts the chosen worker held already (per the prefix index).",
            registry=r,
        )
        self.prefix_index_keys = Gauge(
            "pagefleet:scheduler_prefix_index_keys", "Cached block keys in the scheduler's prefix index.", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(  # from each report; a dead worker's label is removed
            "pagefleet:scheduler_worker_prefix_cache_hit_rate",
            "Each worker's prefix cache hits / queries (prompt tokens) since it started.", ["worker"], registry=r,
        )

    def bind(self, state: SchedulerCounts) -> None:
        """Read the gauges from the active scheduler's state at every scrape."""
        self.queue_length.set_function(lambda: state.num_waiting)
        self.pending_entries.set_function(lambda: state.num_known)
        self.assigned.set_function(lambda: state.num_placed)
        self.workers.set_function(lambda: state.num_workers)
        self.prefix_index_keys.set_function(lambda: state.num_prefix_index_keys)

    def observe_report(self, worker_id: str, report: Any) -> None:
        """The per-worker gauges from one OccupancyReport."""
        self.free_blocks.labels(worker=worker_id).set(report.num_free_blocks)
        if report.prefix_cache_queries_total:
            self.prefix_cache_hit_rate.labels(worker=worker_id).set(
                report.prefix_cache_hits_total / report.prefix_cache_queries_total)

    def forget_worker(self, worker_id: str) -> None:
        """Drop a dead worker's labels (those it never had are skipped)."""
        for gauge in (self.free_blocks, self.prefix_cache_hit_rate):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)

    def placed(self, decision: str, num_matched_blocks: int) -> None:
        self.placements.labels(decision=decision).inc()
        if num_matched_blocks:
            self.prefix_matched_blocks.inc(num_matched_blocks)


class GatewayMetrics:
    """Requests the gateway answered, by gRPC status code, and the ones it shed.

    A completion request over HTTP counts as a Generate call (by the gRPC code its HTTP
    status stands for: 400 INVALID_ARGUMENT, 429 RESOURCE_EXHAUSTED, ...); every HTTP
    response is also counted by route and HTTP status in ``http_requests``.

    ``by_model``: the calls' series (requests, shed, in flight, TTFT, latency) carry a
    ``model`` label (a gateway serving several models); each model's core counts through
    ``for_model(name)``. Without it (one model) the series carry no model label, as before.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, by_model: bool = False) -> None:
        r = self.registry = _registry(registry)
        self.model: str | None = None  # the model of a ``for_model`` view
        self._root = self
        self.by_model = by_model
        per_call = ["model"] if by_model else []
        self.requests = Counter(
            "pagefleet:gateway_requests", "Generate calls (gRPC or HTTP completions) answered, by gRPC status code.",
            ["code", *per_call], registry=r,
        )
        self.http_requests = Counter(
            "pagefleet:gateway_http_requests", "HTTP requests answered, by route and HTTP status code.",
            ["route", "status"], registry=r,
        )
        self.shed = Counter(
            "pagefleet:gateway_shed_requests", "Requests refused with RESOURCE_EXHAUSTED (queue full).",
            per_call, registry=r,
        )
        self.unauthenticated = Counter(
            "pagefleet:gateway_unauthenticated_requests",
            "Calls refused for a missing or wrong API key, by door (grpc, http).", ["door"], registry=r,
        )
        self.in_flight = Gauge("pagefleet:gateway_requests_in_flight", "Generate calls open now.", per_call,
                               registry=r, multiprocess_mode="livesum")  # summed over `gateway --processes`
        self.ttft = Histogram(
            "pagefleet:gateway_time_to_first_token_seconds", "From the call to its first streamed token.",
            per_call, buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "pagefleet:gateway_request_latency_seconds", "From the call to its end.",
            per_call, buckets=REQUEST_BUCKETS, registry=r,
        )
        self.queued = Counter(
            "pagefleet:gateway_queued_requests", "Requests queued to a shard's request stream, by model and shard.",
            ["model", "shard"], registry=r,
        )

    def for_model(self, model: str) -> GatewayMetrics:
        """The series of ``model``'s calls (``""``: calls naming no served model); this set
        itself when the series carry no model label."""
        import copy

        root = self._root
        if not root.by_model:
            return root
        view = copy.copy(root)
        view.model = model
        for name in ("shed", "in_flight", "ttft", "e2e"):
            setattr(view, name, getattr(root, name).labels(model=model))
        return view

    def queued_to(self, model: str, shard: str) -> None:
        """Count one request queued to ``shard``'s request stream for ``model``."""
        self.queued.labels(model=model, shard=shard).inc()

    def finished(self, code: Any, seconds: float | None = None) -> None:
        """Count one finished call; ``code`` a ``grpc.StatusCode`` or its name."""
        name = getattr(code, "name", None) or str(code)
        if self.model is None:
            self.requests.labels(name).inc()
        else:
            self.requests.labels(code=name, model=self.model).inc()
        if seconds is not None:
            self.e2e.observe(seconds)


def serve_metrics(args: Any, registry: CollectorRegistry, component: str, *, tls: ssl.SSLContext | None = None,
                  authorize: Callable[[str | None], bool] | None = None) -> MetricsServer | None:
    """Serve ``registry`` on ``--metrics-port`` (on ``--host``) if the flag is set; ``tls`` and
    ``authorize`` as ``start_metrics_server`` takes them.

    A port already taken is logged and skipped: metrics must never stop a server.
    """
    import structlog

    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    host = getattr(args, "host", None) or "0.0.0.0"
    log = structlog.get_logger("metrics")
    try:
        server = start_metrics_server(port, registry, host, tls=tls, authorize=authorize)
    except OSError as e:
        log.error("metrics.unavailable", component=component, host=host, port=port, error=str(e))
        return None
    log.info("metrics.serving", component=component, host=host, metrics_port=server.port, tls=tls is not None,
             key_required=authorize is not None)
    return server
