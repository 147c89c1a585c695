"""Iteration-level scheduling: every step is rebuilt from scratch.

``schedule()`` hands out a token budget: running requests' decode tokens first, then
the rest of partially prefilled prompts, then waiting requests' prompt chunks. When a
running request cannot get a block, the policy picks a victim, whose blocks are freed
and who goes back to the waiting queue to be recomputed. The step is plain data
(``SchedulerOutput``); the model runner turns it into tensors, and
``update_from_output`` applies the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .policy import WaitingQueue, pick_victim
from .request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step. ``requests[i]`` computes ``num_scheduled_tokens[i]`` of its missing tokens.

    ``num_padding_tokens[i]`` (static batching only) extra rows follow them: computed,
    never written to the cache, their outputs dropped.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_padding_tokens: list[int] | None = None
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        pad = sum(self.num_padding_tokens) if self.num_padding_tokens else 0
        return sum(self.num_scheduled_tokens) + pad

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption."""

    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self._admit_counter = 0

    # -- queue membership ---------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of every queue and free its blocks (abort or finish)."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # -- the step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decode rows first, then requests still catching up on their prompt.
        decodes, prefills = [], []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        scheduled: set[int] = set()
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is None:
                victim = pick_victim(r for r in self.running if id(r) not in scheduled)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.add(id(req))
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is None:
                break  # FCFS: nobody jumps the head of the queue
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self._admit_counter += 1
            req.admit_seq = self._admit_counter
            req.resumed_at_step = self.num_steps
            self.running.append(req)
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the victim's blocks and queue it again."""
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim)
        out.preempted.append(victim)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` for everything the step ran."""
        for req, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            req.num_computed_tokens += n
