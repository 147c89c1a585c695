"""Placement: which of the workers where a request fits gets it.

* ``least-loaded``: the best ``WorkerEntry.score`` (memory left after placing it, then
  fewer running sequences).
* ``round-robin``: the next worker by id after the one chosen last, among those that fit.
* ``prefix`` (the default; the SGLang router's cache-aware rule): **if the busiest and the
  idlest ready worker differ by more than ``balance_abs_threshold`` requests and by more
  than ``balance_rel_threshold`` times, least-loaded; otherwise the worker holding the
  longest run of the request's block keys if that run covers at least ``cache_threshold``
  of the request's blocks, else least-loaded.** A worker's load is ``WorkerEntry.load``,
  the requests placed there and not finished (current at every decision, unlike reports).

Admission comes first for every policy: only workers where the request fits are
candidates, and on each the blocks it would share with requests in flight there are taken
off its cost (see workers.py). A worker whose block size is not the one the request's keys
were computed with matches nothing. The index is a hint (prefix_index.py): a wrong guess
costs a cache miss, never a wrong answer.

Cost: the scheduler decides in rounds (``Placer.round``): the ready workers are put in a
heap by spare room once per round, and each decision takes the best of them that fits plus
the few workers the prefix index matched, instead of scanning every worker (O(log workers)
a decision when the pools are alike; tests/test_placement.py checks it against the scan).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagefleet.common.blocks import num_blocks_for

from .prefix_index import Match, PrefixIndex
from .queue import Pending
from .workers import WorkerEntry

PLACEMENTS = ("prefix", "least-loaded", "round-robin")
# Placement.decision: the longest cached prefix won; least-loaded won (the prefix was too
# short, or the policy is least-loaded); the workers were out of balance; round-robin's
# turn; placed by preempting others (the scheduler's pick_victims path, not a policy).
DECISIONS = ("cache", "load", "balance", "round-robin", "preempt")
_NO_MATCH = Match(0, 0)


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    policy: str = "prefix"
    balance_abs_threshold: int = 32  # requests
    balance_rel_threshold: float = 1.5  # busiest / idlest
    cache_threshold: float = 0.3  # matched blocks / the request's blocks

    def __post_init__(self) -> None:
        if self.policy not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache threshold must be between 0 and 1, got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds must be at least 0 (absolute) and 1 (relative), got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision: where, why, and what of the request's prefix is there already."""

    worker: WorkerEntry
    decision: str  # one of DECISIONS
    num_matched_blocks: int = 0  # leading blocks of the prompt the worker holds (per the index)
    num_shared_blocks: int = 0  # of those, blocks of requests in flight there (not taken from free)


class Placer:
    """Applies one placement policy; holds only round-robin's position."""

    def __init__(self, config: PlacementConfig, index: PrefixIndex) -> None:
        self.cfg = config
        self.index = index
        self._last_worker_id: str | None = None

    def choose(self, workers: Sequence[WorkerEntry], p: Pending, headroom_tokens: int) -> Placement | None:
        """Where ``p`` goes; None if it fits nowhere."""
        return self.round(workers).choose(p, headroom_tokens)

    def round(self, workers: Sequence[WorkerEntry]) -> Round:
        """Decisions over ``workers`` as they are now; see ``Round``."""
        return Round(self, workers)

    @staticmethod
    def _decided(w: WorkerEntry, decision: str, m: Match) -> Placement:
        return Placement(w, decision, m.num_matched_blocks, m.num_shared_blocks)

    def matches(self, workers: Sequence[WorkerEntry], p: Pending) -> dict[str, Match]:
        """The index's runs of ``p``'s keys on the workers of the keys' block size, at most
        the blocks before its last token (a worker computes that one again for its logits);
        workers with none of those blocks are left out (as holding nothing of it)."""
        keys = p.assign.block_hashes
        size = p.assign.hash_block_size
        limit = (p.num_tokens - 1) // size if size else 0
        if not keys or not limit:
            return {}
        found = self.index.match(keys)
        if not found:
            return {}
        return {w.worker_id: Match(min(m.num_matched_blocks, limit), min(m.num_shared_blocks, limit))
                for w in workers if (m := found.get(w.worker_id)) is not None and m.num_matched_blocks
                and w.block_size == size}

    def out_of_balance(self, workers: Sequence[WorkerEntry]) -> bool:
        loads = [w.load for w in workers if w.ready]
        return len(loads) >= 2 and self._unbalanced(max(loads), min(loads))

    def _unbalanced(self, busiest: int, idlest: int) -> bool:
        return (busiest - idlest > self.cfg.balance_abs_threshold
                and busiest > idlest * self.cfg.balance_rel_threshold)


