"""``pagefleet worker``: an Engine behind the ``pagefleet.v1.Worker`` gRPC service.

One worker per process, or ``--count N`` of them (each its own engine, port, id and report
stream; one event loop). ``--engine sim`` runs a simulated engine (``sim.SimEngine``): no
model, step times from a profile, so a few processes can stand for hundreds of GPUs.

The engine runs on its own thread (``EngineLoop``); the gRPC handlers only queue work for
it. The worker registers its address in Redis (``<ns>:workers``) every second so the
scheduler finds it, writes every step's tokens to Redis in one round trip
(``OutputWriter``) and streams its occupancy to the scheduler. SIGTERM drains: nothing
new is accepted; with ``--drain-policy migrate`` (and a KV transport) the reports ask the
scheduler to move the requests held to peers with their KV (``migration_rpc.py``); those
still here after ``--drain-timeout`` seconds are handed back (the scheduler resumes them
elsewhere from their emitted tokens: recomputed).

With ``--cluster-ca``, ``--cluster-cert`` and ``--cluster-key`` the port speaks mutual TLS
only: Assign, Preempt, Cancel, Drain (and everything else) need a peer whose certificate
chains to the cluster CA; ``--health-port`` serves health alone in plaintext for probes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import sys
import time
import uuid

import grpc
import structlog

from pagefleet.common import telemetry
from pagefleet.common.metrics import WorkerMetrics, serve_metrics, with_labels
from pagefleet.common.redis import (
    Keys,
    add_redis_flags,
    add_shard_flag,
    check_shard,
    connect_args,
    retry,
)
from pagefleet.common.service import (
    SERVER_OPTIONS,
    EnvArgumentParser,
    add_common_flags,
    add_door_flags,
    add_health_and_reflection,
    freeze_startup_heap,
    open_to_all,
    set_serving,
    setup_logging,
    start_health_port,
)
from pagefleet.common.tls import add_cluster_tls_flags, add_port, check_files, cluster_tls
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .engine_loop import EngineLoop
from .kv_events import KVEventStream
from .migration_rpc import Migrations
from .observe import WorkerObserver
from .redis_io import OutputWriter
from .report import Holdings, occupancy_report

SERVICE = "pagefleet.v1.Worker"
REPORT_INTERVAL_S = 0.1  # a busy worker's reports; an idle one's where the scheduler asks for no interval
MIN_REPORT_INTERVAL_S = 0.01
REGISTER_INTERVAL_S = 1.0


class Changes:
    """What the occupancy streams wait on: ``set`` wakes every stream (its own event each, so one
    stream's report does not clear another's pending change)."""

    def __init__(self) -> None:
        self._events: set[asyncio.Event] = set()

    def set(self) -> None:
        for event in self._events:
            event.set()

    @contextlib.contextmanager
    def watch(self):
        event = asyncio.Event()
        self._events.add(event)
        try:
            yield event
        finally:
            self._events.discard(event)


log = structlog.get_logger("worker")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet worker", description="Run one worker (one engine).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    p.add_argument("--advertise-host", default=None,
                   help="host the scheduler dials (default: --host, or the hostname for 0.0.0.0)")
    add_redis_flags(p)
    add_shard_flag(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in requests: the `model` label of this worker's metrics (default: --model)")
    p.add_argument("--worker-id", default=None, help="unique name (default: host-pid)")
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face checkpoint directory")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: fit memory)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    p.add_argument("--num-swap-blocks", type=int, default=None,
                   help="CPU swap blocks for preempted sequences (default: as many as the device "
                        "pool, within 4 GiB of host memory; 0: recompute only)")
    p.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"),
                   help="how the engine preempts when its pool runs out")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep full KV blocks for later requests with the same prefix")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step eagerly (no CUDA graphs for decode steps)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="auto: the checkpoint's weights; dummy: its shape with random weights (benchmarks)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let held requests finish on SIGTERM before handing them back")
    p.add_argument("--drain-policy", default="migrate", choices=("migrate", "recompute"),
                   help="on SIGTERM or Drain: migrate: the scheduler moves the requests held to peers with their "
                        "KV (needs --kv-transfer nixl; recomputed only where no peer has room); recompute: they get "
                        "--drain-timeout to finish, then are handed back to resume elsewhere from their tokens")
    p.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                   help="prefill/decode disaggregation: the role this worker declares in its registration "
                        "and reports (the scheduler places by it; both: prefill and decode here)")
    p.add_argument("--kv-transfer", default="off", choices=("nixl", "off"),
                   help="nixl: register the KV pool with NIXL (UCX) at start and meet peers over the KvPeer "
                        "RPC (worker/kv_transfer.py); off: no KV transfer (--engine sim has none)")
    p.add_argument("--engine", default="model", choices=("model", "sim"),
                   help="model: run --model; sim: simulate it (no model: step times from --sim-profile, "
                        "tokens from the seed and position; --model gives only the tokenizer)")
    p.add_argument("--sim-profile", default="llama-3-8b-h100",
                   help="--engine sim: a shipped profile name or a .toml/.json file (worker/sim_profiles)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--engine sim: simulated seconds per real second (inf: never sleep)")
    p.add_argument("--sim-wait", default="sleep", choices=("sleep", "spin"),
                   help="--engine sim: wait out a step's time asleep, or spinning (its CPU the model's), as a GPU "
                        "worker's thread spins in CUDA's synchronize: for machines with a core to spare a worker")
    p.add_argument("--count", type=int, default=1,
                   help="workers in this process, each with its own engine, port (--port + i when --port "
                        "is set) and id (--worker-id-i); --metrics-port serves the first one's metrics")
    add_cluster_tls_flags(p)
    add_door_flags(p, ("metrics",))
    add_common_flags(p)
    return p


class WorkerService(cluster_pb2_grpc.WorkerServicer):
    """Thin: convert, hand to the engine thread, answer."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Assign(self, request, context):
        parent = telemetry.extract_grpc(context)  # the scheduler's assign span
        resp = self._admit(request)
        if resp.accepted:
            self.w.migrations.drop_incoming([request.request_id])
            self.w.loop.call(lambda: self.w.loop.assign(request, parent))  # answered before the engine runs it
        return resp

    async def AssignBatch(self, request, context):
        return self._assign_batch(request, telemetry.extract_grpc(context))

    async def AssignStream(self, request_iterator, context):
        """The scheduler's Assigns as messages on one call: each answered in order (each
        request's trace context in its own traceparent)."""
        async for batch in request_iterator:
            yield self._assign_batch(batch, None)

    def _assign_batch(self, request, parent) -> cluster_pb2.AssignBatchResponse:
        responses = [self._admit(r) for r in request.requests]
        taken = [r for r, resp in zip(request.requests, responses, strict=True) if resp.accepted]
        if taken:  # one command for the engine thread: the whole batch between two steps
            self.w.migrations.drop_incoming([r.request_id for r in taken])
            self.w.loop.call(lambda: [self.w.loop.assign(r, parent) for r in taken])
        return cluster_pb2.AssignBatchResponse(responses=responses)

    def _admit(self, request) -> cluster_pb2.AssignResponse:
        """Whether this worker takes ``request`` (not while draining, nor from a replaced scheduler)."""
        if self.w.draining:
            return cluster_pb2.AssignResponse(accepted=False)
        if request.scheduler_epoch < self.w.scheduler_epoch:  # from a scheduler that was replaced
            log.warning("assign.stale_scheduler", request_id=request.request_id,
                        scheduler_epoch=request.scheduler_epoch, newest=self.w.scheduler_epoch)
            return cluster_pb2.AssignResponse(accepted=False, stale_scheduler=True)
        self.w.scheduler_epoch = request.scheduler_epoch
        return cluster_pb2.AssignResponse(accepted=True)

    async def Cancel(self, request, context):
        loop, rid = self.w.loop, request.request_id

        def cancel() -> cluster_pb2.WorkerCancelResponse:  # between two steps: the record is all it wrote
            record = loop.record_piece(rid) if request.want_record else b""
            return cluster_pb2.WorkerCancelResponse(found=loop.cancel(rid, request.notify_client), record=record)

        return await asyncio.wrap_future(loop.call(cancel))

    async def Preempt(self, request, context):
        fut = self.w.loop.call(lambda: self.w.loop.preempt(request.request_id, request.mode))
        return await asyncio.wrap_future(fut)

    async def StreamOccupancy(self, request, context):
        # An idle worker's reports are a heartbeat, ``interval_s`` apart; a busy one's snapshot
        # moves between reports (its requests' blocks grow), so it reports at least every 0.1 s.
        heartbeat = max(MIN_REPORT_INTERVAL_S, request.interval_s or REPORT_INTERVAL_S)
        refresh = min(REPORT_INTERVAL_S, heartbeat)
        # Finished requests from here on (earlier ones are acknowledged in Redis already),
        # and the prefix cache's keys: all of them first, then what changes.
        finished = self.w.loop.subscribe()
        kv_events = self.w.loop.kv_events.subscribe()
        holdings = Holdings() if request.deltas else None
        try:
            with self.w.changed.watch() as changed:
                # Ends by itself when the worker stops, so shutdown never cancels it mid-wait.
                snapshot = None
                while not self.w.stopped.is_set():
                    changed.clear()  # before the report: a change while it is sent makes the next one
                    idle, snapshot = self.w.loop.snapshot is snapshot, self.w.loop.snapshot
                    yield self.w.report(finished, kv_events, holdings)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), heartbeat if idle else refresh)
        finally:
            self.w.loop.unsubscribe(finished)
            self.w.loop.kv_events.unsubscribe(kv_events)

    async def KvPeer(self, request, context):
        t = self.w.kv_transport
        if t is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker runs without KV transfer (--kv-transfer off)")
        from .kv_transfer import handle_from_proto, handle_to_proto  # torch: not for --engine sim

        try:
            peer = t.connect(handle_from_proto(request))
        except ValueError as e:  # IncompatiblePeer included: refused before any request moves
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        path = t.transport_to(peer)
        self.w.migrations.peer_agents[request.worker_id] = peer
        self.w.metrics.kv_transfer_peers.labels(path=path).set(
            sum(t.transport_to(p) == path for p in t.peers))
        log.info("kv_transfer.peer", peer=request.worker_id, agent=peer, path=path)
        return handle_to_proto(t.handle(), self.w.worker_id, path)

    async def Migrate(self, request, context):
        return await self.w.migrations.migrate(request)

    async def MigrateBegin(self, request, context):
        return await self.w.migrations.begin(request)

    async def MigrateRead(self, request, context):
        return await self.w.migrations.read(request)

    async def MigratePoll(self, request, context):
        return self.w.migrations.poll(request)

    async def MigrateCommit(self, request, context):
        return await self.w.migrations.commit(request)

    async def MigrateAbort(self, request, context):
        return await self.w.migrations.abort(request)

    async def Drain(self, request, context):
        n = self.w.loop.num_requests
        self.w.begin_drain(request.timeout_s or None)
        return cluster_pb2.DrainResponse(num_requests=n)


