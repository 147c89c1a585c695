"""Iteration-level scheduling: every step is rebuilt from scratch.

``schedule()`` hands out a token budget: running requests' decode tokens first, then
the rest of partially prefilled prompts, then waiting requests' prompt chunks. When a
running request cannot get a block, the policy picks a victim and chooses how to
preempt it: *swap* (its blocks are copied to the CPU swap pool; it comes back, with its
K/V, before any new admission once free blocks exceed its need plus a watermark) or
*recompute* (its blocks are freed and it goes back to the waiting queue). The step is
plain data (``SchedulerOutput``, with the block copies the engine runs before the
model); the model runner turns it into tensors, and ``update_after_step`` advances it.

A swapped-in sequence is copied back in the step that decides it and runs from the
next step on, so the copy overlaps a forward on devices that can do both.

Prefix caching (when the KV manager has it on): a request admitted from the waiting
queue (new, or preempted by recompute) starts with ``num_computed_tokens`` at its cached
prefix, whole blocks, short of its last token; its blocks are cached as they fill with
computed tokens (``update_after_step``). Shared blocks and swap: a swapped victim copies
out its blocks from the first one it alone holds (reference count 1) on; its leading
shared blocks are not copied, and it drops its references to them like to the rest, so
a swapped sequence holds no device block. On swap-in it looks their keys up again; if
one was evicted meanwhile, its swap copy is dropped and it is recomputed instead (from
whatever is still cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .batch_scheduler import BatchScheduler, SchedulerOutput
from .kv_cache_manager import KVCacheManager, PrefixMatch
from .policy import PreemptionPolicy, WaitingQueue, pick_victim, queue_key
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .cost_model import CostModel
    from .swap import SwapAllocator


class ContinuousScheduler(BatchScheduler):
    """Continuous batching with chunked prefill and preemption by swap or recompute.

    Without ``swap`` (the swap pool's allocator) every preemption is a recompute.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        swap: SwapAllocator | None = None,
        policy: PreemptionPolicy | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        super().__init__()
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap = swap
        self.policy = policy or PreemptionPolicy()
        self.cost_model = cost_model
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.swapped = WaitingQueue()  # in the swap pool only
        self.swapping_in: list[Request] = []  # copies issued; in both pools until next step
        self._admit_counter = 0
        self._pending = SchedulerOutput()  # directed preemptions, shipped with the next step

    # -- queue membership ---------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of every queue and free its blocks in both pools (abort or finish)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.swapping_in:
            self.swapping_in.remove(req)
        elif not self.swapped.remove(req):
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        if self.swap is not None:
            self.swap.free(req.request_id)

    @property
    def num_swapped(self) -> int:
        """Sequences whose K/V is in the swap pool (swapping in included)."""
        return len(self.swapped) + len(self.swapping_in)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self.swapping_in)

    # -- the step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps_total += 1
        out, self._pending = self._pending, SchedulerOutput()
        self._finish_swap_ins()
        budget = self.max_num_batched_tokens
        # Decode rows first, then requests still catching up on their prompt.
        decodes, prefills = [], []
        for r in self.running:
            (decodes if len(r.all_token_ids) - r.num_computed_tokens == 1 else prefills).append(r)
        kv, requests, counts = self.kv, out.requests, out.num_scheduled_tokens
        if not prefills and len(decodes) <= budget and self._decode_all(decodes, out):
            budget -= len(decodes)
            self._admit(out, budget, [])
            return out
        scheduled: set[int] = set()
        chunks: list[tuple[Request, int]] = []  # prompt chunks of this step (they may fill blocks)
        pressure = False
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            fits = kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is not None
            while not fits:
                pressure = True
                victim = pick_victim(
                    (r for r in self.running if id(r) not in scheduled),
                    step=self.num_steps_total,
                    min_resident_steps=self.policy.min_resident_steps,
                )
                if victim is None:  # all protected: req sits this step out, keeping its blocks
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
                fits = kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is not None
            if not fits:
                continue
            scheduled.add(id(req))
            requests.append(req)
            counts.append(n)
            budget -= n
            if n > 1:
                chunks.append((req, n))
        if not pressure:
            self._admit(out, budget, chunks)
        return out

    def _decode_all(self, decodes: list[Request], out: SchedulerOutput) -> bool:
        """Steady decoding, the common step: every running request computes one token.

        Only requests whose next token starts a new block need one; if the pool has them
        all, schedule everyone in one pass (no victims to pick). False: take the full path.
        """
        kv, bs = self.kv, self.kv.block_size
        tables = kv.block_tables
        grow = [r for r in decodes if len(tables.get(r.request_id, ())) * bs <= r.num_computed_tokens]
        if not kv.pool.can_allocate(len(grow)):
            return False
        for r in grow:
            kv.allocate_slots(r.request_id, r.num_computed_tokens + 1)
        out.requests.extend(decodes)
        out.num_scheduled_tokens.extend([1] * len(decodes))
        return True

    def _admit(self, out: SchedulerOutput, budget: int, chunks: list[tuple[Request, int]]) -> None:
        """Bring back swapped sequences and admit waiting ones, in ``queue_key`` order.

        A swapped sequence is older than any new arrival of its priority, so it comes
        back first; while the head cannot come back, nobody behind it is admitted.

        ``chunks``: this step's prompt chunks so far. A waiting request whose next uncached
        block one of them fills sits this step out, keeping its place, and finds the block
        cached next step instead of computing it a second time; the requests behind it
        may go (SGLang's in-batch prefix caching): a burst of prompts with one prefix
        computes it once. At most ``max_num_seqs`` sit out per step.
        """
        deferred: list[Request] = []
        self._admit_in_order(out, budget, chunks, deferred)
        for req in deferred:
            self.waiting.push(req)

    def _admit_in_order(self, out: SchedulerOutput, budget: int, chunks: list[tuple[Request, int]],
                        deferred: list[Request]) -> None:
        swapping_out = bool(out.blocks_to_swap_out)  # never both ways in one step
        while len(self.running) + len(self.swapping_in) < self.max_num_seqs:
            head_s, head_w = self.swapped.peek(), self.waiting.peek()
            if head_s is not None and (head_w is None or queue_key(head_s) <= queue_key(head_w)):
                if swapping_out or not self._swap_in(head_s, out):
                    return
                continue
            if head_w is None or budget == 0:
                return
            req = head_w
            prefix = self.kv.match_prefix(req)  # waiting: nothing computed yet
            if self._filled_now(req, prefix, chunks):
                if len(deferred) == self.max_num_seqs:
                    return
                deferred.append(self.waiting.pop())
                continue
            n = min(req.num_tokens - prefix.num_tokens, budget)
            if self.kv.allocate_slots(req.request_id, prefix.num_tokens + n, prefix) is None:
                return  # FCFS: nobody jumps the head of the queue
            self.waiting.pop()
            req.num_computed_tokens = prefix.num_tokens
            if n > 1:
                chunks.append((req, n))
            req.status = RequestStatus.RUNNING
            self._admit_counter += 1
            req.admit_seq = self._admit_counter
            req.resumed_at_step = self.num_steps_total
            self.running.append(req)
            out.requests.append(req)
            out.num_scheduled_tokens.append(n)
            budget -= n

    def _filled_now(self, req: Request, prefix: PrefixMatch, chunks: list[tuple[Request, int]]) -> bool:
        """Whether one of ``chunks`` fills the first block of ``req`` not in ``prefix``
        (one ``req`` would compute: not its last token's)."""
        num_hits = len(prefix.block_ids)
        if not self.kv.enable_caching or num_hits >= (req.num_tokens - 1) // self.kv.block_size:
            return False
        key = req.block_hashes[num_hits]  # match_prefix made the keys up to there
        return any(key in self.kv.keys_filled(r, m) for r, m in chunks)

    def _preempt(self, victim: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        """Take ``victim`` off the device: swap it out if the policy (or ``mode``) says so, else recompute."""
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        if self._choose(victim, mode) == "swap":
            self._swap_out(victim, out)
            return
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        self.num_recomputes_total += 1
        self.waiting.push(victim)

    def _choose(self, victim: Request, mode: str | None) -> str:
        if self.swap is None:
            return "recompute"
        policy = self.policy
        if mode is not None and mode != policy.mode:
            policy = PreemptionPolicy(mode, policy.watermark, policy.min_resident_steps)
        first, end = self._own_blocks(victim)
        return policy.choose(
            end - first,
            victim.num_computed_tokens - first * self.kv.block_size,
            swap_has_room=self.swap.can_allocate(end - first),
            cost_model=self.cost_model,
        )

    def _own_blocks(self, req: Request) -> tuple[int, int]:
        """The range of ``req``'s computed blocks a swap-out copies: from the first block
        no other sequence holds to its last computed one."""
        end = self.kv.num_blocks_for(req.num_computed_tokens)
        return self.kv.num_shared_prefix_blocks(req.request_id, end), end

    def _swap_out(self, victim: Request, out: SchedulerOutput) -> None:
        rid = victim.request_id
        first, end = self._own_blocks(victim)
        device_ids = self.kv.block_tables[rid][first:end]
        swap_ids = self.swap.allocate(rid, end - first)
        out.blocks_to_swap_out.extend(zip(device_ids, swap_ids, strict=True))
        # Freed now, reused this step: the engine copies them out before the model runs.
        self.kv.free(rid)
        self.num_swapped_out_blocks_total += end - first
        victim.status = RequestStatus.SWAPPED
        self.swapped.push(victim)

    def _swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        """Start copying ``req`` back if the policy lets it; False (nothing changed) if not.

        Its shared blocks, not copied out, are looked up again; if one is gone, ``req`` goes
        to the waiting queue to be recomputed instead (True: the queues changed).
        """
        rid, kv = req.request_id, self.kv
        swap_ids = self.swap.block_tables[rid]
        num_shared = kv.num_blocks_for(req.num_computed_tokens) - len(swap_ids)
        prefix = kv.match_prefix(req, num_shared) if num_shared else None
        if prefix is not None and len(prefix.block_ids) < num_shared:
            self._recompute_swapped(req)
            return True
        need = kv.num_new_blocks(rid, req.num_computed_tokens + 1, prefix)
        idle = not self.running and not self.swapping_in
        if not self.policy.can_swap_in(kv.num_free_blocks, need, kv.num_blocks, idle=idle):
            return False
        device_ids = kv.allocate_slots(rid, req.num_computed_tokens, prefix)
        out.blocks_to_swap_in.extend(zip(swap_ids, device_ids, strict=True))
        self.num_swapped_in_blocks_total += len(swap_ids)
        self.swapped.remove(req)
        req.status = RequestStatus.SWAPPING_IN
        self.swapping_in.append(req)
        return True

    def _recompute_swapped(self, req: Request) -> None:
        """Drop a swapped sequence's copy: it waits to be recomputed."""
        self.swap.free(req.request_id)
        self.swapped.remove(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_recomputes_total += 1
        self.waiting.push(req)

    def _finish_swap_ins(self) -> None:
        """Last step's swap-ins have landed: release their swap blocks, cache their full
        blocks (not before: until now a hit could read a block still being copied), run."""
        caching = self.kv.enable_caching
        for req in self.swapping_in:
            self.swap.free(req.request_id)
            if caching:
                self.kv.cache_blocks(req)
            req.status = RequestStatus.RUNNING
            req.resumed_at_step = self.num_steps_total
            self.running.append(req)
        self.swapping_in.clear()

    def preempt(self, req: Request, mode: str | None = None) -> bool:
        """Directed preemption of a running (or swapping-in) request, outside ``schedule``.

        Its blocks are freed now; the copies go out with the next step. False if the
        request is not on the device.
        """
        if req in self.swapping_in:  # its swap blocks still hold the K/V: just go back
            self.swapping_in.remove(req)
            self.kv.free(req.request_id)
            req.status = RequestStatus.SWAPPED
            self.swapped.push(req)
            return True
        if req not in self.running:
            return False
        self._preempt(req, self._pending, mode)
        return True

    def detach(self, req: Request) -> bool:
        """Take a running request out of the queues, keeping its blocks (a migration's final
        stage: nothing may write them while they are read). False if it is not running."""
        if req not in self.running:
            return False
        self.running.remove(req)
        return True

    def attach(self, req: Request) -> None:
        """Run ``req``, whose table holds its ``num_computed_tokens`` (detached, or moved in)."""
        req.status = RequestStatus.RUNNING
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.resumed_at_step = self.num_steps_total
        self.running.append(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` for everything the step ran; cache the blocks it filled."""
        pairs = zip(out.requests, out.num_scheduled_tokens, strict=True)
        if not self.kv.enable_caching:
            for req, n in pairs:
                req.num_computed_tokens += n
            return
        bs, cache = self.kv.block_size, self.kv.cache_blocks
        for req, n in pairs:
            c = req.num_computed_tokens = req.num_computed_tokens + n
            if c % bs < n:  # the step reached the end of a block
                cache(req)
