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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        matches = self.matches(workers, p)

        def match(w: WorkerEntry) -> Match:
            return matches.get(w.worker_id, _NO_MATCH)

        fitting = [w for w in workers if w.fits(p, headroom_tokens, match(w).num_shared_blocks)]
        if not fitting:
            return None
        if self.cfg.policy == "round-robin":
            w = self._next_in_turn(fitting)
            self._last_worker_id = w.worker_id
            return self._decided(w, "round-robin", match(w))
        scores = {w.worker_id: w.score(p, headroom_tokens, match(w).num_shared_blocks) for w in fitting}
        least = max(fitting, key=lambda w: scores[w.worker_id])
        if self.cfg.policy == "least-loaded":
            return self._decided(least, "load", match(least))
        if self.out_of_balance(workers):
            return self._decided(least, "balance", match(least))
        best = max(fitting, key=lambda w: (match(w).num_matched_blocks, scores[w.worker_id]))
        num_matched = match(best).num_matched_blocks
        if num_matched and num_matched >= self.cfg.cache_threshold * len(p.assign.block_hashes):
            return self._decided(best, "cache", match(best))
        return self._decided(least, "load", match(least))

    @staticmethod
    def _decided(w: WorkerEntry, decision: str, m: Match) -> Placement:
        return Placement(w, decision, m.num_matched_blocks, m.num_shared_blocks)

    def matches(self, workers: Sequence[WorkerEntry], p: Pending) -> dict[str, Match]:
        """The index's runs of ``p``'s keys on the workers of the keys' block size, at most
        the blocks before its last token (a worker computes that one again for its logits)."""
        keys = p.assign.block_hashes
        size = p.assign.hash_block_size
        if not keys or not size:
            return {}
        found = self.index.match(keys)
        if not found:
            return {}
        limit = (p.num_tokens - 1) // size
        return {w.worker_id: Match(min(m.num_matched_blocks, limit), min(m.num_shared_blocks, limit))
                for w in workers if (m := found.get(w.worker_id)) is not None and w.block_size == size}

    def out_of_balance(self, workers: Sequence[WorkerEntry]) -> bool:
        loads = [w.load for w in workers if w.ready]
        if len(loads) < 2:
            return False
        busiest, idlest = max(loads), min(loads)
        return (busiest - idlest > self.cfg.balance_abs_threshold
                and busiest > idlest * self.cfg.balance_rel_threshold)

    def _next_in_turn(self, fitting: list[WorkerEntry]) -> WorkerEntry:
        last = self._last_worker_id
        after = [w for w in fitting if last is not None and w.worker_id > last]
        return min(after or fitting, key=lambda w: w.worker_id)
