"""The live scheduler carrying out the ledger's KV moves: ``Migrate`` calls to the sources.

The ledger decides (``Ledger.decide_moves``, a round's ``Decision.moves``); this sends each
``Transfer`` to its source as one ``Migrate`` call naming the target, renews the transfer's
lease in the ledger while the call is in flight (the source answers when the migration has
ended, which takes as long as the request's KV takes to copy), and takes the answer in:

* ``MIGRATED``: ``transfer_done`` (the target owns the request: it took it over in Redis).
  If the ledger had called the move off meanwhile (the target died), the target is told to
  drop it, and the request resumes from its tokens elsewhere (a resume fences it: the
  target's writes are refused from then on).
* any other outcome: ``transfer_refused`` (the source keeps it).
* either way, a request its source's reports stopped naming is resumed from its tokens, as
  any dropped request (``Ledger.dropped``; before the answer, the ledger keeps such a request
  in transfer: its source lets it go at the handover).
* no answer (the source is unreachable): the source is declared dead (its requests, this one
  included, resume elsewhere from their tokens); a call that outlived its deadline stops
  renewing, and ``tick`` takes the expired transfer back from both sides.

Every transfer is counted in ``pagefleet:scheduler_transfers{reason,outcome}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import grpc
import structlog

from pagefleet.common.handover import owner_of
from pagefleet.common.redis import Keys
from pagefleet.protos import cluster_pb2

from .ledger import Ledger
from .moves import Transfer
from .queue import Pending
from .workers import WorkerEntry

log = structlog.get_logger("scheduler.transfers")

REASONS = {
    "balance": cluster_pb2.MIGRATE_REASON_BALANCE,
    "preemption": cluster_pb2.MIGRATE_REASON_PREEMPTION,
    "disaggregation": cluster_pb2.MIGRATE_REASON_DISAGGREGATION,
    "drain": cluster_pb2.MIGRATE_REASON_DRAIN,
}
# The whole migration's deadline the source is given (seconds); the call waits a little longer.
MIGRATION_DEADLINE_S = 30.0
DROP_WAIT_S = 1.0  # how long a resume waits for the drop at a move's target (TransferRunner.handed_over)


class TransferRunner:
    """``resume``: queue a request in the ledger's hand again from its tokens (the scheduler's
    ``_requeue``); ``worker_dead``: declare a worker dead; ``cancel``: tell a worker to drop a
    request (best effort); ``wake``: placement may gain."""

    def __init__(self, ledger: Ledger, metrics, redis, keys: Keys, *, resume: Callable[[Pending], Awaitable[None]],
                 worker_dead: Callable[[WorkerEntry, str], Awaitable[None]],
                 cancel: Callable[[WorkerEntry, str], None], wake: Callable[[], None],
                 cancel_now: Callable[[WorkerEntry, str], Awaitable[object]] | None = None) -> None:
        """``cancel``: tell a worker to drop a request, in the background; ``cancel_now``: the
        same, awaited (before the request is placed again: it may land on that worker)."""
        self.ledger, self.metrics, self.redis, self.keys = ledger, metrics, redis, keys
        self._counted: set[int] = set()  # ids of the transfers whose outcome was counted
        self._settling: set[str] = set()  # requests whose source died mid-transfer, Redis not yet asked
        self.resume, self.worker_dead, self.cancel, self.wake = resume, worker_dead, cancel, wake
        self.cancel_now = cancel_now
        self._calls: set[asyncio.Task] = set()
        self._prefilled: dict[str, set[str]] = {}  # prefill worker id -> the prefilled requests it named

    def start(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            task = asyncio.create_task(self._run(t), name=f"migrate-{t.request_id}")
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    def prefilled(self, w: WorkerEntry, request_ids) -> None:
        """``w`` (role prefill) reports these requests prefilled: start the handoffs to decode
        workers the ledger decides for those it names for the first time (the others wait in the
        ledger for a decode worker with room: ``decide_moves`` starts them)."""
        seen = self._prefilled.get(w.worker_id, set())
        now = set(request_ids)
        for rid in request_ids:
            if rid not in seen:
                self.start(self.ledger.prefilled(rid))
        self._prefilled[w.worker_id] = now

    def moving_from(self, w: WorkerEntry) -> dict[str, Transfer]:
        """The transfers in flight out of ``w``, by request id (taken before it is declared dead;
        each is being settled until ``handed_over`` has looked it up)."""
        moving = {rid: t for rid, t in self.ledger.transfers.items() if t.source is w}
        self._settling.update(moving)
        return moving

    async def handed_over(self, p: Pending, moving: dict[str, Transfer]) -> bool:
        """``p``'s source died while moving it (``moving``: ``moving_from`` the source): if Redis
        names the transfer's target its owner, the handover landed and ``p`` is placed there
        (True); else it resumes from its tokens as any request of a dead worker (False)."""
        t = moving.get(p.request_id)
        if t is None:
            return False
        try:
            worker, _ = await owner_of(self.redis, self.keys, p.request_id)
        finally:
            self._settling.discard(p.request_id)
        if worker != t.target.worker_id or not self.ledger.handover_found(p, t.target):
            # Waited for: the request resumes next and may be placed on this very target; a drop
            # sent in the background landed after that assignment and cancelled it (a review's
            # runs: resumed requests stalled until the finish went unconfirmed, 3-6 s).
            await self._drop_at_target_now(t)
            self._count(t, "source_died")
            log.info("transfer.ended", request_id=p.request_id, source=t.source.worker_id, target=t.target.worker_id,
                     reason=t.reason, outcome="source_died")
            return False
        self._count(t, "migrated")
        log.info("transfer.handed_over", request_id=p.request_id, source=t.source.worker_id,
                 target=t.target.worker_id, reason=t.reason)
        return True

    async def close(self) -> None:
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    async def tick(self) -> None:
        """Take back the transfers past their deadline (both sides drop the request; it resumes
        from its tokens) and tell the targets of the moves called off to drop what they got."""
        for t in self.ledger.expired_transfers():
            self._count(t, "expired")
            log.warning("transfer.expired", request_id=t.request_id, source=t.source.worker_id,
                        target=t.target.worker_id)
            for w in (t.source, t.target):
                self.cancel(w, t.request_id)
            await self.resume(t.pending)
        for t in self.ledger.called_off():
            self._drop_at_target(t)

    async def _run(self, t: Transfer) -> None:
        rid, source = t.request_id, t.source
        msg = cluster_pb2.MigrateRequest(
            request_id=rid, target_worker_id=t.target.worker_id, target_address=t.target.address,
            reason=REASONS.get(t.reason, cluster_pb2.MIGRATE_REASON_UNSPECIFIED), deadline_s=MIGRATION_DEADLINE_S)
        log.info("transfer.started", request_id=rid, source=source.worker_id, target=t.target.worker_id,
                 reason=t.reason, num_blocks=t.num_blocks)
        renew = asyncio.create_task(self._renew(rid))
        try:
            await self._call(t, msg)
        finally:
            renew.cancel()
            self._counted.discard(id(t))

    async def _call(self, t: Transfer, msg: cluster_pb2.MigrateRequest) -> None:
        rid, source = t.request_id, t.source
        try:
            resp = await source.stub.Migrate(msg, timeout=MIGRATION_DEADLINE_S + 10)
        except grpc.RpcError as e:
            resp = None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                await self.worker_dead(source, f"Migrate failed: {e.code().name}")
            else:
                log.warning("transfer.unanswered", request_id=rid, code=e.code().name)
        except asyncio.CancelledError:
            if source.alive:
                raise
            return  # its channel closed under the call: declared dead meanwhile
        if resp is not None:
            await self._answered(t, resp)
        # Unless still in flight (the deadline takes it back: tick), a request its source let go
        # (at a handover the ledger had called off meanwhile, or dropped) resumes from its tokens.
        if self.ledger.transfers.get(t.request_id) is None and t.request_id not in t.source.held:
            for p in self.ledger.dropped(t.source, [t.request_id]):
                await self.resume(p)

    async def _answered(self, t: Transfer, resp: cluster_pb2.MigrateResponse) -> None:
        rid = t.request_id
        outcome = cluster_pb2.MigrateOutcome.Name(resp.outcome).removeprefix("MIGRATE_OUTCOME_").lower()
        self._count(t, outcome)
        log.info("transfer.ended", request_id=rid, source=t.source.worker_id, target=t.target.worker_id,
                 reason=t.reason, outcome=outcome, num_stages=resp.num_stages, num_bytes=resp.num_bytes,
                 downtime_ms=round(resp.downtime_ms, 3), error=resp.error)
        current = self.ledger.transfers.get(rid) is t  # not called off (and no newer move of it started)
        if resp.outcome == cluster_pb2.MIGRATE_OUTCOME_MIGRATED:
            if not current or not self.ledger.transfer_done(rid):  # called off meanwhile: it resumes elsewhere
                self._drop_at_target(t)
        elif current:
            self.ledger.transfer_refused(rid)
        self.wake()

    async def _drop_at_target_now(self, t: Transfer) -> None:
        """``_drop_at_target``, waited for (``DROP_WAIT_S`` at most: a target slow to answer is
        left to answer in the background, as the others' requests resume)."""
        if self.cancel_now is None or not t.target.alive:
            self._drop_at_target(t)  # (a target declared dead is told nothing)
        elif self._to_drop(t):
            call = asyncio.ensure_future(self.cancel_now(t.target, t.request_id))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(call), DROP_WAIT_S)

    def _drop_at_target(self, t: Transfer) -> None:
        """Tell ``t``'s target to drop what it received of a move called off (best effort: once
        the request resumes elsewhere under a newer epoch, the target's writes are refused
        anyway)."""
        if self._to_drop(t):
            self.cancel(t.target, t.request_id)

    def _to_drop(self, t: Transfer) -> bool:
        """Whether ``t``'s target is to drop its request: not if it lives on there (a handover
        found in Redis) or may (its source's death not yet settled)."""
        rid = t.request_id
        return self.ledger.where.get(rid) != t.target.worker_id and rid not in self._settling

    async def _renew(self, rid: str) -> None:
        """Renew ``rid``'s transfer in the ledger while its Migrate call is in flight."""
        every = self.ledger.cfg.moves.timeout_s / 3
        with contextlib.suppress(asyncio.CancelledError):
            while self.ledger.renew_transfer(rid):
                await asyncio.sleep(every)

    def _count(self, t: Transfer, outcome: str) -> None:
        """Count ``t``'s outcome once (its source's death and its answer may both settle it)."""
        if id(t) not in self._counted:
            self._counted.add(id(t))
            self.metrics.transfers.labels(reason=t.reason, outcome=outcome).inc()
