"""The active scheduler's I/O: Redis, fencing, gRPC, timers and the lease, driving the ledger.

Every decision (the queue, the worker table, placements, prefix holds, deadlines, preemption
victims) is the ledger's (``ledger.Ledger``, synchronous and without I/O); this module reads
the world into it and carries its answers out. Tasks, all on one event loop:

* ``_intake``: ``XREADGROUP`` on the requests stream; generate entries join the global
  queue, cancel entries withdraw a request wherever it is.
* ``_discover``: reads the workers' rows in Redis and opens each new worker's occupancy
  stream (``_watch``); a broken stream or ``dead_after_s`` without a report (on this
  process's monotonic clock: no clocks of other hosts are compared) marks the worker dead
  and its requests are resumed elsewhere from the tokens they emitted.
* ``_dispatch``: woken by every arrival and report; fences and sends the rounds the
  ledger decides (``Ledger.decide_round``), and the Preempt calls of a round that preempts.
* ``_tick``: dead-worker timeouts, deadlines, the published queue length.
* ``_finishes``: reads the done stream: a request is forgotten only once its final write
  has landed in Redis (never on a worker's word alone).
* ``_gone_gateways``: cancels the requests of gateway-chosen ids whose gateway process is
  gone (its liveness key expired): no client can retry or cancel them, and they would run to
  the end for no one.

Ownership is fenced (``pagefleet.common.fencing``): each assignment takes a new epoch in
Redis and the worker writes under it; resuming, cancelling or finishing a request takes a
newer one first, so whoever held it before can write no more (its writes are refused and
it drops the request). The scheduler's own epoch fences it too: once another scheduler has
taken the lease, every assignment it tries fails (``StaleScheduler``) and it stops; while it
cannot renew the lease in time on its own clock it places nothing, and it stops once the lease
is lost or must have lapsed (``server.Lease``).

A request is acknowledged in Redis in the same atomic step as its final message, whoever
writes it (its worker, or the scheduler for a cancel, a deadline or a refusal). On
takeover the pending entries are read again: those a worker reports holding are adopted,
the others resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import structlog

from pagefleet.common.fencing import (
    Fencing,
    Write,
    is_fenced,
    record_emitted,
    steps_field,
    take_over,
)
from pagefleet.common.metrics import SchedulerMetrics
from pagefleet.common.redis import GATEWAY_TTL_S, GROUP, Keys, OutEntry, retry
from pagefleet.common.redis_mux import mux_for, stream_entries
from pagefleet.common.service import CHANNEL_OPTIONS
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .assign_stream import AssignStream, NotServed
from .ledger import DEADLINE_WAITING, Ledger, LedgerConfig
from .moves import MoveConfig
from .observe import assign_span
from .placement import Placement, PlacementConfig
from .prefix_index import DEFAULT_MAX_KEYS
from .queue import Pending
from .transfers import TransferRunner
from .workers import ROLES, Placed, WorkerEntry

log = structlog.get_logger("scheduler")

# Rounds whose fences and Assigns may be in flight at once: placement decides the next round
# while the workers of the previous ones answer (a round would otherwise wait for its slowest
# worker before the next is decided).
_ROUNDS_IN_FLIGHT = 8
_CANCELS_IN_FLIGHT = 64
# One Assign message's size at most: a worker takes messages of up to 64 MiB, and a round's
# requests for one worker can be far more (hundreds of long prompts sharing a cached document).
ASSIGN_MESSAGE_BYTES = 16 << 20
_LEASE_POLL_S = 0.02  # how often a dispatcher unsure of its lease looks again
_TICK_S = 0.05  # the tick's period (dead workers, deadlines, the published queue length)
_STALL_S = 0.5  # a tick this late: the process stalled (the reports that waited are read first)
_CATCH_UP_S = 0.5  # ... for this long after it, before a worker's silence is judged
CONSUMER = "scheduler"  # one active scheduler: the lease makes the consumer name unique
GATEWAY_CHECK_S = 2.0  # how often the gateway processes that relay requests are looked up
# A gateway process whose liveness key was seen, then found missing at every look for this
# long, is gone (a Redis restarted without the key: a live process sets it again within a second).
GATEWAY_GONE_S = GATEWAY_TTL_S
GATEWAY_GONE_MEMORY_S = 600.0  # a process judged gone: a request of it taken in later goes at once
# A finish a worker reported and Redis does not hold after this long was refused: resumed.
UNCONFIRMED_FINISH_S = 5.0
# How often an idle worker reports (``--report-interval``): a heartbeat, by default an eighth of
# ``dead_after_s`` (eight missed make a worker dead), at most this far apart. A busy worker reports
# every 0.1 s (its requests' blocks grow), and any worker at once when its requests, free blocks or
# prefilled requests change.
MAX_REPORT_INTERVAL_S = 0.5
HEARTBEATS_PER_DEATH = 8


def report_interval(dead_after_s: float, asked: float | None = None) -> float:
    """The interval between an idle worker's reports: ``asked``, or ``dead_after_s`` / 8 (at most 0.5 s)."""
    return asked if asked else min(MAX_REPORT_INTERVAL_S, dead_after_s / HEARTBEATS_PER_DEATH)


PREEMPT_MODES = {
    "auto": cluster_pb2.PREEMPT_MODE_AUTO,
    "swap": cluster_pb2.PREEMPT_MODE_SWAP,
    "recompute": cluster_pb2.PREEMPT_MODE_RECOMPUTE,
}


