"""Live migration between worker processes: the ``Migrate*`` RPCs of ``pagefleet.v1.Worker``.

The scheduler sends ``Migrate`` to the worker holding a request (the *source*), naming the
*target*. The source meets the target over ``KvPeer`` if it has not yet, opens the migration
there (``MigrateBegin``), and runs ``migration.LiveMigration`` on its engine thread between
steps, with the target behind ``GrpcReceiver``: each stage is a ``MigrateRead`` (the target
reads the blocks from the source's pool over NIXL) polled with ``MigratePoll``; the final
stage ends with ``MigrateCommit`` (``Handover``'s fields, the source's epoch, and what the
source wrote for the request). ``Migrate`` answers once the migration has ended.

Who owns the request (``pagefleet.common.handover``): the target verifies every block, then
moves the owner record from the source (under the source's epoch) to itself in one script,
recording what the source wrote in the request's own output stream, and only then runs the
request; the source lets it go only after the target said it committed. A commit whose
answer was lost is settled in Redis: the source tries to take the request back with the same
script; if the record names the target already, the source lets it go, else it runs on and
the target's late commit finds the record changed. Either way one worker owns it.

Threads: the engine (allocations, the request's state) is touched on the engine thread only
(``EngineLoop.call``); the transport is shared by that thread and the event loop (its
progress, the target's polls) behind a lock (``LockedTransport``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import structlog

from pagefleet.common.fencing import steps_field
from pagefleet.common.handover import move_owner
from pagefleet.common.sampling_proto import from_proto, to_proto
from pagefleet.common.service import CHANNEL_OPTIONS
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

log = structlog.get_logger("worker.migration")

# The defaults of migration.py (which needs torch: imported where a migration runs, so that a
# worker of --engine sim starts without it).
DEADLINE_S, LEASE_S, FINAL_STAGE_BLOCKS, MAX_STAGES = 30.0, 5.0, 16, 3
RPC_TIMEOUT_S = 5.0  # one stage message between the two workers (a target silent this long is gone: its lease)
SETTLE_TIMEOUT_S = 10.0  # the source asking Redis who owns a request whose commit went unanswered
REASONS = {
    cluster_pb2.MIGRATE_REASON_UNSPECIFIED: "unspecified",
    cluster_pb2.MIGRATE_REASON_BALANCE: "balance",
    cluster_pb2.MIGRATE_REASON_PREEMPTION: "preemption",
    cluster_pb2.MIGRATE_REASON_DISAGGREGATION: "disaggregation",
    cluster_pb2.MIGRATE_REASON_DRAIN: "drain",
}
OUTCOMES = {
    "migrated": cluster_pb2.MIGRATE_OUTCOME_MIGRATED,
    "gave_up": cluster_pb2.MIGRATE_OUTCOME_GAVE_UP,
    "failed": cluster_pb2.MIGRATE_OUTCOME_FAILED,
    "expired": cluster_pb2.MIGRATE_OUTCOME_EXPIRED,
    "refused": cluster_pb2.MIGRATE_OUTCOME_REFUSED,
    "not_found": cluster_pb2.MIGRATE_OUTCOME_NOT_FOUND,
}
_STATES = {cluster_pb2.KV_TRANSFER_STATE_DONE: "DONE", cluster_pb2.KV_TRANSFER_STATE_IN_PROGRESS: "PROC"}
_STATE_PROTO = {"DONE": cluster_pb2.KV_TRANSFER_STATE_DONE, "PROC": cluster_pb2.KV_TRANSFER_STATE_IN_PROGRESS,
                "ERR": cluster_pb2.KV_TRANSFER_STATE_FAILED}


class LockedTransport:
    """A ``KVTransport`` whose calls are serialized (one NIXL agent, two threads use it)."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        attr = getattr(self._transport, name)
        if not callable(attr):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return locked


