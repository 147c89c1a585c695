"""The live scheduler carrying out the ledger's KV moves: ``Migrate`` calls to the sources.

The ledger decides (``Ledger.decide_moves``, a round's ``Decision.moves``); this sends each
``Transfer`` to its source as one ``Migrate`` call naming the target, renews the transfer's
lease in the ledger while the call is in flight (the source answers when the migration has
ended, which takes as long as the request's KV takes to copy), and takes the answer in:

* ``MIGRATED``: ``transfer_done`` (the target owns the request: it took it over in Redis).
  If the ledger had called the move off meanwhile, the target is told to drop it (the
  request was resumed elsewhere under a newer epoch: the target's writes are refused anyway).
* any other outcome: ``transfer_refused`` (the source keeps it); if the source's reports
  stopped naming it meanwhile, it is resumed from its tokens as any dropped request.
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


class TransferRunner:
    """``resume``: queue a request in the ledger's hand again from its tokens (the scheduler's
    ``_requeue``); ``worker_dead``: declare a worker dead; ``cancel``: tell a worker to drop a
    request (best effort); ``wake``: placement may gain."""

    def __init__(self, ledger: Ledger, metrics, *, resume: Callable[[Pending], Awaitable[None]],
                 worker_dead: Callable[[WorkerEntry, str], Awaitable[None]],
                 cancel: Callable[[WorkerEntry, str], None], wake: Callable[[], None]) -> None:
        self.ledger, self.metrics = ledger, metrics
        self.resume, self.worker_dead, self.cancel, self.wake = resume, worker_dead, cancel, wake
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
            self.cancel(t.target, t.request_id)

    async def _run(self, t: Transfer) -> None:
        rid, source = t.request_id, t.source
        msg = cluster_pb2.MigrateRequest(
            request_id=rid, target_worker_id=t.target.worker_id, target_address=t.target.address,
            reason=REASONS.get(t.reason, cluster_pb2.MIGRATE_REASON_UNSPECIFIED), deadline_s=MIGRATION_DEADLINE_S)
        log.info("transfer.started", request_id=rid, source=source.worker_id, target=t.target.worker_id,
                 reason=t.reason, num_blocks=t.num_blocks)
        renew = asyncio.create_task(self._renew(rid))
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
        finally:
            renew.cancel()
        if resp is None:
            return  # the deadline takes it back (tick), unless a death did already
        await self._answered(t, resp)

    async def _answered(self, t: Transfer, resp: cluster_pb2.MigrateResponse) -> None:
        rid = t.request_id
        outcome = cluster_pb2.MigrateOutcome.Name(resp.outcome).removeprefix("MIGRATE_OUTCOME_").lower()
        self._count(t, outcome)
        log.info("transfer.ended", request_id=rid, source=t.source.worker_id, target=t.target.worker_id,
                 reason=t.reason, outcome=outcome, num_stages=resp.num_stages, num_bytes=resp.num_bytes,
                 downtime_ms=round(resp.downtime_ms, 3), error=resp.error)
        if resp.outcome == cluster_pb2.MIGRATE_OUTCOME_MIGRATED:
            if not self.ledger.transfer_done(rid):  # called off meanwhile: it lives on elsewhere
                self.cancel(t.target, rid)
        elif self.ledger.transfer_refused(rid) and rid not in t.source.held:
            for p in self.ledger.dropped(t.source, [rid]):  # its source let it go meanwhile
                await self.resume(p)
        self.wake()

    async def _renew(self, rid: str) -> None:
        """Renew ``rid``'s transfer in the ledger while its Migrate call is in flight."""
        every = self.ledger.cfg.moves.timeout_s / 3
        with contextlib.suppress(asyncio.CancelledError):
            while self.ledger.renew_transfer(rid):
                await asyncio.sleep(every)

    def _count(self, t: Transfer, outcome: str) -> None:
        self.metrics.transfers.labels(reason=t.reason, outcome=outcome).inc()
