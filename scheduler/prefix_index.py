"""The global prefix index: which workers hold which block keys. A hint, never the truth.

Two kinds of holding, one answer:

* **cached**: the worker's reports said it stored the key (``stored_block_hashes``) and
  have not said it evicted it (``evicted_block_hashes``); ``block_hashes_reset`` replaces
  all of a worker's cached keys. Bounded: at most ``max_keys`` keys; past that, the least
  recently stored or placed go, 1/16 of the bound at a time. A batch is stored tail first,
  so a prompt's first blocks outlive its last ones: the chain breaks at the end, where it
  costs least.
* **in flight**: the keys of the prompts of requests placed on the worker and not finished
  (``hold`` at placement, ``release`` when they leave). This is the optimistic record: a
  burst of same-prefix requests finds the first one's worker before any report shows its
  blocks. A released key stays only if a report made it cached meanwhile, so a worker that
  never caches a prompt is not believed to hold it for long. Not counted in ``max_keys``;
  bounded by the requests placed.

The index tolerates loss: a dead worker's entries go (``remove_worker``), a missed event or
a dropped key only costs a cache miss (the worker recomputes what it does not hold), and a
key believed held that is not only sends a request where its prefix is not.

Cost: ``match`` is O(the request's keys + the workers matched); ``store``/``evict``/``hold``/
``release`` are O(the keys given), amortized; ``reset``/``remove_worker`` are O(that worker's
keys). Nothing scans the whole index. Each key maps to a bitmask of worker slots (slots of
dead workers are reused), and each worker keeps the set of its keys so it can be forgotten
alone. Memory: about 140 bytes a cached key (the key, its dict entry, its worker's set entry),
so the default bound of 1M keys is about 140 MB; measured: 0.3 us a key to match.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

DEFAULT_MAX_KEYS = 1_000_000


class Match(NamedTuple):
    """A worker's share of one request's keys, both counted from the first key on."""

    num_matched_blocks: int  # leading keys the worker holds, cached or in flight
    num_shared_blocks: int  # leading keys in flight there: blocks a request placed there would share


@dataclass(slots=True)
class _WorkerKeys:
    slot: int
    bit: int  # 1 << slot, one object shared by every key only this worker holds
    cached: set[bytes] = field(default_factory=set)
    in_flight: Counter[bytes] = field(default_factory=Counter)  # key -> requests here whose prompt has it
    request_ids: set[str] = field(default_factory=set)  # requests held here


class PrefixIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.max_keys = max_keys
        self._cached: dict[bytes, int] = {}  # key -> slots; least recently stored or placed first
        self._in_flight: dict[bytes, int] = {}  # key -> slots
        self._workers: dict[str, _WorkerKeys] = {}
        self._owners: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []  # heap: the lowest slot first keeps masks small
        self._holds: dict[str, tuple[str, tuple[bytes, ...]]] = {}  # request id -> (worker, keys)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_keys(self) -> int:
        """Cached keys (the bounded part)."""
        return len(self._cached)

    def num_worker_keys(self, worker_id: str) -> int:
        """Keys the index believes ``worker_id`` has cached."""
        wk = self._workers.get(worker_id)
        return len(wk.cached) if wk else 0

    # -- from reports ----------------------------------------------------------------------------
    def apply_events(self, worker_id: str, stored: Sequence[bytes], evicted: Iterable[bytes], reset: bool) -> None:
        """One report's events: ``reset`` forgets the worker's cached keys, then ``evicted``
        go and ``stored`` come (a key both evicted and stored in one batch ends up stored)."""
        if reset:
            self._forget_cached(self._worker(worker_id))
        else:
            self.evict(worker_id, evicted)
        self.store(worker_id, stored)

    def store(self, worker_id: str, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        wk = self._worker(worker_id)
        bit = wk.bit
        cached = self._cached
        for key in reversed(keys):  # the first key ends up the most recent
            slots = cached.pop(key, 0)
            cached[key] = slots | bit if slots else bit
            wk.cached.add(key)
        if len(cached) > self.max_keys:
            self._drop_oldest(len(cached) - self.max_keys + self.max_keys // 16)

    def evict(self, worker_id: str, keys: Iterable[bytes]) -> None:
        wk = self._workers.get(worker_id)
        if wk is None:
            return
        for key in keys:
            if key in wk.cached:
                wk.cached.discard(key)
                self._clear(self._cached, key, wk.bit)

    # -- from placements ---------------------------------------------------------------------
    def hold(self, worker_id: str, request_id: str, keys: Sequence[bytes]) -> None:
        """The request is placed on the worker: its keys are in flight there, and those
        cached are used (a worker reports a key when it stores it, not when it reuses it)."""
        self.release(request_id)
        wk = self._worker(worker_id)
        keys = tuple(keys)
        cached = self._cached
        for key in reversed(keys):
            slots = cached.pop(key, None)
            if slots is not None:
                cached[key] = slots
        self._holds[request_id] = (worker_id, keys)
        wk.request_ids.add(request_id)
        for key in keys:
            wk.in_flight[key] += 1
            if wk.in_flight[key] == 1:
                self._in_flight[key] = self._in_flight.get(key, 0) | wk.bit

    def release(self, request_id: str) -> None:
        """The request left its worker (finished, cancelled, handed back); no-op if not held."""
        held = self._holds.pop(request_id, None)
        if held is None:
            return
        worker_id, keys = held
        wk = self._workers[worker_id]
        wk.request_ids.discard(request_id)
        for key in keys:
            n = wk.in_flight[key] - 1
            if n:
                wk.in_flight[key] = n
            else:
                del wk.in_flight[key]
                self._clear(self._in_flight, key, wk.bit)

    def holder(self, request_id: str) -> str | None:
        """The worker ``request_id``'s keys are held on; None if they are not held."""
        held = self._holds.get(request_id)
        return held[0] if held else None

    @property
    def held_request_ids(self) -> list[str]:
        """Every request whose keys are held (in flight) on some worker."""
        return list(self._holds)

    # -- workers -----------------------------------------------------------------------------
    def remove_worker(self, worker_id: str) -> None:
        """Forget everything about the worker (it died or left); its slot is reused."""
        wk = self._workers.pop(worker_id, None)
        if wk is None:
            return
        self._forget_cached(wk)
        for key in wk.in_flight:
            self._clear(self._in_flight, key, wk.bit)
        for rid in wk.request_ids:
            del self._holds[rid]
        self._owners[wk.slot] = None
        heapq.heappush(self._free_slots, wk.slot)

    # -- lookup ------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> dict[str, Match]:
        """Every worker holding at least the first of ``keys``, with how far its run goes.

        The keys are a chain (key i stands for every token up to the end of block i), so a
        worker's run stops at its first miss. In-flight keys are a prefix of their prompt,
        so the in-flight run is a prefix of the matched run. O(len(run) + workers matched).
        """
        if not keys:
            return {}
        cached, in_flight, slots = self._cached, self._in_flight, self._slots
        it = iter(keys)
        first = next(it)
        f = in_flight.get(first, 0)
        m = cached.get(first, 0) | f  # slots whose run goes on
        runs: dict[int, int] = {}  # slot -> its run, once the run has ended
        runs_in_flight: dict[int, int] = {}
        i = 1
        for key in it:
            if not m:
                break
            f_next = in_flight.get(key, 0) & f if f else 0
            m_next = (cached.get(key, 0) | f_next) & m
            if m_next != m:
                for slot in slots(m & ~m_next):
                    runs[slot] = i
            if f_next != f:
                for slot in slots(f & ~f_next):
                    runs_in_flight[slot] = i
            m, f = m_next, f_next
            i += 1
        for slot in slots(m):  # runs that reached the last key
            runs[slot] = i
        for slot in slots(f):
            runs_in_flight[slot] = i
        return {self._owners[slot]: Match(run, runs_in_flight.get(slot, 0)) for slot, run in runs.items()}

    # -- internals -----------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> _WorkerKeys:
        wk = self._workers.get(worker_id)
        if wk is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
                self._owners[slot] = worker_id
            else:
                slot = len(self._owners)
                self._owners.append(worker_id)
            wk = self._workers[worker_id] = _WorkerKeys(slot, 1 << slot)
        return wk

    def _forget_cached(self, wk: _WorkerKeys) -> None:
        for key in wk.cached:
            self._clear(self._cached, key, wk.bit)
        wk.cached = set()

    def _drop_oldest(self, n: int) -> None:
        """Drop the ``n`` least recently stored keys. Called with a batch (1/16 of the bound
        beyond the excess), so that finding the oldest - a scan from the front of a dict
        that skips the holes its deletions left - is paid once per batch, not per key."""
        cached = self._cached
        for key in list(itertools.islice(cached, n)):
            for slot in self._slots(cached.pop(key)):
                self._workers[self._owners[slot]].cached.discard(key)

    @staticmethod
    def _clear(table: dict[bytes, int], key: bytes, bit: int) -> None:
        slots = table.get(key)
        if slots is None:
            return
        slots &= ~bit
        if slots:
            table[key] = slots  # keeps the key's place in the order
        else:
            del table[key]

    @staticmethod
    def _slots(mask: int):
        """The slot numbers of the bits set in ``mask`` (a finite, non-negative mask)."""
        while mask:
            low = mask & -mask
            yield low.bit_length() - 1
            mask ^= low

    def check_integrity(self) -> None:
        """Raise if the key tables and the workers' own sets disagree (tests call this)."""
        cached: dict[bytes, int] = {}
        in_flight: dict[bytes, int] = {}
        for wid, wk in self._workers.items():
            assert self._owners[wk.slot] == wid, (wid, wk.slot)
            for key in wk.cached:
                cached[key] = cached.get(key, 0) | wk.bit
            for key, n in wk.in_flight.items():
                assert n > 0, (wid, key)
                in_flight[key] = in_flight.get(key, 0) | wk.bit
            for rid in wk.request_ids:
                assert self._holds[rid][0] == wid, (wid, rid)
        assert dict(self._cached) == cached, "cached keys disagree"
        assert self._in_flight == in_flight, "in-flight keys disagree"
        assert len(self._cached) <= self.max_keys
        assert len(self._holds) == sum(len(wk.request_ids) for wk in self._workers.values())