class Round:
    """A run of decisions over the workers as they stand, without looking at every worker
    for every request: the ready workers sit in a heap by ``WorkerEntry.spare`` (the score's
    request-independent part when every worker has one pool size; otherwise each decision
    scans them), round-robin walks them by id, and the loads are counted once.

    Contract: between two ``choose`` calls only the placements it returned change the
    workers (each is claimed on its worker before the next call, nothing else runs): a
    worker's spare then only falls, so a heap entry found stale on top is pushed again with
    its current value. A round that outlives that (a report came in) gives wrong answers:
    the scheduler starts a new one every time it has waited.
    """

    def __init__(self, placer: Placer, workers: Sequence[WorkerEntry]) -> None:
        self.placer = placer
        self.cfg = placer.cfg
        self.ready = [w for w in workers if w.ready]
        self._order = {w.worker_id: i for i, w in enumerate(self.ready)}
        self._uniform = len({(w.pool_size, w.block_size) for w in self.ready}) <= 1
        self._heap = [(-w.spare, i, w) for i, w in enumerate(self.ready)]
        heapq.heapify(self._heap)
        self._max_available = max((w.num_available_blocks for w in self.ready), default=0)
        loads = [w.load for w in self.ready]
        self._loads = Counter(loads)
        self._busiest, self._idlest = max(loads, default=0), min(loads, default=0)
        self._by_id: list[WorkerEntry] | None = None  # round-robin's order, made when first needed

    def choose(self, p: Pending, headroom_tokens: int) -> Placement | None:
        """Where ``p`` goes; None if it fits nowhere."""
        placement = self._choose(p, headroom_tokens)
        if placement is not None:
            self._loaded(placement.worker)
        return placement

    def _choose(self, p: Pending, headroom_tokens: int) -> Placement | None:
        matches = self.placer.matches(self.ready, p)
        total = p.num_tokens + p.num_remaining_tokens
        need = p.num_tokens + min(p.num_remaining_tokens, headroom_tokens)
        sizes: dict[int, int] = {}

        def taken(w: WorkerEntry, shared: int) -> int:
            bs = w.block_size
            if bs not in sizes:
                sizes[bs] = num_blocks_for(need, bs)
            return sizes[bs] - shared

        def fits(w: WorkerEntry, m: Match) -> bool:
            return w.has_room(total, taken(w, m.num_shared_blocks))

        if self.cfg.policy == "round-robin":
            w = self._next_in_turn(lambda w: fits(w, matches.get(w.worker_id, _NO_MATCH)))
            if w is None:
                return None
            self.placer._last_worker_id = w.worker_id
            return self.placer._decided(w, "round-robin", matches.get(w.worker_id, _NO_MATCH))
        # The candidates: every worker holding part of the prompt, and the best of the others.
        cands = [(w, m) for wid, m in matches.items() if fits(w := self.ready[self._order[wid]], m)]
        other = self._best_other(matches, lambda w: fits(w, _NO_MATCH), need)
        if other is not None:
            cands.append((other, _NO_MATCH))
        if not cands:
            return None

        def score(c: tuple[WorkerEntry, Match]) -> tuple[float, int]:
            w, m = c
            return w.score_after(taken(w, m.num_shared_blocks)), -self._order[w.worker_id]

        least = max(cands, key=score)
        if self.cfg.policy == "least-loaded":
            return self.placer._decided(least[0], "load", least[1])
        if len(self.ready) >= 2 and self.placer._unbalanced(self._busiest, self._idlest):
            return self.placer._decided(least[0], "balance", least[1])
        best = max(cands, key=lambda c: (c[1].num_matched_blocks, score(c)))
        num_matched = best[1].num_matched_blocks
        if num_matched and num_matched >= self.cfg.cache_threshold * len(p.assign.block_hashes):
            return self.placer._decided(best[0], "cache", best[1])
        return self.placer._decided(least[0], "load", least[1])

    def _best_other(self, matches: dict[str, Match], fits, need_tokens: int) -> WorkerEntry | None:
        """The best-scoring worker that fits and holds none of the prompt (None if none does)."""
        if not self._uniform:  # pool sizes differ: the order depends on the request; look at all
            others = [w for w in self.ready if w.worker_id not in matches and fits(w)]
            return max(others, key=lambda w: (w.score_after(0), -self._order[w.worker_id]), default=None)
        if self.ready and num_blocks_for(need_tokens, self.ready[0].block_size) > self._max_available:
            return None  # nobody has room (one block size; the bound only falls during a round)
        heap, aside, found = self._heap, [], None
        while heap:
            key, i, w = heap[0]
            spare = w.spare
            if -key != spare:  # placed on since it was pushed: its spare fell
                heapq.heapreplace(heap, (-spare, i, w))
                continue
            if w.worker_id not in matches and fits(w):
                found = w
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _next_in_turn(self, fits) -> WorkerEntry | None:
        """The first worker that fits, by id, after the one chosen last (wrapping around)."""
        if self._by_id is None:
            self._by_id = sorted(self.ready, key=lambda w: w.worker_id)
        ids = [w.worker_id for w in self._by_id]
        last = self.placer._last_worker_id
        start = bisect.bisect_right(ids, last) if last is not None else 0
        n = len(self._by_id)
        for k in range(n):
            w = self._by_id[(start + k) % n]
            if fits(w):
                return w
        return None

    def _loaded(self, w: WorkerEntry) -> None:
        """``w`` is about to take one more request: count it in the loads."""
        before = w.load
        loads = self._loads
        loads[before] -= 1
        loads[before + 1] += 1
        self._busiest = max(self._busiest, before + 1)
        while loads[self._idlest] <= 0 and self._idlest < self._busiest:
            self._idlest += 1
