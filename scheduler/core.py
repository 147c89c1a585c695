"""The active scheduler: reads requests from Redis, places them on workers, keeps them alive.

Tasks, all on one event loop:

* ``_intake``: ``XREADGROUP`` on the requests stream; generate entries join the global
  queue, cancel entries withdraw a request wherever it is.
* ``_discover``: reads the workers' rows in Redis and opens each new worker's occupancy
  stream (``_watch``); a broken stream or ``dead_after_s`` without a report marks the
  worker dead and its requests are resumed elsewhere from the tokens they emitted.
* ``_dispatch``: woken by every arrival and report; places the queue's head where it
  fits (``workers.pick_worker``), or preempts lower-priority sequences for it
  (``workers.pick_victims``); head-of-line, so no request is overtaken forever.

A request is acknowledged in Redis when it finishes (by its worker, in the same round trip
as its last tokens) or when the scheduler finishes it (cancelled while waiting, deadline
passed). On takeover the pending entries are read again: those a worker reports holding
are adopted, the others resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass

import grpc
import structlog

from pagefleet.common.metrics import SchedulerMetrics
from pagefleet.common.redis import GROUP, OUT_TTL_DONE_S, Keys, OutEntry, read_emitted, retry
from pagefleet.common.service import CHANNEL_OPTIONS
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .observe import assign_span
from .queue import GlobalQueue, Pending
from .workers import WorkerEntry, pick_victims, pick_worker

log = structlog.get_logger("scheduler")

CONSUMER = "scheduler"  # one active scheduler: the lease makes the consumer name unique
PREEMPT_MODES = {
    "auto": cluster_pb2.PREEMPT_MODE_AUTO,
    "swap": cluster_pb2.PREEMPT_MODE_SWAP,
    "recompute": cluster_pb2.PREEMPT_MODE_RECOMPUTE,
}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "fcfs"
    aging_s: float = 10.0
    headroom_tokens: int = 64
    preempt_mode: str = "auto"  # auto | swap | recompute | off
    dead_after_s: float = 2.0
    worker_ttl_s: float = 5.0
    rpc_timeout_s: float = 5.0
    adopt_wait_s: float = 2.0


class ClusterScheduler:
    def __init__(self, redis, keys: Keys, config: SchedulerConfig, metrics: SchedulerMetrics | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.cfg = config
        self.queue = GlobalQueue(config.policy, config.aging_s)
        self.workers: dict[str, WorkerEntry] = {}
        self.known: dict[str, Pending] = {}  # every unfinished request: queued or placed
        self.where: dict[str, str] = {}  # request_id -> worker_id
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._adopting = True
        self.num_preemptions = 0
        self.num_reassigned = 0
        self._published_waiting = -1
        self._published_at = 0.0
        self._tasks: list[asyncio.Task] = []
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.metrics.bind(self)

    # -- life ------------------------------------------------------------------------------
    async def run(self) -> None:
        await self._ensure_group()
        self._tasks = [asyncio.create_task(self._discover(), name="discover")]
        await self._adopt()
        self._tasks += [
            asyncio.create_task(self._intake(), name="intake"),
            asyncio.create_task(self._dispatch(), name="dispatch"),
            asyncio.create_task(self._tick(), name="tick"),
        ]
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for w in self.workers.values():
            if w.channel is not None:
                await w.channel.close()

    async def _ensure_group(self) -> None:
        import redis.exceptions as rx

        try:
            await retry(lambda: self.redis.xgroup_create(self.keys.requests, GROUP, id="0", mkstream=True),
                        what="xgroup_create")
        except rx.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- takeover ---------------------------------------------------------------------------
    async def _adopt(self) -> None:
        """Wait for the workers' first reports, then re-read our pending entries."""
        deadline = time.monotonic() + self.cfg.adopt_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if self.workers and all(w.report is not None for w in self.workers.values()):
                break
        holders = {rid: w for w in self.workers.values() if w.report for rid in w.report.request_ids}
        start = "0"
        while True:
            resp = await retry(lambda s=start: self.redis.xreadgroup(
                GROUP, CONSUMER, {self.keys.requests: s}, count=512), what="xreadgroup_pending")
            entries = resp[0][1] if resp else []
            if not entries:
                break
            for entry_id, fields in entries:
                await self._on_entry(entry_id, fields, holders)
            start = entries[-1][0]
        self._adopting = False
        log.info("scheduler.adopted", num_placed=len(self.where), num_waiting=len(self.queue),
                 workers=sorted(self.workers))
        self._wake.set()

    # -- intake ------------------------------------------------------------------------------
    async def _intake(self) -> None:
        while True:
            resp = await retry(lambda: self.redis.xreadgroup(
                GROUP, CONSUMER, {self.keys.requests: ">"}, count=256, block=1000), what="xreadgroup")
            for _, entries in resp or ():
                for entry_id, fields in entries:
                    await self._on_entry(entry_id, fields, None)
            self._wake.set()

    async def _on_entry(self, entry_id, fields: dict, holders: dict[str, WorkerEntry] | None) -> None:
        """One entry of the requests stream; ``holders`` (takeover only): request id -> the
        worker whose report lists it."""
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        kind = fields.get(b"kind", b"").decode()
        rid = fields.get(b"rid", b"").decode()
        if kind == "cancel":
            await self._cancel(rid)
            await self._ack(entry_id)
            return
        if kind != "generate" or rid in self.known:
            if rid not in self.known:
                log.warning("entry.malformed", entry_id=entry_id)
            await self._ack(entry_id)
            return
        try:
            msg = cluster_pb2.AssignRequest.FromString(fields[b"payload"])
        except Exception:  # not ours to run, and it must not stop the scheduler (now or after restarts)
            log.warning("entry.malformed", entry_id=entry_id, request_id=rid)
            await self._ack(entry_id)
            return
        msg.entry_id = entry_id
        p = Pending(rid, entry_id, msg, next(self._seq))
        self.known[rid] = p
        if holders is not None and rid in holders:  # takeover: a worker already runs it
            w = holders[rid]
            w.place(p, self.cfg.headroom_tokens)
            w.placed[rid].reflected = True
            self.where[rid] = w.worker_id
        elif holders is not None:  # takeover: it may have run somewhere; resume from its output
            await self._requeue(p)
        else:
            self.queue.push(p)

    async def _requeue(self, p: Pending) -> None:
        """Queue ``p`` again to resume after the tokens it emitted (read from Redis)."""
        emitted, finish = await read_emitted(self.redis, self.keys, p.request_id)
        if finish:
            self.known.pop(p.request_id, None)
            await self._ack(p.entry_id)
            return
        del p.assign.output_token_ids[:]
        p.assign.output_token_ids.extend(emitted)
        if p.num_remaining_tokens == 0:  # every token is out but the last message never was
            await self._finish(p, "length", "")
            return
        self.queue.push(p)
        self._wake.set()

    async def _cancel(self, rid: str) -> None:
        p = self.queue.remove(rid)
        if p is not None:
            await self._finish(p, "abort", "")
            return
        wid = self.where.get(rid)
        w = self.workers.get(wid) if wid else None
        if w is not None and w.stub is not None:
            with contextlib.suppress(grpc.RpcError):
                await w.stub.Cancel(cluster_pb2.WorkerCancelRequest(request_id=rid, notify_client=True),
                                    timeout=self.cfg.rpc_timeout_s)
            log.info("request.cancel_sent", request_id=rid, worker_id=wid)

    async def _finish(self, p: Pending, reason: str, error: str) -> None:
        """Finish a request the scheduler holds (it never reached a worker, or cannot)."""
        self.known.pop(p.request_id, None)
        self.where.pop(p.request_id, None)
        entry = OutEntry(len(p.assign.output_token_ids), [], "", reason, error)
        key = self.keys.out(p.request_id)

        async def write():
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(key, entry.encode())
            pipe.expire(key, OUT_TTL_DONE_S)
            pipe.xack(self.keys.requests, GROUP, p.entry_id)
            pipe.xdel(self.keys.requests, p.entry_id)
            await pipe.execute()

        await retry(write, what="finish")
        log.info("request.finished_by_scheduler", request_id=p.request_id, finish_reason=reason, error=error)

    async def _ack(self, entry_id: str) -> None:
        async def ack():
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(self.keys.requests, GROUP, entry_id)
            pipe.xdel(self.keys.requests, entry_id)
            await pipe.execute()

        await retry(ack, what="ack")

    # -- workers -------------------------------------------------------------------------------
    async def _discover(self) -> None:
        while True:
            rows = await retry(lambda: self.redis.hgetall(self.keys.workers), what="hgetall_workers")
            now_ms = time.time() * 1000
            for raw_id, raw in rows.items():
                wid = raw_id.decode()
                row = json.loads(raw)
                if now_ms - row["ts_ms"] > self.cfg.worker_ttl_s * 1000:
                    await retry(lambda w=wid: self.redis.hdel(self.keys.workers, w), what="hdel_worker")
                    continue
                w = self.workers.get(wid)
                if w is None or w.address != row["address"]:
                    if w is not None:
                        await self._worker_dead(w, "address changed")
                    self._add_worker(wid, row["address"])
            await asyncio.sleep(0.5)

    def _add_worker(self, wid: str, address: str) -> None:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        w = WorkerEntry(wid, address, channel, cluster_pb2_grpc.WorkerStub(channel))
        self.workers[wid] = w
        self._tasks.append(asyncio.create_task(self._watch(w), name=f"watch-{wid}"))
        log.info("worker.discovered", worker_id=wid, address=address)

    async def _watch(self, w: WorkerEntry) -> None:
        try:
            async for report in w.stub.StreamOccupancy(cluster_pb2.OccupancyRequest()):
                if not w.alive:
                    return
                finished, orphans = w.apply_report(report)
                self.metrics.free_blocks.labels(worker=w.worker_id).set(report.num_free_blocks)
                for rid in finished:
                    self._forget(rid, w.worker_id)
                if orphans and not self._adopting:
                    await self._withdraw_orphans(w, orphans)
                self._wake.set()
            reason = "report stream ended"
        except grpc.RpcError as e:
            reason = f"report stream broke: {e.code().name}"
        except asyncio.CancelledError:
            return
        await self._worker_dead(w, reason)

    def _forget(self, rid: str, wid: str) -> None:
        if self.where.get(rid) == wid:
            del self.where[rid]
            self.known.pop(rid, None)

    async def _withdraw_orphans(self, w: WorkerEntry, orphans: list[str]) -> None:
        """A worker runs requests it was not given (it came back after being declared dead)."""
        for rid in orphans:
            log.warning("worker.orphan_withdrawn", worker_id=w.worker_id, request_id=rid)
            with contextlib.suppress(grpc.RpcError):
                await w.stub.Cancel(cluster_pb2.WorkerCancelRequest(request_id=rid, notify_client=False),
                                    timeout=self.cfg.rpc_timeout_s)

    async def _worker_dead(self, w: WorkerEntry, reason: str) -> None:
        if not w.alive:
            return
        w.alive = False
        self.metrics.dead_workers.inc()
        if self.workers.get(w.worker_id) is w:
            del self.workers[w.worker_id]
            with contextlib.suppress(KeyError):  # no report came in: never labelled
                self.metrics.free_blocks.remove(w.worker_id)
        await retry(lambda: self.redis.hdel(self.keys.workers, w.worker_id), what="hdel_worker")
        placed = list(w.placed.values())
        w.placed.clear()
        log.warning("worker.dead", worker_id=w.worker_id, reason=reason, num_requests=len(placed))
        for pl in placed:
            rid = pl.pending.request_id
            if self.where.get(rid) == w.worker_id:
                del self.where[rid]
                self.num_reassigned += 1
                self.metrics.reassignments.inc()
                await self._requeue(pl.pending)
        with contextlib.suppress(Exception):
            await w.channel.close(grace=0)
        self._wake.set()

    async def _tick(self) -> None:
        """Dead-worker timeouts, deadlines, aging and the published queue length."""
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_report_at > self.cfg.dead_after_s:
                    await self._worker_dead(w, f"no report for {self.cfg.dead_after_s}s")
            for p in self.queue.pop_expired(int(time.time() * 1000)):
                await self._finish(p, "error", "deadline exceeded while waiting")
            self._wake.set()
            n = len(self.queue)
            if n != self._published_waiting or now - self._published_at > 1.0:
                self._published_waiting, self._published_at = n, now
                await retry(lambda n=n: self.redis.set(self.keys.num_waiting, n, px=5000), what="publish")

    # -- placing --------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (p := self.queue.peek()) is not None:
                live = list(self.workers.values())
                t0 = time.perf_counter()
                w = pick_worker(live, p, self.cfg.headroom_tokens)
                found = None
                if w is None and self.cfg.preempt_mode != "off":
                    found = pick_victims(live, p, self.cfg.headroom_tokens)
                self.metrics.decision_latency.observe(time.perf_counter() - t0)
                if w is not None:
                    await self._assign(p, w)
                elif found is not None:
                    # Assign first, then preempt: the request is already waiting on the worker
                    # when the victims' blocks come free, so it (the higher priority) takes
                    # them, not a victim swapping straight back in.
                    w, victims = found
                    if await self._assign(p, w):
                        await self._preempt(w, victims, p)
                else:
                    break  # head of line: it waits until a report shows room

    async def _assign(self, p: Pending, w: WorkerEntry) -> bool:
        """Send ``p`` to ``w``; False if it went back to the queue (worker draining or dead)."""
        self.queue.remove(p.request_id)
        w.place(p, self.cfg.headroom_tokens)
        self.where[p.request_id] = w.worker_id
        try:
            with assign_span(p, w) as metadata:  # the trace goes on to the worker
                resp = await w.stub.Assign(p.assign, timeout=self.cfg.rpc_timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            await self._worker_dead(w, f"Assign failed: {e.code().name}")
            return False
        if not resp.accepted:  # draining: back to the queue, elsewhere next time
            w.placed.pop(p.request_id, None)
            self.where.pop(p.request_id, None)
            self.queue.push(p)
            return False
        self.metrics.admissions.inc()
        log.info("request.placed", request_id=p.request_id, worker_id=w.worker_id,
                 num_tokens=p.num_tokens, num_resumed_tokens=len(p.assign.output_token_ids),
                 num_available_blocks=w.num_available_blocks)
        return True

    async def _preempt(self, w: WorkerEntry, victims, p: Pending) -> None:
        """Tell ``w`` to swap out (or recompute) ``victims`` to make room for ``p``; they stay
        placed on ``w`` and resume there."""
        mode = PREEMPT_MODES[self.cfg.preempt_mode]
        for pl in victims:
            rid = pl.pending.request_id
            try:
                resp = await w.stub.Preempt(cluster_pb2.PreemptRequest(request_id=rid, mode=mode),
                                            timeout=self.cfg.rpc_timeout_s)
            except grpc.RpcError as e:
                await self._worker_dead(w, f"Preempt failed: {e.code().name}")
                return
            pl.preempted_at = time.monotonic()
            self.num_preemptions += 1
            self.metrics.preemptions.inc()
            log.info("request.preempted", request_id=rid, worker_id=w.worker_id, for_request_id=p.request_id,
                     outcome=cluster_pb2.PreemptOutcome.Name(resp.outcome), num_freed_blocks=resp.num_freed_blocks)

    # -- the view --------------------------------------------------------------------------------
    def state(self) -> cluster_pb2.SchedulerState:
        return cluster_pb2.SchedulerState(
            active=True,
            workers=[w.to_proto() for w in self.workers.values()],
            waiting_request_ids=[p.request_id for p in self.queue.ordered()],
            num_preemptions=self.num_preemptions,
            num_reassigned=self.num_reassigned,
            policy=self.cfg.policy,
        )
