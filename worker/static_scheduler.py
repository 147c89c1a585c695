"""Static batching: the baseline continuous batching is measured against.

Built honestly, on the same model, kernels and block pool: take up to
``max_num_seqs`` waiting requests, pad every prompt to the batch's longest, reserve
``padded prompt + longest max_tokens`` slots per row up front, and run every row every
step (finished rows included, as padding) until the batch's longest request is done.
Only then is the next batch taken.
"""

from __future__ import annotations

from .batch_scheduler import BatchScheduler, SchedulerOutput
from .kv_cache_manager import KVCacheManager
from .policy import WaitingQueue
from .request import Request, RequestStatus


class StaticScheduler(BatchScheduler):
    """Never preempts and never swaps (its reservations cannot run out)."""

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int) -> None:
        super().__init__()
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.waiting = WaitingQueue()
        self.batch: list[Request] = []  # the rows of the batch in flight, finished ones included
        self._prefilled = False
        self._padded_len = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def remove(self, req: Request) -> None:
        # A finished or aborted row keeps its reserved blocks until the batch ends.
        if req in self.batch:
            self.release_if_done()
        else:
            self.waiting.remove(req)

    @property
    def running(self) -> list[Request]:
        return [r for r in self.batch if not r.is_finished]

    def has_unfinished(self) -> bool:
        return bool(self.batch) or bool(self.waiting)

    def schedule(self) -> SchedulerOutput:
        self.num_steps_total += 1
        self.release_if_done()
        if not self.batch and not self._take_batch():
            return SchedulerOutput()
        out = SchedulerOutput(num_padding_tokens=[])
        for req in self.batch:
            out.requests.append(req)
            if req.is_finished:  # a done row still costs a row until the batch ends
                out.num_scheduled_tokens.append(0)
                out.num_padding_tokens.append(1)
            elif not self._prefilled:
                n = req.num_tokens - req.num_computed_tokens
                out.num_scheduled_tokens.append(n)
                out.num_padding_tokens.append(self._padded_len - n)
            else:
                out.num_scheduled_tokens.append(1)
                out.num_padding_tokens.append(0)
        self._prefilled = True
        return out

    def _take_batch(self) -> bool:
        """Take rows in queue order while every row's reservation (padded prompt + longest
        ``max_tokens``, both over the rows taken so far) still fits the pool."""
        rows: list[Request] = []
        padded = max_tokens = 0
        while self.waiting and len(rows) < self.max_num_seqs:
            req = self.waiting.peek()
            p, m = max(padded, req.num_tokens), max(max_tokens, req.params.max_tokens)
            if (len(rows) + 1) * self.kv.num_blocks_for(p + m) > self.kv.num_free_blocks:
                break
            rows.append(self.waiting.pop())
            padded, max_tokens = p, m
        if not rows:
            if self.waiting:  # validation keeps every request within the pool on its own
                raise RuntimeError("the pool cannot hold one static row")
            return False
        for req in rows:
            if self.kv.allocate_slots(req.request_id, padded + max_tokens) is None:
                raise RuntimeError("static reservation failed after it was checked")
            req.status = RequestStatus.RUNNING
        self.batch = rows
        self._padded_len = padded
        self._prefilled = False
        return True

    def _release_batch(self) -> None:
        for req in self.batch:
            self.kv.free(req.request_id)
        self.batch = []

    def update_after_step(self, out: SchedulerOutput) -> None:
        for req, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            req.num_computed_tokens += n
        pads = out.num_padding_tokens or [0] * len(out.requests)
        for req, pad in zip(out.requests, pads, strict=True):
            if req.is_finished and pad:  # done rows' padding rows still fill slots
                req.num_computed_tokens += pad

    def release_if_done(self) -> None:
        """Hand the batch's blocks back once its last row has finished."""
        if self.batch and all(r.is_finished for r in self.batch):
            self._release_batch()