class Worker:
    """``redis``: a client shared with other workers of this process (default: its own)."""

    def __init__(self, args, engine, *, worker_id: str | None = None, redis=None) -> None:
        self.args = args
        self.engine = engine
        self.keys = Keys(args.namespace, getattr(args, "shard", "s0"))
        self.worker_id = worker_id or args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.redis = redis if redis is not None else connect_args(args)
        self.metrics = WorkerMetrics()
        self.writer = OutputWriter(
            self.redis, self.keys, writer_id=self.worker_id,
            on_refused=lambda rid, epoch: self.loop.call(lambda: self.loop.drop(rid, epoch)),
            on_fenced=lambda discard: asyncio.wrap_future(self.loop.call(lambda: (self.loop.drop_all(), discard()))),
            on_failed=lambda rid, error: self.loop.call(lambda: self.loop.fail(rid, error)),
            live=lambda: self.loop.snapshot.request_ids,
        )
        self.metrics.output_writes.count(lambda: self.writer.num_round_trips)
        self.aio = asyncio.get_running_loop()
        self.changed = Changes()
        self.loop = EngineLoop(
            engine,
            emit=self.writer.put,  # from the engine thread straight to the writer's
            notify=lambda: self.aio.call_soon_threadsafe(self.changed.set),
            observer=WorkerObserver(self.worker_id, self.metrics, args.model),
            room=self.writer.has_room,
            idle=self.writer.idle,
        )
        self.metrics.observe_stats(self.loop.snapshot)  # the pool's size from the start, not from a first step
        self.scheduler_epoch = 0  # the newest scheduler epoch an Assign came with
        self.beat = 0
        self.draining = False
        self.report_seq = 0
        self.stopped = asyncio.Event()
        self.drain_timeout = args.drain_timeout
        self.address = ""
        self.kv_transport = None  # with --kv-transfer nixl: the pool registered (start_kv_transfer)
        self.kv_layout_key = ""  # its pool's KVLayout.key(): reported, so that KV moves only between equals
        self.migrations = Migrations(self)
        self.loop.track_prefilled = args.role == "prefill"

    def start_kv_transfer(self) -> None:
        """Register the KV pool with NIXL (once, at start); peers meet it over ``KvPeer``."""
        if self.args.kv_transfer == "off":
            return
        if self.args.engine == "sim":
            raise SystemExit("--kv-transfer nixl needs --engine model (a simulated engine has no KV pool)")
        from .kv_transfer import NixlTransport
        from .migration_rpc import LockedTransport

        transport = NixlTransport(self.args.model, agent_name=f"{self.worker_id}-{uuid.uuid4().hex[:6]}")
        transport.register(self.engine.kv_cache)
        self.kv_layout_key = transport.layout.key()
        self.kv_transport = LockedTransport(transport)  # the engine thread and the event loop share it

    async def progress_kv_transfer(self) -> None:
        """NIXL without its progress thread (it spins a core): progress it from this loop."""
        while not self.stopped.is_set():
            if self.kv_transport.peers:
                self.kv_transport.progress()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), 0.005)

    async def meet(self, address: str, channel=None) -> str:
        """Meet the worker at ``address`` for KV transfer (both sides connect); the path
        this worker's reads from it take. Raises ``grpc.RpcError`` (FAILED_PRECONDITION:
        the layouts differ) and changes nothing on refusal."""
        from .kv_transfer import handle_from_proto, handle_to_proto

        ch = channel or grpc.aio.insecure_channel(address)
        try:
            stub = cluster_pb2_grpc.WorkerStub(ch)
            answer = await stub.KvPeer(handle_to_proto(self.kv_transport.handle(), self.worker_id))
            peer = self.kv_transport.connect(handle_from_proto(answer))
            self.migrations.peer_agents[answer.worker_id] = peer
            return self.kv_transport.transport_to(peer)
        finally:
            if channel is None:
                await ch.close()

    def report(self, finished: collections.deque[str], kv_events: KVEventStream,
               holdings: Holdings | None = None) -> cluster_pb2.OccupancyReport:
        """The latest snapshot, with the requests that finished and the prefix cache's keys
        stored and evicted since the stream's previous report (``holdings``: the requests
        held, as changes since then)."""
        s = self.loop.snapshot
        ids = [finished.popleft() for _ in range(len(finished))]
        stored, evicted, reset = kv_events.take()
        self.report_seq += 1
        report = occupancy_report(
            s, worker_id=self.worker_id, seq=self.report_seq, finished_request_ids=ids,
            max_num_seqs=self.args.max_num_seqs, max_model_len=self.engine.max_model_len,
            draining=self.draining, stored_block_hashes=stored, evicted_block_hashes=evicted,
            block_hashes_reset=reset, holdings=holdings, role=self.args.role,
        )
        report.drain_by_migration = self.draining and self.drains_by_migration
        report.kv_layout = self.kv_layout_key
        if self.loop.track_prefilled:
            report.prefilled_request_ids.extend(self.loop.prefilled_ids)
        return report

    @property
    def drains_by_migration(self) -> bool:
        """``--drain-policy migrate`` with a KV transport to move the requests with."""
        return getattr(self.args, "drain_policy", "migrate") == "migrate" and self.kv_transport is not None

    def begin_drain(self, timeout_s: float | None = None) -> None:
        if not self.draining:
            self.draining = True
            self.changed.set()
            log.info("worker.draining", num_requests=self.loop.num_requests, by_migration=self.drains_by_migration)
            asyncio.ensure_future(self._drain(timeout_s or self.drain_timeout))

    async def _drain(self, timeout_s: float) -> None:
        num_held, num_migrated_before = self.loop.num_requests, self.migrations.num_migrated_out
        try:
            deadline = time.monotonic() + timeout_s
            # (A migration's answer goes out before the worker stops: the scheduler learns the handover from it.)
            while (self.loop.num_requests or self.migrations.num_in_flight) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            migrated = self.migrations.num_migrated_out - num_migrated_before
            recomputed = self.loop.num_requests
            finished = max(0, num_held - migrated - recomputed)
            for outcome, n in (("migrated", migrated), ("recomputed", recomputed), ("finished", finished)):
                self.metrics.drained_requests.labels(outcome=outcome).inc(n)
            log.info("worker.drained", num_requests=num_held, num_migrated=migrated, num_recomputed=recomputed,
                     num_finished=finished, by_migration=self.drains_by_migration)
            if self.loop.num_requests:
                log.info("worker.handing_back", num_requests=self.loop.num_requests)
                # Stop generating before the scheduler resumes them elsewhere: no token of
                # ours may land past the point the next worker resumes from. (Paused, not
                # aborted: they stay in our reports, so nobody takes them for finished.)
                await asyncio.wrap_future(self.loop.call(self.loop.pause))
            await asyncio.wait_for(self.writer.flush(), 10)
        except Exception:
            log.exception("worker.drain_failed")
        finally:
            self.stopped.set()
            self.changed.set()  # wake occupancy streams so they end before the server stops

    async def register(self) -> None:
        """Refresh this worker's row in ``<ns>:workers`` until stopped. A beat without a write
        probes the steps stream (a write would have found it fenced)."""
        num_writes = -1
        while not self.stopped.is_set():
            if self.writer.num_round_trips == num_writes and not self.draining:
                self.writer.probe()
            num_writes = self.writer.num_round_trips
            # ``beat`` changes every time: the scheduler times rows by when it last saw it change.
            self.beat += 1
            row = json.dumps({"address": self.address, "beat": self.beat, "pid": os.getpid(),
                              "ts_ms": int(time.time() * 1000), "steps": self.writer.fencing.steps_key,
                              "role": self.args.role, "model": self.args.served_model_name or self.args.model})
            if not self.draining:
                try:
                    await retry(lambda r=row: self.redis.hset(self.keys.workers, self.worker_id, r), what="register")
                except Exception as e:  # noqa: BLE001 - the heartbeat must outlive any one refusal
                    # A reply that is not a connection error (a Redis refusing writes, its keys
                    # evicted) ended this task silently: the row went stale, the scheduler dropped
                    # the worker, and it never came back. Said, and beaten again next time.
                    log.error("worker.register_failed", worker_id=self.worker_id, error=f"{type(e).__name__}: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), REGISTER_INTERVAL_S)


def make_engine(args):
    """One engine as the flags say: the model, or a simulated one (``--engine sim``)."""
    common = dict(
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=args.seed,
        num_swap_blocks=args.num_swap_blocks, preemption=args.preemption,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    if args.engine == "sim":
        from pagefleet.worker.sim import SimEngine

        return SimEngine(args.sim_profile, args.model, time_scale=args.time_scale, wait=args.sim_wait, **common)
    from pagefleet.worker.engine import Engine

    return Engine(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
                  load_format=args.load_format, **common)


def worker_ids(args) -> list[str]:
    """``--count`` ids: ``--worker-id`` (default host-pid) alone, or with ``-<i>`` for several."""
    base = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    return [base] if args.count == 1 else [f"{base}-{i}" for i in range(args.count)]


async def serve(args) -> int:
    """``--count`` workers in this process, each with its own engine (and engine thread), port,
    registration and report stream; one Redis client for all of them."""
    engines = await asyncio.to_thread(lambda: [make_engine(args) for _ in range(args.count)])
    redis = connect_args(args)
    workers = [Worker(args, e, worker_id=wid, redis=redis) for e, wid in zip(engines, worker_ids(args), strict=True)]
    tls = cluster_tls(args)
    metrics_tls = tls.server_context(verify_clients=not open_to_all(args, "metrics")) if tls else None
    # Every sample labelled with the model and shard; with --count, each worker's with its id too.
    parts = [(w.metrics.registry, {"worker": w.worker_id} if len(workers) > 1 else {}) for w in workers]
    registry = with_labels(parts, model=args.served_model_name or args.model, shard=args.shard)
    serve_metrics(args, registry, "worker", tls=metrics_tls)
    await retry(redis.ping, what="ping")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [w.begin_drain() for w in workers])
    ports = [args.port + i if args.port else 0 for i in range(args.count)]
    health_ports = [args.health_port + i if args.health_port else args.health_port for i in range(args.count)]
    await asyncio.gather(*(run_worker(w, args, port, health_port)
                           for w, port, health_port in zip(workers, ports, health_ports, strict=True)))
    await redis.aclose()
    return 0


async def run_worker(w: Worker, args, port: int, health_port: int | None = None) -> None:
    """Serve ``w`` on ``port`` (0: any free port) until it has drained; with ``--cluster-*``
    only to peers whose certificate the cluster CA signed (the scheduler's)."""
    engine = w.engine
    server = grpc.aio.server(options=SERVER_OPTIONS)
    cluster_pb2_grpc.add_WorkerServicer_to_server(WorkerService(w), server)
    health, names, _ = add_health_and_reflection(server, [SERVICE])
    port = add_port(server, f"{args.host}:{port}", cluster_tls(args))
    host = args.advertise_host or (socket.gethostname() if args.host in ("0.0.0.0", "[::]") else args.host)
    w.address = f"{host}:{port}"
    structlog.contextvars.bind_contextvars(worker_id=w.worker_id)  # this task and those it starts
    await server.start()
    health_server = await start_health_port(health, args.host, health_port)
    w.start_kv_transfer()
    w.loop.start()
    await w.writer.fencing.publish_stream()  # before any write: the scheduler must find it to fence it
    writer_task = asyncio.create_task(w.writer.run())
    register_task = asyncio.create_task(w.register())
    kv_task = asyncio.create_task(w.progress_kv_transfer()) if w.kv_transport is not None else None
    await set_serving(health, names, True)
    freeze_startup_heap()
    log.info("worker.ready", address=w.address, model=args.model, num_blocks=engine.kv.num_blocks,
             block_size=engine.block_size, device=str(engine.device),
             cuda_graph_sizes=engine.executor.graph_sizes,
             kernel_warm_up_s=round(getattr(engine.executor, "warm_up_seconds", 0.0), 2))
    await w.stopped.wait()
    await set_serving(health, names, False)
    await retry(lambda: w.redis.hdel(w.keys.workers, w.worker_id), what="unregister", attempts=3)
    if health_server is not None:
        await health_server.stop(grace=0)
    await server.stop(grace=0.5)
    w.loop.stop()
    await w.migrations.close()
    for t in (writer_task, register_task, kv_task):
        if t is not None:
            t.cancel()
    log.info("worker.stopped")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    if args.engine != "sim" and (args.time_scale != 1.0 or "--sim-profile" in argv or args.sim_wait != "sleep"):
        parser.error("--sim-profile, --time-scale and --sim-wait need --engine sim")
    if not args.time_scale > 0:
        parser.error(f"--time-scale must be > 0 (inf: never sleep), got {args.time_scale}")
    try:
        check_shard(args.shard)
    except ValueError as e:
        parser.error(f"--shard: {e}")
    try:
        check_files(cluster_tls(args))
    except ValueError as e:
        parser.error(str(e))
    setup_logging("worker", args)
    # The engine thread holds the GIL through long stretches of Python between torch ops;
    # handing it over every 0.5 ms (not the default 5 ms) lets the event loop write tokens
    # and answer RPCs promptly (measured: ~10 % more cluster throughput, lower TTFT).
    sys.setswitchinterval(0.0005)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:  # Ctrl-C before its handlers were installed (e.g. while Redis is awaited)
        return 130
