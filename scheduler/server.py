"""``pagefleet scheduler``: the lease, the ``pagefleet.v1.Scheduler`` view, health.

Only the holder of the Redis lease (``<ns>:scheduler:lease``) schedules; a second
instance waits as a standby (health NOT_SERVING) and takes over when the lease expires.
Each holder takes a new scheduler epoch (``<ns>:scheduler:epoch``), which fences every
assignment it makes. An instance that loses its lease, or cannot renew it within two
thirds of its length by its own monotonic clock (cut off from Redis: it cannot know), stops
placing at once and exits, before the lease can lapse; so two never place requests at once.

With ``--cluster-ca``, ``--cluster-cert`` and ``--cluster-key`` (common/tls.py) it dials workers
over mutual TLS, trusting only those whose certificate chains to the cluster CA and names
``--worker-tls-name``, and its own view and metrics answer only peers with such a certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid

import grpc
import structlog

from pagefleet.common.metrics import SchedulerMetrics, serve_metrics, with_labels
from pagefleet.common.redis import (
    Keys,
    add_redis_flags,
    add_shard_flag,
    check_shard,
    connect_args,
    retry,
)
from pagefleet.common.scripts import LEASE_RELEASE, LEASE_RENEW, TAKE_EPOCH
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
from pagefleet.common.tls import (
    WORKER_TLS_NAME,
    add_cluster_tls_flags,
    add_port,
    check_files,
    cluster_tls,
    dialer,
)
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .core import ClusterScheduler, SchedulerConfig, StaleScheduler
from .moves import MoveConfig
from .placement import PLACEMENTS, PlacementConfig
from .prefix_index import DEFAULT_MAX_KEYS
from .queue import POLICIES

SERVICE = "pagefleet.v1.Scheduler"
log = structlog.get_logger("scheduler")

def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet scheduler", description="Run the scheduler (one active, others standby).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port of the Scheduler service and health (0: any free)")
    add_redis_flags(p)
    add_shard_flag(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model this shard serves: the `model` label of this scheduler's metrics")
    p.add_argument("--policy", default="fcfs", choices=POLICIES, help="global queue order")
    p.add_argument("--aging-seconds", type=float, default=10.0,
                   help="priority policy: a waiting request gains one priority level per this many seconds")
    p.add_argument("--headroom-tokens", type=int, default=64,
                   help="expected output tokens a worker must have room for beyond the prompt")
    p.add_argument("--preempt-mode", default="auto", choices=("auto", "swap", "recompute", "off"),
                   help="directed preemption for higher-priority requests")
    p.add_argument("--dead-after", type=float, default=2.0, help="seconds without a report before a worker is dead")
    p.add_argument("--report-interval", type=float, default=None,
                   help="seconds between an idle worker's occupancy reports, its heartbeat (a busy worker "
                        "reports every 0.1 s, any worker at once when its requests, free blocks or prefilled "
                        "requests change); at most half of --dead-after (default: an eighth of it, at most 0.5)")
    p.add_argument("--lease-ms", type=int, default=3000, help="scheduler lease; a standby takes over after it lapses")
    d = PlacementConfig()
    p.add_argument("--placement", default=d.policy, choices=PLACEMENTS,
                   help="which worker gets a request: prefix (where its prompt's blocks are cached, unless "
                        "the workers are out of balance), least-loaded, or round-robin")
    p.add_argument("--prefix-index-size", type=int, default=DEFAULT_MAX_KEYS,
                   help="most cached block keys the prefix index keeps (least recently stored go first)")
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="prefix: out of balance when the busiest worker has more than this many requests "
                        "beyond the idlest ...")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and more than this many times the idlest's; then the least loaded wins")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="prefix: the longest cached prefix wins if it covers at least this fraction of "
                        "the prompt's blocks, else the least loaded")
    add_cluster_tls_flags(p)
    m = MoveConfig()
    p.add_argument("--migrate-above", type=float, default=None, metavar="OCCUPANCY",
                   help="load balance by live migration: a worker whose KV occupancy (0-1) is past this sheds "
                        "a running request with its KV to the emptiest worker (default: off)")
    p.add_argument("--migrate-below", type=float, default=None, metavar="OCCUPANCY",
                   help="--migrate-above: the target's occupancy after taking the request must stay below this "
                        f"(default: {m.migrate_below}, or --migrate-above where that is lower)")
    p.add_argument("--migrate-victims", action="store_true",
                   help="a preemption victim moves with its KV to a worker that can hold it, instead of being "
                        "swapped out or recomputed")
    p.add_argument("--transfer-timeout", type=float, default=m.timeout_s, metavar="SECONDS",
                   help="a KV transfer's lease: renewed while its Migrate call is in flight; past it the transfer "
                        "is taken back from both sides and the request resumes from its tokens")
    p.add_argument("--short-prompt-tokens", type=int, default=m.short_prompt_tokens,
                   help="prefill/decode disaggregation: prompts this short prefill on a decode worker")
    p.add_argument("--decode-cache-threshold", type=float, default=m.decode_cache_threshold,
                   help="disaggregation: a prompt a decode worker caches this share of prefills there")
    p.add_argument("--prefill-queue-tokens", type=int, default=m.prefill_queue_tokens,
                   help="disaggregation: a prefill worker with this many prompt tokens still to prefill takes no "
                        "more (they prefill on a decode worker)")
    p.add_argument("--worker-tls-name", default=WORKER_TLS_NAME, metavar="NAME",
                   help="with --cluster-ca: the name a worker's certificate must carry (empty: the host "
                        "of the address the worker advertises)")
    add_door_flags(p, ("metrics",))
    add_common_flags(p)
    return p


class SchedulerService(cluster_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.core: ClusterScheduler | None = None

    async def GetState(self, request, context):
        if self.core is None:
            return cluster_pb2.SchedulerState(active=False)
        return self.core.state()


class Lease:
    """The scheduler lease, held by this instance once ``acquired`` is set.

    ``valid()`` is true while the last successful renewal, timed from before it was sent,
    is less than ``SAFE_FRACTION`` of the lease ago on this process's monotonic clock: past
    that, Redis may let the lease lapse any moment, so the holder stops placing
    (``lease_unsure``). A later renewal that succeeds proves the lease never lapsed (the
    renew script extends it only while it still names this holder, and nobody can take it
    without its lapsing first), so placing resumes: a stall of the process (a loaded
    machine, a long collection) costs a pause, not the scheduler. The lease is given up for
    good once Redis says another holds it or it has lapsed (``lease_lost``), or a whole lease
    has passed without a renewal (``lease_lapsed``: it has surely lapsed in Redis too); the
    process then stands by again.
    ``hold`` returns which: ``"taken"`` (another holds it), ``"free"`` (it lapsed, and nobody
    holds it: the process stood still longer than a lease, and Redis answers again) or
    ``"lapsed"``.
    """

    SAFE_FRACTION = 2 / 3

    def __init__(self, redis, keys: Keys, me: str, lease_ms: int) -> None:
        self.redis, self.keys, self.me = redis, keys, me
        self.lease_s = lease_ms / 1000
        self.lease_ms = lease_ms
        self.epoch = 0
        self._renewed_at = float("-inf")

    def valid(self) -> bool:
        return time.monotonic() - self._renewed_at < self.lease_s * self.SAFE_FRACTION

    async def hold(self, acquired: asyncio.Event) -> str:
        """Take the lease (waiting as standby while another holds it), then keep it; return
        when it is lost or can no longer be trusted, saying why (see the class)."""
        sent = 0.0

        async def take():
            nonlocal sent
            sent = time.monotonic()  # this attempt's: not the first of retries through a Redis outage
            return await self.redis.set(self.keys.lease, self.me, nx=True, px=self.lease_ms)

        while True:
            if await retry(take, what="lease"):
                self._renewed_at = sent
                break
            await asyncio.sleep(self.lease_s / 6)
        self.epoch = int(await retry(lambda: self.redis.eval(TAKE_EPOCH, 1, self.keys.scheduler_epoch), what="epoch"))
        acquired.set()
        log.info("scheduler.lease_acquired", instance=self.me, epoch=self.epoch)
        unsure = False
        while True:
            await asyncio.sleep(self.lease_s / 6)
            sent = time.monotonic()
            try:
                held = await asyncio.wait_for(
                    self.redis.eval(LEASE_RENEW, 1, self.keys.lease, self.me, self.lease_ms), self.lease_s / 6)
            except Exception as e:  # cut off or slow: keep trying while the lease may still be ours
                log.warning("scheduler.lease_renew_failed", error=repr(e))
                held = None
            if held == 0:
                with contextlib.suppress(Exception):
                    holder = await asyncio.wait_for(self.redis.get(self.keys.lease), self.lease_s / 6)
                    if holder is None:
                        log.error("scheduler.lease_lost", instance=self.me, holder=None)
                        return "free"
                log.error("scheduler.lease_lost", instance=self.me)
                return "taken"
            if held:
                self._renewed_at = sent
                if unsure:
                    unsure = False
                    log.warning("scheduler.lease_renewed", instance=self.me)
            since = time.monotonic() - self._renewed_at
            if not self.valid() and not unsure:
                unsure = True
                log.error("scheduler.lease_unsure", instance=self.me, since_renewal_s=round(since, 3))
            if since >= self.lease_s:
                log.error("scheduler.lease_lapsed", instance=self.me, since_renewal_s=round(since, 3))
                return "lapsed"


async def _warn_if_redis_evicts(redis) -> None:
    """Say so when Redis may evict keys: the cluster's keys are its state (a request's entry,
    its owner record, the lease), and one evicted is lost work or a fence gone. The deploy
    files set ``maxmemory-policy noeviction``; a Redis that hides CONFIG is taken on trust."""
    try:
        policy = (await redis.config_get("maxmemory-policy")).get("maxmemory-policy")
    except Exception:  # noqa: BLE001 - a managed Redis without CONFIG, a cluster client: not ours to check
        return
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy and policy != "noeviction":
        log.warning("redis.evicts", maxmemory_policy=policy,
                    hint="set maxmemory-policy noeviction: an evicted key is a request lost or resumed")


async def serve(args) -> int:
    keys = Keys(args.namespace, args.shard)
    redis = connect_args(args)
    tls = cluster_tls(args)
    me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    servicer = SchedulerService()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    cluster_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health, names, _ = add_health_and_reflection(server, [SERVICE])
    port = add_port(server, f"{args.host}:{args.port}", tls)
    metrics = SchedulerMetrics()
    serve_metrics(args, with_labels(metrics.registry, model=args.served_model_name, shard=args.shard), "scheduler",
                  tls=tls.server_context(verify_clients=not open_to_all(args, "metrics")) if tls else None)
    await server.start()
    health_port = await start_health_port(health, args.host, args.health_port)
    await set_serving(health, names, False)
    log.info("scheduler.standby", port=port, instance=me)
    await _warn_if_redis_evicts(redis)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    rc = 0
    stale_in_a_row = 0  # stand-bys in a row because another's epoch fenced this one
    while True:  # a scheduler whose lease lapsed unclaimed (it stood still) stands by again
        acquired = asyncio.Event()
        holder = Lease(redis, keys, me, args.lease_ms)
        lease = asyncio.create_task(holder.hold(acquired))
        taking = asyncio.create_task(acquired.wait())
        await asyncio.wait([lease, taking, stopping], return_when=asyncio.FIRST_COMPLETED)
        taking.cancel()
        if not acquired.is_set() and lease.done() and not stop.is_set():
            # Taking the lease failed for good (an error no retry mends: a MOVED reply from a
            # Redis Cluster this scheduler was not told of, a script refused): said, and exit 1
            # so a supervisor sees it, not a quiet stop.
            error = None if lease.cancelled() else lease.exception()
            log.error("scheduler.lease_failed", error=repr(error), exc_info=error)
            rc = 1
        if not acquired.is_set() or stop.is_set():
            break
        core = ClusterScheduler(redis, keys, SchedulerConfig(
            policy=args.policy, aging_s=args.aging_seconds, headroom_tokens=args.headroom_tokens,
            preempt_mode=args.preempt_mode, dead_after_s=args.dead_after, report_interval_s=args.report_interval,
            placement=placement_config(args),
            prefix_index_size=args.prefix_index_size, moves=move_config(args), model=args.served_model_name,
        ), metrics=metrics, epoch=holder.epoch, lease_ok=holder.valid,
            dial=dialer(tls, args.worker_tls_name or None))
        servicer.core = core
        run = asyncio.create_task(core.run())
        await set_serving(health, names, True)
        freeze_startup_heap()
        log.info("scheduler.active", port=port, policy=args.policy, placement=args.placement)
        done, _ = await asyncio.wait([run, lease, stopping], return_when=asyncio.FIRST_COMPLETED)
        # Another scheduler's epoch fenced this one's writes before its own lease task noticed
        # the lease gone (it stalled past its lease, and a standby took over): as a lost lease.
        stale = run in done and not run.cancelled() and isinstance(run.exception(), StaleScheduler)
        if lease in done or run in done:
            rc = 1
            if run in done and not run.cancelled() and run.exception() is not None and not stale:
                log.error("scheduler.failed", error=repr(run.exception()), exc_info=run.exception())
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run
        servicer.core = None
        # Give the lease up at once so a standby need not wait for it to lapse.
        if rc == 0:
            with contextlib.suppress(Exception):
                await redis.eval(LEASE_RELEASE, 1, keys.lease, me)
            break
        if (lease in done and run not in done or stale) and not stop.is_set():
            # The lease is gone (lapsed unclaimed, taken by a standby, or not renewed for a whole
            # lease: Redis away, a primary failing over): everything this scheduler placed was
            # fenced by its epoch, and a new one comes with the lease. Stand by, as a standby
            # does, and start again from Redis if it comes back to this one; exiting left a
            # cluster with one scheduler a shard without any (and `up` stopped everything).
            await set_serving(health, names, False)
            if stale:
                lease.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await lease
                # Still named by the lease (a takeover that had not taken it yet): let it go, so
                # no scheduler waits for it to lapse (compare-and-delete: only if it is ours).
                with contextlib.suppress(Exception):
                    await redis.eval(LEASE_RELEASE, 1, keys.lease, me)
                why = f"another scheduler fenced this one: {run.exception()}"
                stale_in_a_row += 1
                if stale_in_a_row >= 3:  # no takeover does that: something else moves the epoch
                    log.error("scheduler.fenced_again", times=stale_in_a_row, error=repr(run.exception()))
            else:
                stale_in_a_row = 0
                after = lease.exception() if not lease.cancelled() else None
                why = f"the lease was {lease.result() if after is None else repr(after)}"
            log.warning("scheduler.standby", port=port, instance=me, after=why)
            rc = 0
            continue
        break
    for t in (lease, stopping):
        t.cancel()
    await set_serving(health, names, False)
    if health_port is not None:
        await health_port.stop(grace=0)
    await server.stop(grace=0.5)
    await redis.aclose()
    log.info("scheduler.stopped")
    return rc


def placement_config(args) -> PlacementConfig:
    return PlacementConfig(args.placement, args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold)


def _migrate_below(args) -> float:
    """``--migrate-below``, else its default, no higher than ``--migrate-above`` (``--migrate-above
    0.5`` alone was refused: the default 0.7 was above it)."""
    if args.migrate_below is not None:
        return args.migrate_below
    default = MoveConfig().migrate_below
    return default if args.migrate_above is None else min(default, args.migrate_above)


def move_config(args) -> MoveConfig:
    """The KV moves the flags ask for; ``ValueError`` naming what to fix."""
    try:
        return MoveConfig(short_prompt_tokens=args.short_prompt_tokens, decode_cache_threshold=args.decode_cache_threshold,
                          prefill_queue_tokens=args.prefill_queue_tokens, migrate_above=args.migrate_above,
                          migrate_below=_migrate_below(args), migrate_victims=args.migrate_victims,
                          timeout_s=args.transfer_timeout)
    except ValueError as e:
        raise ValueError(f"--migrate-above/--migrate-below/--transfer-timeout/--short-prompt-tokens/"
                         f"--decode-cache-threshold/--prefill-queue-tokens: {e}") from None


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        placement_config(args)
        move_config(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        check_shard(args.shard)
    except ValueError as e:
        parser.error(f"--shard: {e}")
    if args.prefix_index_size < 1:
        parser.error(f"--prefix-index-size must be at least 1, got {args.prefix_index_size}")
    if not args.dead_after > 0:
        parser.error(f"--dead-after must be above 0, got {args.dead_after}")
    if args.report_interval is not None and not 0 < args.report_interval <= args.dead_after / 2:
        parser.error(f"--report-interval must be above 0 and at most half of --dead-after ({args.dead_after}), "
                     f"got {args.report_interval}")
    try:
        check_files(cluster_tls(args))
    except ValueError as e:
        parser.error(str(e))
    setup_logging("scheduler", args)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:  # Ctrl-C before its handlers were installed (e.g. while Redis is awaited)
        return 130