def _dial_plaintext(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def _carrying(msg: cluster_pb2.AssignRequest, metadata) -> cluster_pb2.AssignRequest:
    """``msg``, or (while tracing) a copy whose traceparent is the one in ``metadata``."""
    traceparent = dict(metadata).get("traceparent")
    if not traceparent:
        return msg
    copy = cluster_pb2.AssignRequest()
    copy.CopyFrom(msg)
    copy.traceparent = traceparent
    return copy


def _under(requests: list[cluster_pb2.AssignRequest], limit: int) -> Iterator[list[cluster_pb2.AssignRequest]]:
    """``requests`` in order, in runs of at most ``limit`` bytes (one larger than it alone)."""
    part: list[cluster_pb2.AssignRequest] = []
    size = 0
    for r in requests:
        n = r.ByteSize() + 8  # with its field's tag and length
        if part and size + n > limit:
            yield part
            part, size = [], 0
        part.append(r)
        size += n
    if part:
        yield part


class StaleScheduler(RuntimeError):
    """A newer scheduler holds the lease (its epoch is above this one's): stop placing."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "fcfs"
    aging_s: float = 10.0
    headroom_tokens: int = 64
    preempt_mode: str = "auto"  # auto | swap | recompute | off
    dead_after_s: float = 2.0
    report_interval_s: float | None = None  # an idle worker's reports (None: report_interval's)
    worker_ttl_s: float = 5.0
    rpc_timeout_s: float = 5.0
    adopt_wait_s: float = 2.0
    placement: PlacementConfig = PlacementConfig()
    prefix_index_size: int = DEFAULT_MAX_KEYS  # most cached block keys the index keeps
    moves: MoveConfig = MoveConfig()  # KV moves between workers (moves.py; transfers.py runs them)
    model: str | None = None  # the shard's model (--served-model-name): a worker of another is flagged

    def ledger_config(self) -> LedgerConfig:
        return LedgerConfig(policy=self.policy, aging_s=self.aging_s, headroom_tokens=self.headroom_tokens,
                            preempt=self.preempt_mode != "off", placement=self.placement,
                            prefix_index_size=self.prefix_index_size, moves=self.moves, model=self.model)


class ClusterScheduler:
    """``epoch``: this scheduler's epoch (taken with the lease); ``lease_ok``: whether the lease
    is still surely held by the scheduler's own clock (checked before every assignment);
    ``dial``: a channel to a worker's address (default: plaintext; ``tls.dialer`` for mutual TLS)."""

    def __init__(self, redis, keys: Keys, config: SchedulerConfig, metrics: SchedulerMetrics | None = None,
                 *, epoch: int = 0, lease_ok: Callable[[], bool] = lambda: True,
                 dial: Callable[[str], grpc.aio.Channel] | None = None) -> None:
        self.redis = redis
        self.dial = dial or _dial_plaintext
        self.keys = keys
        self.cfg = config
        self.epoch = epoch
        self.lease_ok = lease_ok
        self._steps: dict[str, str] = {}  # worker id -> the steps stream its row names
        self._fenced: set[str] = set()  # steps streams found fenced: their workers are not placed on
        # Its own connections (standalone Redis): the round's assignments on one shared by the
        # calls that do not block, each blocking read on one of its own (``RedisMux``).
        self.mux = mux_for(redis)
        self._intake_read = mux_for(redis)
        self._done_read = mux_for(redis)
        self.fencing = Fencing(redis, keys, stream_of=lambda wid: self._steps.get(wid, ""), mux=self.mux)
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        # Adopting until the takeover has re-read the pending entries (``_adopt``).
        self.ledger = Ledger(config.ledger_config(), adopting=True,
                             on_decision=self.metrics.decision_latency.observe)
        self._rows: dict[str, tuple[object, float]] = {}  # worker id -> (its row's heartbeat, when it changed)
        self._done_cursor = "0-0"
        self._wake = asyncio.Event()
        self._published_waiting = -1
        self._published_at = 0.0
        self._tasks: list[asyncio.Task] = []
        self._cancel_calls: set[asyncio.Task] = set()  # best-effort Cancel calls in flight
        self._rounds: set[asyncio.Task] = set()  # rounds being fenced and sent (_dispatch)
        self._round_slots = asyncio.Semaphore(_ROUNDS_IN_FLIGHT)
        # Cancels being carried out (``_on_entry``): a worker's answer and a few Redis round
        # trips each, side by side, so a burst of them (hundreds of dropped streams) neither
        # waits in line nor holds the intake back. Reaped with the rounds.
        self._cancel_slots = asyncio.Semaphore(_CANCELS_IN_FLIGHT)
        # Requests with a cancel in flight (another entry for one is acknowledged: this one finishes it).
        self._cancelling: set[str] = set()
        # Requests being finished here (``_finish``), each once at a time: two finishes of one
        # request (a cancel, its deadline) would fence each other's final writes off for ever.
        self._finishing: dict[str, asyncio.Future] = {}
        self.metrics.bind(self.ledger)
        self.transfers = TransferRunner(self.ledger, self.metrics, redis, keys, resume=self._requeue, worker_dead=self._worker_dead,
                                        cancel=self._tell_cancel_soon, wake=self._wake.set, cancel_now=self._tell_cancel)

    # -- life ------------------------------------------------------------------------------
    async def run(self) -> None:
        await self._ensure_group()
        # Finishes from here on; earlier ones left no pending entry to adopt.
        last = await retry(lambda: self.redis.xrevrange(self.keys.done, count=1), what="done_tail")
        self._done_cursor = last[0][0] if last else "0-0"
        self._tasks = [asyncio.create_task(self._discover(), name="discover")]
        await self._adopt()
        self._tasks += [
            asyncio.create_task(self._intake(), name="intake"),
            asyncio.create_task(self._dispatch(), name="dispatch"),
            asyncio.create_task(self._tick(), name="tick"),
            asyncio.create_task(self._finishes(), name="finishes"),
            asyncio.create_task(self._unconfirmed_finishes(), name="unconfirmed_finishes"),
            asyncio.create_task(self._gone_gateways(), name="gone_gateways"),
        ]
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.close()

    async def close(self) -> None:
        for t in (*self._tasks, *self._cancel_calls, *self._rounds):
            t.cancel()
        await self.transfers.close()
        for w in self.ledger.workers.values():
            if w.channel is not None:
                await w.channel.close()
        for mux in (self.mux, self._intake_read, self._done_read):
            if mux is not None:
                await mux.aclose()

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
        ledger = self.ledger
        deadline = time.monotonic() + self.cfg.adopt_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if ledger.workers and all(w.report is not None for w in ledger.workers.values()):
                break
        holders = ledger.holders()
        async for entry_id, fields in self._pending_entries():
            await self._on_entry(entry_id, fields, holders)
        for w, orphans in ledger.adopted():
            await self._withdraw_orphans(w, orphans)
        log.info("scheduler.adopted", num_placed=ledger.num_placed, num_waiting=ledger.num_waiting,
                 workers=sorted(ledger.workers))
        self._wake.set()

    # -- intake ------------------------------------------------------------------------------
    async def _intake(self) -> None:
        import redis.exceptions as rx

        errors = []
        while True:
            try:
                resp = await retry(self._read_new, what="xreadgroup", on_error=errors.append)
            except rx.ResponseError as e:
                if not str(e).startswith("NOGROUP"):
                    raise
                # The requests stream is gone (deleted, evicted by a Redis told it may), and its
                # group with it: made again, as at start; what it held is lost with it, and the
                # gateways' relays queue their requests again (``requeue_if_lost``). It ended
                # the scheduler (and, under ``up``, the cluster).
                log.error("scheduler.requests_stream_gone", stream=self.keys.requests, error=str(e))
                await self._ensure_group()
                continue
            for _, entries in resp or ():
                for entry_id, fields in entries:
                    await self._on_entry(entry_id, fields, None)
            if errors:  # a read Redis answered (and persisted) may have lost its reply with the connection
                errors.clear()
                await self._reread_pending()
            self._wake.set()

    async def _read_new(self) -> list:
        """The requests stream's entries not delivered to us yet (blocks up to a second)."""
        if self._intake_read is None:
            return await self.redis.xreadgroup(GROUP, CONSUMER, {self.keys.requests: ">"}, count=256, block=1000)
        return stream_entries(await self._intake_read.call(
            "XREADGROUP", "GROUP", GROUP, CONSUMER, "COUNT", 256, "BLOCK", 1000, "STREAMS", self.keys.requests, ">"))

    async def _read_done(self) -> list:
        """The done stream's entries after our cursor (blocks up to a second)."""
        if self._done_read is None:
            return await self.redis.xread({self.keys.done: self._done_cursor}, count=512, block=1000)
        return stream_entries(await self._done_read.call(
            "XREAD", "COUNT", 512, "BLOCK", 1000, "STREAMS", self.keys.done, self._done_cursor))

    async def _pending_entries(self):
        """Our pending entries (delivered to us, not acknowledged), oldest first."""
        start = "0"
        while True:
            resp = await retry(lambda s=start: self.redis.xreadgroup(
                GROUP, CONSUMER, {self.keys.requests: s}, count=512), what="xreadgroup_pending")
            entries = resp[0][1] if resp else []
            if not entries:
                return
            for entry in entries:
                yield entry
            start = entries[-1][0]

    async def _reread_pending(self) -> None:
        """Entries an ``XREADGROUP >`` delivered in a reply that never arrived (Redis went away
        mid-call) wait in our pending list, where ``>`` never shows them again: take in the
        ones not known yet (one that finished meanwhile would only be fenced off: ``epoch == 0``).
        Every request in the system is pending, so this is for errors only."""
        n = 0
        async for entry_id, fields in self._pending_entries():
            rid = fields.get(b"rid", b"").decode()
            if fields.get(b"kind") == b"generate" and not self.ledger.is_new(rid):
                if rid not in self.ledger.known:  # finished: its ack may be on its way, or never
                    await self._ack(entry_id)  # come (a finish with no entry to acknowledge)
                continue  # else taken in already
            n += 1
            await self._on_entry(entry_id, fields, None)
        if n:
            log.warning("intake.recovered_pending", num_entries=n)

    async def _on_entry(self, entry_id, fields: dict, holders: dict[str, WorkerEntry] | None) -> None:
        """One entry of the requests stream; ``holders`` (takeover only): request id -> the
        worker whose report lists it."""
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        kind = fields.get(b"kind", b"").decode()
        rid = fields.get(b"rid", b"").decode()
        if kind == "cancel":
            if rid in self._cancelling:  # the cancel in flight finishes it
                await self._ack(entry_id)
            elif rid and " " not in rid:  # ids are joined by spaces in the done stream: one with a space is no id
                await self._cancel_slots.acquire()
                self._cancelling.add(rid)
                task = asyncio.create_task(self._cancel_entry(rid, entry_id))
                self._rounds.add(task)
                task.add_done_callback(self._round_done)
            else:
                log.warning("entry.malformed", entry_id=entry_id, request_id=rid)
                await self._ack(entry_id)
            return
        if kind != "generate" or rid in self.ledger.known:
            if rid not in self.ledger.known:
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
        if holders is None:
            self.ledger.take(rid, entry_id, msg)
        # Takeover: placed where a worker already runs it, or resumed from its output (it may
        # have run somewhere).
        elif (p := self.ledger.take_over(rid, entry_id, msg, holders.get(rid))) is not None:
            await self._requeue(p)

    async def _fence(self, rid: str, owner: str) -> int:
        """A new epoch for ``rid`` (whoever held it can write no more); 0 if it is finished."""
        epoch = await retry(lambda: self.fencing.assign(rid, self.epoch, owner), what="fence")
        if epoch < 0:
            raise StaleScheduler(f"scheduler epoch {self.epoch} is no longer the current one")
        return epoch

    async def _requeue(self, p: Pending, worker_dead: str = "") -> None:
        """Queue ``p`` (in the ledger's hand) again to resume after the tokens it emitted:
        fenced first, so the output read is final (nobody before can add to it); ``worker_dead``:
        the worker declared dead it was on (its steps stream is fenced: it can add nothing more)."""
        if await self._fence(p.request_id, "") == 0:
            self.ledger.forget(p.request_id)
            await self._ack(p.entry_id)
            return
        emitted, finish = await take_over(self.redis, self.keys, p.request_id, fence=worker_dead or None)
        if finish:
            self.ledger.forget(p.request_id)
            await self._ack(p.entry_id)
            return
        if not self.ledger.resume(p, emitted):  # every token is out but the last message never was
            await self._finish(p.request_id, "length", "")
            return
        self._wake.set()

    async def _cancel(self, rid: str, reason: str = "abort", error: str = "") -> None:
        """Finish ``rid`` (aborted, by default) wherever it is: queued, placed, or being
        resumed. The fence makes its worker's next write fail, so the worker drops it; the
        Cancel call only frees its blocks sooner."""
        w = self.ledger.placed_on(rid)
        record = None
        if w is not None and w.alive and w.stub is not None and rid not in self.ledger.transfers:
            # Taken from its worker first (in hand: its reports no longer place it), which stops
            # at once and hands back what it wrote: the final comes after those tokens, and no
            # stream is read back for them.
            self.ledger.dropped(w, [rid])
            record = await self._tell_cancel(w, rid, want_record=True)
        finished_here = await self._finish(rid, reason, error, record)
        # Told even when it had finished already: so it reads too when this very finish landed and
        # its reply was lost (the retry finds the request done), and a Cancel of a request its
        # worker no longer holds is a no-op.
        if w is not None and w.alive and record is None:  # (one that answered has let it go)
            # Not awaited: the worker answers between two of its steps.
            self._tell_cancel_soon(w, rid)
            log.info("request.cancel_sent", request_id=rid, worker_id=w.worker_id, finished_here=finished_here)

    def _tell_cancel_soon(self, w: WorkerEntry, rid: str) -> None:
        """``_tell_cancel`` in the background."""
        if w.alive:
            call = asyncio.create_task(self._tell_cancel(w, rid))
            self._cancel_calls.add(call)
            call.add_done_callback(self._cancel_calls.discard)

    async def _tell_cancel(self, w: WorkerEntry, rid: str, want_record: bool = False) -> bytes | None:
        """Ask ``w`` to drop ``rid`` now and free its blocks; with ``want_record``, what it wrote
        for it. None when it did not answer (best effort: its writes are fenced off already, so a
        lost call only delays the freeing; the output is then read back from Redis)."""
        if w.stub is None:
            return None
        try:
            resp = await w.stub.Cancel(cluster_pb2.WorkerCancelRequest(request_id=rid, want_record=want_record),
                                       timeout=self.cfg.rpc_timeout_s)
        except grpc.RpcError:
            return None
        except asyncio.CancelledError:
            if w.alive:
                raise  # our own task is being cancelled; else the channel closed under the call
            return None
        return resp.record

    async def _cancel_entry(self, rid: str, entry_id: str) -> None:
        """A cancel entry carried out, then acknowledged (``_on_entry``)."""
        try:
            await self._cancel(rid)
            await self._ack(entry_id)
        finally:
            self._cancelling.discard(rid)
            self._cancel_slots.release()

    async def _finish(self, rid: str, reason: str, error: str, record: bytes | None = None) -> bool:
        """``_finish_once`` unless ``rid`` is being finished already: then that finish's answer
        is awaited, and this one is no finish of its own (False)."""
        running = self._finishing.get(rid)
        if running is not None:
            await asyncio.shield(running)
            return False
        done = self._finishing[rid] = asyncio.get_running_loop().create_future()
        try:
            return await self._finish_once(rid, reason, error, record)
        finally:
            del self._finishing[rid]
            done.set_result(None)

    async def _finish_once(self, rid: str, reason: str, error: str, record: bytes | None = None) -> bool:
        """Write ``rid``'s final message (and acknowledge its entry) under a new epoch, then
        forget it; False if it had finished already. The tokens it emitted before (on a worker
        that runs it, or ran it) are recorded first, and the final comes after them: a retry of
        its id relays them and then the finish, as its first caller saw them. ``record``: what
        its worker handed back as it let it go (``_tell_cancel``); None: read back from the
        worker's steps stream (``take_over``; its worker writes no more of it past the new epoch)."""
        while True:
            epoch = await self._fence(rid, "")  # the last worker stays named: its output is read next
            if epoch == 0:  # finished already, maybe by a write that had no entry of it to
                # acknowledge (a cancel read before the entry): its entry goes now
                await self._forget_finished(rid)
                return False
            emitted, finish = (await record_emitted(self.redis, self.keys, rid, record) if record is not None
                               else await take_over(self.redis, self.keys, rid))
            if finish:  # its worker had finished it, its final not yet in Redis (our fence refuses it): ours says so
                reason, error = finish, ""
            entry = OutEntry(len(emitted), [], "", reason, error)
            # Read now: its entry may have been taken in meanwhile (a cancel sent before it was queued).
            p = self.ledger.known.get(rid)
            write = Write(rid, epoch, entry, p.entry_id if p else "", field=steps_field(p.assign.reply_to if p else ""))
            if (await retry(lambda w=write: self.fencing.write([w]), what="finish"))[0]:
                break
            # Refused: an assignment in flight took a newer epoch between our fence and our
            # write. Forgetting the request now would leave it running unowned: fence again.
        # Its entry taken in while the write was on its way (a cancel read before it): that
        # write could not acknowledge it, and forgetting the request would leave it for good.
        await self._forget_finished(rid, acknowledged=write.entry_id)
        log.info("request.finished_by_scheduler", request_id=rid, finish_reason=reason, error=error)
        return True

    async def _forget_finished(self, rid: str, acknowledged: str = "") -> None:
        """Forget ``rid``, finished, and acknowledge the entry the ledger knows it by unless
        that is ``acknowledged`` (its final write did): an entry of it taken in after the
        finish was written would otherwise stay in the requests stream for good."""
        p = self.ledger.known.get(rid)
        self.ledger.forget(rid)
        if p is not None and p.entry_id and p.entry_id != acknowledged:
            await self._ack(p.entry_id)

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
            now = time.monotonic()
            for raw_id, raw in rows.items():
                wid = raw_id.decode()
                row = json.loads(raw)
                # A row is live while its heartbeat changes, timed on this clock (the value is
                # opaque: the worker's clock is never compared with ours).
                beat = row.get("beat", row.get("ts_ms"))
                seen = self._rows.get(wid)
                if seen is None or seen[0] != beat:
                    self._rows[wid] = seen = (beat, now)
                if now - seen[1] > self.cfg.worker_ttl_s:
                    await retry(lambda w=wid: self.redis.hdel(self.keys.workers, w), what="hdel_worker")
                    self._rows.pop(wid, None)
                    continue
                w = self.ledger.workers.get(wid)
                steps = row.get("steps", "")
                if w is None or w.address != row["address"] or self._steps.get(wid, steps) != steps:
                    if steps and await self._stream_fenced(steps):
                        continue  # declared dead: placed on again once it writes to a new stream
                    if w is not None:
                        await self._worker_dead(w, "address changed" if w.address != row["address"] else "new stream")
                    self._steps[wid] = steps
                    model = row.get("model")
                    if self.cfg.model and model and model != self.cfg.model:
                        # A worker started for another model on this shard: its tokens would
                        # answer this model's requests. Placed on as before (a name may differ
                        # from the path it serves), and said loudly.
                        log.error("worker.model_mismatch", worker_id=wid, worker_model=model, shard_model=self.cfg.model)
                    self._add_worker(wid, row["address"], row.get("role", "both"))
            await asyncio.sleep(0.5)

    async def _stream_fenced(self, key: str) -> bool:
        if key not in self._fenced and await is_fenced(self.redis, key):
            self._fenced.add(key)
        return key in self._fenced

    def _add_worker(self, wid: str, address: str, role: str = "both") -> None:
        if role not in ROLES:
            log.warning("worker.bad_role", worker_id=wid, role=role)
            return
        channel = self.dial(address)
        w = WorkerEntry(wid, address, channel, cluster_pb2_grpc.WorkerStub(channel), role=role)
        self.ledger.add_worker(w)
        self._tasks.append(asyncio.create_task(self._watch(w), name=f"watch-{wid}"))
        log.info("worker.discovered", worker_id=wid, address=address)

    async def _watch(self, w: WorkerEntry) -> None:
        try:
            request = cluster_pb2.OccupancyRequest(
                deltas=True, interval_s=report_interval(self.cfg.dead_after_s, self.cfg.report_interval_s))
            async for report in w.stub.StreamOccupancy(request):
                if not w.alive:
                    return
                out = self.ledger.on_report(w, report)
                self.metrics.observe_report(w.worker_id, report)
                if report.prefilled_request_ids or w.role == "prefill":
                    self.transfers.prefilled(w, report.prefilled_request_ids)
                for p in out.resume:  # dropped without a finish reported: resume (or forget) it
                    log.warning("request.vanished", request_id=p.request_id, worker_id=w.worker_id)
                    await self._requeue(p)
                if out.withdraw:
                    await self._withdraw_orphans(w, out.withdraw)
                # Placement only gains from a report that shows room (the tick wakes it anyway).
                if out.room:
                    self._wake.set()
            reason = "report stream ended"
        except grpc.RpcError as e:
            reason = f"report stream broke: {e.code().name}"
        except asyncio.CancelledError:
            return
        await self._worker_dead(w, reason)

    async def _finishes(self) -> None:
        """Forget each request whose final write landed (the done stream, written in the same
        atomic step as the write); wake placement, since its worker has room again."""
        while True:
            resp = await retry(self._read_done, what="xread_done")
            for _, entries in resp or ():
                for entry_id, fields in entries:
                    self._done_cursor = entry_id
                    for rid in fields[b"rid"].decode().split(" "):
                        self.ledger.forget(rid)
            self._wake.set()

    async def _unconfirmed_finishes(self) -> None:
        """Resume a request its worker reported finished whose finish Redis still lacks after
        ``UNCONFIRMED_FINISH_S`` (not done in its owner record: the final write was refused,
        its assignment lost in a Redis failover; the worker dropped it). Normally the done
        stream confirms a finish within a write's round trip."""
        first_seen: dict[str, float] = {}
        while True:
            await asyncio.sleep(UNCONFIRMED_FINISH_S / 4)
            now = time.monotonic()
            first_seen = {rid: first_seen.get(rid, now) for w in list(self.ledger.workers.values())
                          for rid, pl in list(w.placed.items()) if pl.finished}
            for rid, since in list(first_seen.items()):
                if now - since < UNCONFIRMED_FINISH_S:
                    continue
                done = await retry(lambda r=rid: self.redis.hget(self.keys.owner(r), "done"), what="hget_done")
                p = None if done == b"1" else self.ledger.finish_unconfirmed(rid)
                if p is not None:
                    log.warning("request.finish_unconfirmed", request_id=rid)
                    await self._requeue(p)

    async def _gone_gateways(self) -> None:
        """Cancel the requests of gateway-chosen ids (``AssignRequest.gateway_chosen_id``)
        whose gateway process is gone: only that process relays them, and no client knows to
        retry or cancel them, so they would hold their workers to the end for no one. A
        process is alive while its key (``Keys.gateway``) is set; it is judged only once this
        scheduler has seen its key (a gateway of an older version sets none, and one that has
        just started may not have yet), and gone once every look for ``GATEWAY_GONE_S`` has
        found the key missing: counted from the first look that missed it, not from the last
        that found it, so a Redis frozen or restarted past the key's TTL (which expires it at
        once) is no death (the process sets it again within a second). A client's own id is
        left: its retry may come."""
        seen: set[str] = set()  # gateway processes (reply_to) whose key was found
        missing: dict[str, float] = {}  # of those, the ones missing since
        gone: dict[str, float] = {}  # processes judged gone, since (a request of one read later goes too)
        while True:
            await asyncio.sleep(GATEWAY_CHECK_S)
            relayed: dict[str, list[str]] = {}
            for rid, p in self.ledger.known.items():
                if p.assign.gateway_chosen_id and p.assign.reply_to:
                    relayed.setdefault(p.assign.reply_to, []).append(rid)
            seen &= relayed.keys()
            missing = {n: t for n, t in missing.items() if n in seen}
            now = time.monotonic()
            gone = {n: t for n, t in gone.items() if now - t < GATEWAY_GONE_MEMORY_S}
            if not relayed:
                continue
            names = list(relayed)

            async def look(names=names):
                pipe = self.redis.pipeline(transaction=False)
                for name in names:
                    pipe.exists(self.keys.gateway(name))
                return await pipe.execute()

            alive = await retry(look, what="gateways_alive")
            now = time.monotonic()
            for name, up in zip(names, alive, strict=True):
                if up:
                    seen.add(name)
                    missing.pop(name, None)
                    gone.pop(name, None)
                elif name in gone or (name in seen and now - missing.setdefault(name, now) >= GATEWAY_GONE_S):
                    seen.discard(name)
                    missing.pop(name, None)
                    gone.setdefault(name, now)
                    log.warning("gateway.gone", reply_to=name, num_requests=len(relayed[name]))
                    rids = relayed[name]
                    for i in range(0, len(rids), _CANCELS_IN_FLIGHT):
                        await asyncio.gather(*(self._cancel(rid) for rid in rids[i:i + _CANCELS_IN_FLIGHT]
                                               if rid in self.ledger.known))

    async def _withdraw_orphans(self, w: WorkerEntry, orphans: list[str]) -> None:
        """A worker runs requests it was not given (it came back after being declared dead);
        the ledger has left out those finished recently (were one an orphan, its done flag
        refuses the worker's next write, which drops it)."""
        for rid in orphans:
            log.warning("worker.orphan_withdrawn", worker_id=w.worker_id, request_id=rid)
            await self._tell_cancel(w, rid)

    async def _worker_dead(self, w: WorkerEntry, reason: str) -> None:
        in_table = self.ledger.workers.get(w.worker_id) is w
        num_placed = len(w.placed)
        moving = self.transfers.moving_from(w)
        resume = self.ledger.worker_dead(w)
        if resume is None:
            return
        self.metrics.dead_workers.inc()
        if in_table:
            self.metrics.forget_worker(w.worker_id)
        await retry(lambda: self.redis.hdel(self.keys.workers, w.worker_id), what="hdel_worker")
        log.warning("worker.dead", worker_id=w.worker_id, reason=reason, num_requests=num_placed)
        # Each move's end settled at once (its drop at the target waited for together: one
        # DROP_WAIT_S in all, however many it was moving), then the others resume, in order.
        handed = await asyncio.gather(*(self.transfers.handed_over(p, moving) for p in resume))
        for p, on_target in zip(resume, handed, strict=True):
            if on_target:  # it runs on its transfer's target
                continue
            self.metrics.reassignments.inc()
            await self._requeue(p, worker_dead=w.worker_id)
        with contextlib.suppress(Exception):
            await w.channel.close(grace=0)
        self._wake.set()

    async def _tick(self) -> None:
        """Dead-worker timeouts, deadlines, aging and the published queue length. A tick that
        comes late (this process stalled: frozen, starved of CPU, a long pause) judges no
        worker's silence for ``_CATCH_UP_S``: the reports that waited for this process are read
        first, and the workers that sent them are not dead. Once per stall: a process slow all
        the time judges every other tick (on the workers' real silence, never shifted), so a
        worker gone silent is still found within ``--dead-after`` and a tick or two."""
        judge_from, judged = 0.0, True  # no judging before; judged once since the last stall
        while True:
            slept_at = time.monotonic()
            await asyncio.sleep(_TICK_S)
            now = time.monotonic()
            if now - slept_at - _TICK_S > _STALL_S and judged:
                log.warning("scheduler.stalled", seconds=round(now - slept_at - _TICK_S, 3))
                judge_from, judged = now + _CATCH_UP_S, False
            if now >= judge_from:
                judged = True
                for w in self.ledger.silent_workers(self.cfg.dead_after_s):
                    await self._worker_dead(w, f"no report for {self.cfg.dead_after_s}s")
            waited, running = self.ledger.expired()
            for p in waited:
                await self._finish(p.request_id, "error", DEADLINE_WAITING)
            for rid in running:
                if rid in self.ledger.where:  # still running: cut it off
                    await self._cancel(rid, "error", "deadline exceeded while running")
            await self.transfers.tick()
            self._wake.set()
            now = time.monotonic()
            n = self.ledger.num_waiting
            if n != self._published_waiting or now - self._published_at > 1.0:
                self._published_waiting, self._published_at = n, now
                await retry(lambda n=n: self.redis.set(self.keys.num_waiting, n, px=5000), what="publish")

    # -- placing --------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        """Carry out the ledger's rounds (``Ledger.decide_round``: pure CPU): fence each
        round's claims in one Redis round trip and send their Assigns at once, in the
        background: up to ``_ROUNDS_IN_FLIGHT`` rounds are fenced and sent while the next is
        decided. A round that preempts is carried out before the next is decided."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._reap_rounds()
            while True:
                while not self.lease_ok():  # unsure of the lease: place nothing until it is renewed (or lost)
                    await asyncio.sleep(_LEASE_POLL_S)
                decision = self.ledger.decide_round()
                for p, why in decision.refused:  # past its deadline, or no worker could ever take it
                    if why != DEADLINE_WAITING:
                        log.warning("request.refused", request_id=p.request_id, reason=why)
                    await self._finish(p.request_id, "error", why)
                if decision.victims:
                    # Assign first, then preempt: the request is already waiting on the worker
                    # when the victims' blocks come free, so it (the higher priority) takes
                    # them, not a victim swapping straight back in.
                    ((p, placement),) = decision.claims
                    if (await self._assign_claimed(decision.claims))[0]:
                        await self._preempt(placement.worker, decision.victims, p)
                    self.transfers.start(decision.moves)
                elif decision.moves:  # every victim moves to another worker instead
                    self.transfers.start(decision.moves)
                    await self._assign_claimed(decision.claims)
                elif decision.claims:
                    await self._round_slots.acquire()
                    task = asyncio.create_task(self._send_round(decision.claims))
                    self._rounds.add(task)
                    task.add_done_callback(self._round_done)
                elif not decision.refused:
                    break  # empty, or head of line: it waits until a report shows room
                self._reap_rounds()
            self.transfers.start(self.ledger.decide_moves())

    async def _send_round(self, claimed: list[tuple[Pending, Placement]]) -> None:
        try:
            await self._assign_claimed(claimed)
        finally:
            self._round_slots.release()

    def _round_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._wake.set()  # the dispatcher reaps it and raises (e.g. StaleScheduler)

    def _reap_rounds(self) -> None:
        """Forget the rounds that ended; raise what one of them raised."""
        for task in [t for t in self._rounds if t.done()]:
            self._rounds.discard(task)
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _assign_claimed(self, claimed: list[tuple[Pending, Placement]]) -> list[bool]:
        """Fence every claimed request in one round trip, then send them, one call per worker,
        to all their workers at once; for each, whether its worker took it."""
        owners = [(p.request_id, pl.worker.worker_id) for p, pl in claimed]
        epochs = await retry(lambda: self.fencing.assign_many(owners, self.epoch), what="fence")
        if any(e < 0 for e in epochs):
            raise StaleScheduler(f"scheduler epoch {self.epoch} is no longer the current one")
        by_worker: dict[str, list[tuple[int, Pending, Placement]]] = {}
        for i, ((p, placement), epoch) in enumerate(zip(claimed, epochs, strict=True)):
            if epoch == 0:  # finished meanwhile (e.g. cancelled before it was read): drop its entry too
                self.ledger.forget(p.request_id)
                await self._ack(p.entry_id)
                continue
            p.assign.epoch, p.assign.scheduler_epoch = epoch, self.epoch
            by_worker.setdefault(placement.worker.worker_id, []).append((i, p, placement))
        groups = list(by_worker.values())
        results = await asyncio.gather(*(self._send_to(g[0][2].worker, [(p, pl) for _, p, pl in g]) for g in groups))
        taken = [False] * len(claimed)
        for group, oks in zip(groups, results, strict=True):
            for (i, _, _), ok in zip(group, oks, strict=True):
                taken[i] = ok
        return taken

    async def _send_to(self, w: WorkerEntry, items: list[tuple[Pending, Placement]]) -> list[bool]:
        """Send fenced, claimed requests to ``w`` (one message on its assign stream: ``_assign``;
        more, one after another, past ``ASSIGN_MESSAGE_BYTES``);
        for each, False if it went back to the queue (worker draining or dead) or was
        forgotten while it was being fenced (cancelled, or its worker declared dead)."""
        live = [self.ledger.is_placed(p.request_id, w.worker_id) for p, _ in items]
        send = [it for it, ok in zip(items, live, strict=True) if ok]
        if not send:
            return live
        try:
            with contextlib.ExitStack() as spans:
                # Each request's assign span goes on to the worker in its copy's traceparent.
                requests = [_carrying(p.assign, spans.enter_context(assign_span(p, w))) for p, _ in send]
                responses = []
                for part in _under(requests, ASSIGN_MESSAGE_BYTES):
                    batch = cluster_pb2.AssignBatchRequest(requests=part)
                    responses.extend((await self._assign(w, batch)).responses)
        except grpc.RpcError as e:
            if w.alive:  # else declared dead meanwhile (its channel closed under the stream)
                await self._worker_dead(w, f"Assign failed: {e.code().name}")
            return [False] * len(items)
        except asyncio.CancelledError:
            if w.alive:
                raise
            return [False] * len(items)  # its channel was closed under the call: declared dead meanwhile
        settled = iter([self._settle(w, p, placement, resp) for (p, placement), resp
                        in zip(send, responses, strict=True)])
        return [next(settled) if ok else False for ok in live]

    async def _assign(self, w: WorkerEntry, batch: cluster_pb2.AssignBatchRequest) -> cluster_pb2.AssignBatchResponse:
        """``batch`` to ``w``, as a message on its assign stream (``assign_stream``), or as an
        ``AssignBatch`` call to a worker that does not serve the stream."""
        if w.assigns is None:
            w.assigns = AssignStream(w.stub, self.cfg.rpc_timeout_s)
        try:
            return await w.assigns.send(batch)
        except NotServed:
            return await w.stub.AssignBatch(batch, timeout=self.cfg.rpc_timeout_s)

    def _settle(self, w: WorkerEntry, p: Pending, placement: Placement, resp) -> bool:
        """Take ``w``'s answer to ``p``'s Assign in: True if it took it."""
        if resp.stale_scheduler:
            raise StaleScheduler(f"worker {w.worker_id} has seen a newer scheduler than epoch {self.epoch}")
        self.ledger.settled(p, w, resp.accepted)
        if not resp.accepted:  # draining: back to the queue, elsewhere next time
            return False
        self.metrics.admissions.inc()
        self.metrics.placed(placement.decision, placement.num_matched_blocks)
        log.info("request.placed", request_id=p.request_id, worker_id=w.worker_id, decision=placement.decision,
                 num_tokens=p.num_tokens, num_resumed_tokens=len(p.assign.output_token_ids),
                 num_matched_blocks=placement.num_matched_blocks, num_available_blocks=w.num_available_blocks)
        return True

    async def _preempt(self, w: WorkerEntry, victims: list[Placed], p: Pending) -> None:
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
            except asyncio.CancelledError:
                if w.alive:
                    raise
                return  # declared dead meanwhile
            self.ledger.preempted(pl)
            self.metrics.preemptions.inc()
            log.info("request.preempted", request_id=rid, worker_id=w.worker_id, for_request_id=p.request_id,
                     outcome=cluster_pb2.PreemptOutcome.Name(resp.outcome), num_freed_blocks=resp.num_freed_blocks)

    # -- the view --------------------------------------------------------------------------------
    def state(self) -> cluster_pb2.SchedulerState:
        ledger = self.ledger
        return cluster_pb2.SchedulerState(
            active=True,
            workers=[w.to_proto() for w in ledger.workers.values()],
            waiting_request_ids=[p.request_id for p in ledger.queue.ordered()],
            num_preemptions=ledger.num_preemptions,
            num_reassigned=ledger.num_reassigned,
            policy=self.cfg.policy,
            placement=self.cfg.placement.policy,
            num_prefix_index_keys=ledger.num_prefix_index_keys,
            num_migrated=ledger.num_transfers_done,
            num_transfers_expired=ledger.num_transfers_expired,
            num_in_transfer=ledger.num_in_transfer,
        )
