"""``pagefleet scheduler``: the lease, the ``pagefleet.v1.Scheduler`` view, health.

Only the holder of the Redis lease (``<ns>:scheduler:lease``) schedules; a second
instance waits as a standby (health NOT_SERVING) and takes over when the lease expires.
An instance that loses its lease exits, so two never place requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid

import grpc
import structlog

from pagefleet.common.metrics import SchedulerMetrics, serve_metrics
from pagefleet.common.redis import Keys, connect, retry
from pagefleet.common.service import (
    SERVER_OPTIONS,
    EnvArgumentParser,
    add_common_flags,
    add_health_and_reflection,
    set_serving,
    setup_logging,
)
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .core import ClusterScheduler, SchedulerConfig
from .queue import POLICIES

SERVICE = "pagefleet.v1.Scheduler"
log = structlog.get_logger("scheduler")

# Renew if still ours; 1 when renewed, 0 when someone else holds it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pagefleet scheduler", description="Run the scheduler (one active, others standby).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port of the Scheduler service and health (0: any free)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to use")
    p.add_argument("--namespace", default="pf", help="prefix of every Redis key")
    p.add_argument("--policy", default="fcfs", choices=POLICIES, help="global queue order")
    p.add_argument("--aging-seconds", type=float, default=10.0,
                   help="priority policy: a waiting request gains one priority level per this many seconds")
    p.add_argument("--headroom-tokens", type=int, default=64,
                   help="expected output tokens a worker must have room for beyond the prompt")
    p.add_argument("--preempt-mode", default="auto", choices=("auto", "swap", "recompute", "off"),
                   help="directed preemption for higher-priority requests")
    p.add_argument("--dead-after", type=float, default=2.0, help="seconds without a report before a worker is dead")
    p.add_argument("--lease-ms", type=int, default=3000, help="scheduler lease; a standby takes over after it lapses")
    add_common_flags(p)
    return p


class SchedulerService(cluster_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.core: ClusterScheduler | None = None

    async def GetState(self, request, context):
        if self.core is None:
            return cluster_pb2.SchedulerState(active=False)
        return self.core.state()


async def hold_lease(redis, keys: Keys, me: str, lease_ms: int, acquired: asyncio.Event) -> None:
    """Take the lease (waiting as standby while another holds it), then keep it; return if lost."""
    while not await retry(lambda: redis.set(keys.lease, me, nx=True, px=lease_ms), what="lease"):
        await asyncio.sleep(lease_ms / 6000)
    acquired.set()
    log.info("scheduler.lease_acquired", instance=me)
    while True:
        await asyncio.sleep(lease_ms / 3000)
        if not await retry(lambda: redis.eval(_RENEW, 1, keys.lease, me, lease_ms), what="lease_renew"):
            log.error("scheduler.lease_lost", instance=me)
            return


async def serve(args) -> int:
    keys = Keys(args.namespace)
    redis = connect(args.redis_url)
    me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    servicer = SchedulerService()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    cluster_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health, names, _ = add_health_and_reflection(server, [SERVICE])
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    metrics = SchedulerMetrics()
    serve_metrics(args, metrics.registry, "scheduler")
    await server.start()
    await set_serving(health, names, False)
    log.info("scheduler.standby", port=port, instance=me)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    acquired = asyncio.Event()
    lease = asyncio.create_task(hold_lease(redis, keys, me, args.lease_ms, acquired))
    waiters = [asyncio.create_task(acquired.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait([lease, *waiters], return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if acquired.is_set() and not stop.is_set():
        core = ClusterScheduler(redis, keys, SchedulerConfig(
            policy=args.policy, aging_s=args.aging_seconds, headroom_tokens=args.headroom_tokens,
            preempt_mode=args.preempt_mode, dead_after_s=args.dead_after,
        ), metrics=metrics)
        servicer.core = core
        run = asyncio.create_task(core.run())
        await set_serving(health, names, True)
        log.info("scheduler.active", port=port, policy=args.policy)
        done, _ = await asyncio.wait([run, lease, waiters[1]], return_when=asyncio.FIRST_COMPLETED)
        if lease in done or run in done:
            rc = 1
            if run in done and run.exception() is not None:
                log.error("scheduler.failed", error=repr(run.exception()))
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run
        # Give the lease up at once so a standby need not wait for it to lapse.
        if rc == 0:
            with contextlib.suppress(Exception):
                await redis.eval("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
                                 1, keys.lease, me)
    for t in (lease, *waiters):
        t.cancel()
    await set_serving(health, names, False)
    await server.stop(grace=0.5)
    await redis.aclose()
    log.info("scheduler.stopped")
    return rc


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("scheduler", args)
    return asyncio.run(serve(args))