class GrpcReceiver:
    """The target of one migration as the source's ``LiveMigration`` sees it (``Receiver``),
    over a blocking stub, called on the source's engine thread, which must not wait on a
    target that is slow or frozen: each call goes out as a future (``stub.Method.future``)
    and is answered at a later ``poll`` or ``commit`` (``waiting`` while one is not). A call
    unanswered past ``timeout_s`` is a target gone. ``commit_message`` builds the commit from a
    ``Handover``; ``settle`` says whether the target owns the request after a commit whose
    answer was lost (True: let it go here)."""

    def __init__(self, stub, request_id: str, commit_message: Callable[[object], cluster_pb2.MigrateCommitRequest],
                 settle: Callable[[], bool], timeout_s: float = RPC_TIMEOUT_S) -> None:
        self.stub, self.request_id = stub, request_id
        self.commit_message, self.settle = commit_message, settle
        self.timeout_s = timeout_s
        self.epoch = 0  # the target's, once committed
        self.num_unread = 0  # blocks asked for that the target found cached (never read)
        self._reading: tuple[object, int] | None = None  # MigrateRead's future, the blocks it asked for
        self._polling = None  # MigratePoll's future
        self._committing = None  # MigrateCommit's future

    @property
    def waiting(self) -> bool:
        """Whether a call of ours is unanswered."""
        return any(f is not None and not f.done() for f in (self._reading and self._reading[0], self._polling,
                                                             self._committing))

    def read(self, first: int, remote_block_ids: list[int]) -> int | None:
        """The stage goes out; the blocks asked for (how many were read is known at ``poll``)."""
        if self._reading is not None or self._polling is not None:
            raise RuntimeError(f"a stage of {self.request_id!r} is read while another call is unanswered")
        fut = self.stub.MigrateRead.future(cluster_pb2.MigrateReadRequest(
            request_id=self.request_id, first_block=first, block_ids=remote_block_ids), timeout=self.timeout_s)
        self._reading = (fut, len(remote_block_ids))
        return len(remote_block_ids)

    def poll(self) -> str:
        if self._reading is not None:
            fut, asked = self._reading
            if not fut.done():
                return "PROC"
            self._reading = None
            r = self._answer(fut)
            if not r.accepted:  # no room there: the migration ends
                return "ERR"
            self.num_unread += asked - r.num_blocks_read
        if self._polling is None:
            self._polling = self.stub.MigratePoll.future(
                cluster_pb2.MigratePollRequest(request_id=self.request_id), timeout=self.timeout_s)
        if not self._polling.done():
            return "PROC"
        fut, self._polling = self._polling, None
        return _STATES.get(self._answer(fut).state, "ERR")

    def commit(self, h) -> bool | None:
        """True once the target runs the request, False if it refused; None while unanswered."""
        if self._committing is None:
            self._committing = self.stub.MigrateCommit.future(self.commit_message(h), timeout=self.timeout_s)
        if not self._committing.done():
            return None
        fut, self._committing = self._committing, None
        try:
            r = fut.result()
        except grpc.RpcError as e:
            log.warning("migration.commit_unanswered", request_id=self.request_id, code=e.code().name)
            return self.settle()
        if r.committed:
            self.epoch = r.epoch
        return r.committed

    def abort(self) -> None:
        """Tell the target to let go, not waiting for its answer (its lease ends it anyway)."""
        self.stub.MigrateAbort.future(cluster_pb2.MigrateAbortRequest(request_id=self.request_id),
                                      timeout=self.timeout_s)

    def _answer(self, fut):
        try:
            return fut.result()
        except grpc.RpcError as e:  # the target is gone: LiveMigration ends the migration
            raise ConnectionError(f"{self.request_id}: {e.code().name}") from e


class Migrations:
    """One worker's migrations, out (as the source) and in (as the target)."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.peer_agents: dict[str, str] = {}  # worker id -> its transport agent (met over KvPeer)
        self.receivers: dict[str, object] = {}  # request id -> its migration.MigrationReceiver
        self.committing: dict[str, object] = {}  # those whose MigrateCommit is under way
        self.num_migrated_out = 0  # migrations out that handed the request over
        self.num_in_flight = 0  # Migrate calls not yet answered
        # address -> (a stub on the event loop, a blocking one for the engine thread, their channels)
        self._stubs: dict[str, tuple[object, object, tuple]] = {}
        self._pump: asyncio.Task | None = None

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        for _, _, (aio_ch, sync_ch) in self._stubs.values():
            sync_ch.close()
            await aio_ch.close()

    def stubs(self, address: str) -> tuple[object, object]:
        """The target at ``address``: a stub for the event loop and a blocking one."""
        if address not in self._stubs:
            aio_ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            sync_ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._stubs[address] = (cluster_pb2_grpc.WorkerStub(aio_ch), cluster_pb2_grpc.WorkerStub(sync_ch),
                                    (aio_ch, sync_ch))
        return self._stubs[address][:2]

    # -- the source ---------------------------------------------------------------------------
    async def migrate(self, req: cluster_pb2.MigrateRequest) -> cluster_pb2.MigrateResponse:
        reason = REASONS.get(req.reason, "unspecified")
        t0 = time.perf_counter()
        self.num_in_flight += 1
        try:
            resp = await self._migrate(req)
        finally:
            self.num_in_flight -= 1
        outcome = next(k for k, v in OUTCOMES.items() if v == resp.outcome)
        self.w.metrics.migrations.labels(outcome=outcome, reason=reason).inc()
        if outcome == "migrated":
            self.num_migrated_out += 1
        log.info("migration.ended", request_id=req.request_id, target=req.target_worker_id, reason=reason,
                 outcome=outcome, num_stages=resp.num_stages, num_blocks_read=resp.num_blocks_read,
                 downtime_ms=round(resp.downtime_ms, 3), elapsed_ms=round((time.perf_counter() - t0) * 1e3, 3),
                 error=resp.error)
        return resp

    async def _migrate(self, req: cluster_pb2.MigrateRequest) -> cluster_pb2.MigrateResponse:
        w, rid = self.w, req.request_id
        if w.kv_transport is None:
            return _refused("this worker runs without KV transfer (--kv-transfer off)")
        if req.target_worker_id == w.worker_id or not req.target_address:
            return _refused("the target must be another worker, with its address")
        prompt = await asyncio.wrap_future(w.loop.call(
            lambda: list(r.prompt_token_ids) if (r := w.engine.requests.get(rid)) is not None else None))
        if prompt is None:
            return cluster_pb2.MigrateResponse(outcome=OUTCOMES["not_found"], error="not on this worker")
        if w.loop.is_migrating(rid):
            return _refused("it is migrating already")
        aio_stub, sync_stub = self.stubs(req.target_address)
        begin_request = cluster_pb2.MigrateBeginRequest(
            request_id=rid, source_worker_id=w.worker_id, prompt_token_ids=prompt,
            deadline_s=req.deadline_s or DEADLINE_S, lease_s=req.lease_s or LEASE_S)
        try:
            if req.target_worker_id not in self.peer_agents:
                await asyncio.wait_for(w.meet(req.target_address), RPC_TIMEOUT_S)
            begin = await aio_stub.MigrateBegin(begin_request, timeout=RPC_TIMEOUT_S)
            if not begin.accepted and NOT_MET in begin.error:
                # The target restarted under the same worker id (a container restarted in place)
                # and forgot this worker: meet it again, once.
                self.peer_agents.pop(req.target_worker_id, None)
                await asyncio.wait_for(w.meet(req.target_address), RPC_TIMEOUT_S)
                begin = await aio_stub.MigrateBegin(begin_request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            return _refused(f"the target did not answer: {e.code().name}: {e.details()}")
        except TimeoutError:
            return _refused("the target did not answer KvPeer in time")
        if not begin.accepted:
            return _refused(begin.error)
        from .migration import Lease, LiveMigration

        receiver = GrpcReceiver(sync_stub, rid, lambda h: self._commit_message(h), lambda: self._settle(rid))
        options = dict(final_stage_blocks=req.final_stage_blocks or FINAL_STAGE_BLOCKS,
                       max_stages=req.max_stages if req.HasField("max_stages") else MAX_STAGES,
                       lease=Lease.start(req.deadline_s or DEADLINE_S, req.lease_s or LEASE_S))

        def start():
            if rid not in w.engine.requests or w.loop.is_migrating(rid):
                return None
            return w.loop.migrate(LiveMigration(w.engine, rid, receiver, **options))

        fut = await asyncio.wrap_future(w.loop.call(start))
        if fut is None:
            await asyncio.to_thread(_quietly, receiver.abort)
            return cluster_pb2.MigrateResponse(outcome=OUTCOMES["not_found"], error="finished or moving meanwhile")
        try:
            stats = await asyncio.wrap_future(fut)
        except Exception as e:
            return cluster_pb2.MigrateResponse(outcome=OUTCOMES["failed"], error=f"{type(e).__name__}: {e}")
        return cluster_pb2.MigrateResponse(
            outcome=OUTCOMES[stats.outcome], num_stages=stats.num_stages, num_blocks_read=stats.num_blocks_read,
            num_bytes=stats.num_bytes, downtime_ms=stats.downtime_s * 1e3, epoch=receiver.epoch)

    def _commit_message(self, h) -> cluster_pb2.MigrateCommitRequest:
        """The handover with who owns the request here (on the engine thread)."""
        loop = self.w.loop
        entry_id, epoch, field = loop.assignment(h.request_id)
        return cluster_pb2.MigrateCommitRequest(
            request_id=h.request_id, prompt_token_ids=h.prompt_token_ids, output_token_ids=h.output_token_ids,
            sampling=to_proto(h.params), priority=h.priority, num_computed_tokens=h.num_computed_tokens,
            final_block_ids=h.final_block_ids, final_checksums=h.final_checksums, epoch=epoch,
            source_worker_id=self.w.worker_id, entry_id=entry_id, reply_to=field[2:] if field.startswith("o:") else "",
            record=loop.record_piece(h.request_id),
            traceparent=loop.observer.spans.traceparent(h.request_id) if loop.observer else "")

    def _settle(self, rid: str) -> bool:
        """The commit of ``rid`` went unanswered (on the engine thread): take it back in Redis.
        False if it is ours again (it runs on here, under a new epoch), True if the owner
        record moved on (the target has it: let it go)."""
        w = self.w
        _, epoch, _ = w.loop.assignment(rid)
        coro = move_owner(w.redis, w.keys, rid, epoch, w.worker_id, w.worker_id, w.writer.fencing.steps_key,
                          w.loop.record_piece(rid))
        try:
            new = asyncio.run_coroutine_threadsafe(coro, w.aio).result(SETTLE_TIMEOUT_S)
        except Exception:
            log.exception("migration.settle_failed", request_id=rid)
            return False  # a later final write of ours is refused if the target took it
        if new:
            w.loop.set_epoch(rid, new)
            return False
        return True

    # -- the target ---------------------------------------------------------------------------
    async def begin(self, req: cluster_pb2.MigrateBeginRequest) -> cluster_pb2.MigrateBeginResponse:
        w, rid = self.w, req.request_id
        if w.kv_transport is None:
            return _not_begun("this worker runs without KV transfer (--kv-transfer off)")
        if w.draining:
            return _not_begun("draining")
        peer = self.peer_agents.get(req.source_worker_id)
        if peer is None:
            return _not_begun(f"{req.source_worker_id!r} {NOT_MET} (KvPeer first)")
        if rid in self.receivers:
            return _not_begun(f"{rid!r} is migrating here already")
        from .migration import Lease, MigrationReceiver

        lease = Lease.start(req.deadline_s or DEADLINE_S, req.lease_s or LEASE_S)
        prompt = list(req.prompt_token_ids)
        try:
            recv = await asyncio.wrap_future(w.loop.call(
                lambda: MigrationReceiver(w.engine, w.kv_transport, peer, rid, prompt, lease=lease)))
        except ValueError as e:
            return _not_begun(str(e))
        self.receivers[rid] = recv
        log.info("migration.begun", request_id=rid, source=req.source_worker_id,
                 num_cached_blocks=recv.num_cached_blocks)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run_pump())
        return cluster_pb2.MigrateBeginResponse(accepted=True)

    async def read(self, req: cluster_pb2.MigrateReadRequest) -> cluster_pb2.MigrateReadResponse:
        recv = self.receivers.get(req.request_id)
        if recv is None:
            return cluster_pb2.MigrateReadResponse(accepted=False)
        ids = list(req.block_ids)
        try:
            n = await asyncio.wrap_future(self.w.loop.call(lambda: recv.read(req.first_block, ids)))
        except (ValueError, RuntimeError) as e:
            log.warning("migration.read_refused", request_id=req.request_id, error=str(e))
            n = None
        return cluster_pb2.MigrateReadResponse(accepted=n is not None, num_blocks_read=n or 0)

    def poll(self, req: cluster_pb2.MigratePollRequest) -> cluster_pb2.MigratePollResponse:
        recv = self.receivers.get(req.request_id)
        state = "ERR"
        if recv is not None and recv.state == "open":
            state = recv.poll()
        return cluster_pb2.MigratePollResponse(state=_STATE_PROTO[state])

    async def abort(self, req: cluster_pb2.MigrateAbortRequest) -> cluster_pb2.MigrateAbortResponse:
        recv = self.receivers.pop(req.request_id, None)
        if recv is None:
            return cluster_pb2.MigrateAbortResponse(found=False)
        await asyncio.wrap_future(self.w.loop.call(recv.abort))
        self.w.metrics.migrations_received.labels(outcome="aborted").inc()
        return cluster_pb2.MigrateAbortResponse(found=True)

    def drop_incoming(self, request_ids: list[str]) -> None:
        """The scheduler assigned these here afresh (it resumed them from their tokens): a
        migration of any of them still open here is over; its reservation is freed before the
        assignment runs (both on the engine thread, in this order), never shared with it."""
        if not self.receivers and not self.committing:
            return
        for rid in request_ids:
            recv = self.receivers.pop(rid, None) or self.committing.pop(rid, None)
            if recv is not None:  # a commit under way finds it aborted and answers false
                self.w.loop.call(recv.abort)
                self.w.metrics.migrations_received.labels(outcome="aborted").inc()
                log.info("migration.superseded", request_id=rid)

    async def commit(self, msg: cluster_pb2.MigrateCommitRequest) -> cluster_pb2.MigrateCommitResponse:
        """Verify, take the ownership over in Redis, run the request here (see the module docstring)."""
        w, rid = self.w, msg.request_id
        recv = self.receivers.pop(rid, None)
        if recv is None or recv.state != "open":
            return _not_committed(w, "no migration of it is open here (aborted or expired)")
        self.committing[rid] = recv
        try:
            return await self._commit(msg, recv)
        finally:
            self.committing.pop(rid, None)

    async def _commit(self, msg: cluster_pb2.MigrateCommitRequest, recv) -> cluster_pb2.MigrateCommitResponse:
        from .migration import Handover

        w, rid = self.w, msg.request_id
        call = w.loop.call
        try:
            while recv.poll() == "PROC":
                await asyncio.sleep(0.0002)
            h = Handover(rid, list(msg.prompt_token_ids), list(msg.output_token_ids), from_proto(msg.sampling),
                         msg.priority, msg.num_computed_tokens, list(msg.final_block_ids), list(msg.final_checksums))
            req = await asyncio.wrap_future(call(lambda: recv.verify(h)))
            if req is None:
                return _not_committed(w, "a read failed, a block is missing or a checksum differs")
            epoch = await move_owner(w.redis, w.keys, rid, msg.epoch, msg.source_worker_id, w.worker_id,
                                     w.writer.fencing.steps_key, msg.record)
            if not epoch:
                await asyncio.wrap_future(call(recv.abort))
                return _not_committed(w, "the request is no longer the source's (moved, cancelled or finished)")
            assign = cluster_pb2.AssignRequest(
                request_id=rid, entry_id=msg.entry_id, prompt_token_ids=msg.prompt_token_ids,
                output_token_ids=msg.output_token_ids, sampling=msg.sampling, priority=msg.priority, epoch=epoch,
                reply_to=msg.reply_to, traceparent=msg.traceparent)
            field = steps_field(msg.reply_to)
            await asyncio.wrap_future(call(lambda: (recv.adopt(req), w.loop.adopt(rid, msg.entry_id, epoch, field,
                                                                                 assign))))
        except BaseException:
            await asyncio.shield(asyncio.wrap_future(call(recv.abort)))
            raise
        w.metrics.migrations_received.labels(outcome="committed").inc()
        log.info("migration.received", request_id=rid, source=msg.source_worker_id, epoch=epoch,
                 num_output_tokens=len(msg.output_token_ids))
        return cluster_pb2.MigrateCommitResponse(committed=True, epoch=epoch)

    async def _run_pump(self) -> None:
        """Move the reads coming in along (NIXL without its progress thread: a read advances only
        while its reader progresses it) and reclaim the migrations whose lease or deadline passed."""
        checked = 0.0
        while self.receivers:
            busy = False
            for recv in list(self.receivers.values()):
                busy = recv.pump() or busy
            now = time.monotonic()
            if now - checked > 0.05:
                checked = now
                for rid, recv in list(self.receivers.items()):
                    if recv.state != "open" or recv.lease.expired(now):
                        expired = await asyncio.wrap_future(self.w.loop.call(recv.expire_if_due))
                        if expired or recv.state != "open":
                            self.receivers.pop(rid, None)
                        if expired:
                            self.w.metrics.migrations_received.labels(outcome="expired").inc()
                            log.warning("migration.expired", request_id=rid)
            await asyncio.sleep(0 if busy else 0.002)


def _refused(error: str) -> cluster_pb2.MigrateResponse:
    return cluster_pb2.MigrateResponse(outcome=OUTCOMES["refused"], error=error)


NOT_MET = "has not met this worker"  # a MigrateBegin refusal: the source meets the target again


def _not_begun(error: str) -> cluster_pb2.MigrateBeginResponse:
    return cluster_pb2.MigrateBeginResponse(accepted=False, error=error)


def _not_committed(w, error: str) -> cluster_pb2.MigrateCommitResponse:
    w.metrics.migrations_received.labels(outcome="aborted").inc()
    return cluster_pb2.MigrateCommitResponse(committed=False, error=error)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # the target may be gone: its reservation goes with it, or expires
        log.debug("migration.abort_unanswered", exc_info=True)
