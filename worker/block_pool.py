"""The block pool: reference counts, the free queue and the prefix cache's key map.

It only allocates, frees, ref-counts and hashes. Who gets blocks and who loses them is
decided elsewhere (the scheduler's policy); the pool evicts a cached block only when a
fresh block is asked for and none uncached is free.

Prefix caching: a full block of computed tokens can be *cached* under its key (a
``pagefleet.common.blocks.block_hashes`` key). A cached block whose reference count
drops to zero keeps its K/V and its key and waits, free, in the free queue: a later
request can ``touch`` it back into use. The free queue is least-recently-used first:
blocks without a key go to its front (they hold nothing worth keeping), cached ones to
its back, and ``allocate`` takes from the front, evicting the key of a cached block it
takes. Cached free blocks count as free.

Every key stored and evicted is recorded, in order, for ``take_events`` (the worker
publishes them to the cluster); the record is bounded, and an overflow says so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# Events kept between two take_events() beyond this many blocks' worth are dropped (and
# the drop reported), so an engine nobody reads the events of stays bounded.
_EVENTS_PER_BLOCK = 4


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Free blocks, least recently used first (values unused: an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # key -> the block holding it
        self._events: list[tuple[bytes, bool]] = []  # (key, stored) in order; False: evicted
        self._events_lost = False
        self._max_events = _EVENTS_PER_BLOCK * num_blocks + 1024

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key, in use or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int] | None:
        """``num`` fresh blocks with a reference count of one, or ``None`` (nothing changed)
        if too few are free. A cached block taken loses its key."""
        if num > len(self._free):
            return None
        pop = self._free.popitem
        ids = [pop(last=False)[0] for _ in range(num)]
        refs, key_of = self._ref_counts, self._key_of
        for b in ids:
            refs[b] = 1
            if key_of[b] is not None:
                self._evict(b)
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block, which must be in use."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more reference to each cached block, taking free ones out of the free queue."""
        refs, free = self._ref_counts, self._free
        for b in block_ids:
            if self._key_of[b] is None:
                raise RuntimeError(f"touch of uncached block {b}")
            if refs[b] == 0:
                del free[b]
            refs[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in order; a block with none left is free again:
        at the back of the free queue if cached (kept until evicted), else at its front."""
        refs, free, key_of = self._ref_counts, self._free, self._key_of
        for b in block_ids:
            if refs[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            refs[b] -= 1
            if refs[b] == 0:
                free[b] = None
                if key_of[b] is None:
                    free.move_to_end(b, last=False)

    # -- the prefix cache ----------------------------------------------------------------
    def cached_block(self, key: bytes) -> int | None:
        """The block cached under ``key``, or ``None``."""
        return self._cached.get(key)

    def cache(self, block_id: int, key: bytes) -> bool:
        """Cache the in-use, full ``block_id`` under ``key``. False (nothing changed) if the
        key is cached already (by another block holding the same tokens) or the block has one."""
        if key in self._cached or self._key_of[block_id] is not None:
            return False
        if self._ref_counts[block_id] <= 0:
            raise RuntimeError(f"cache of free block {block_id}")
        self._cached[key] = block_id
        self._key_of[block_id] = key
        self._record(key, True)
        return True

    def cached_keys(self) -> list[bytes]:
        """Every key cached now."""
        return list(self._cached)

    def _evict(self, block_id: int) -> None:
        key = self._key_of[block_id]
        self._key_of[block_id] = None
        del self._cached[key]
        self._record(key, False)

    def _record(self, key: bytes, stored: bool) -> None:
        if len(self._events) >= self._max_events:
            self._events.clear()
            self._events_lost = True
        self._events.append((key, stored))

    def take_events(self) -> tuple[list[tuple[bytes, bool]], bool]:
        """The ``(key, stored)`` events since the last call, oldest first (``stored`` False:
        evicted), and whether some were dropped since (then rebuild from ``cached_keys``)."""
        events, lost = self._events, self._events_lost
        self._events, self._events_lost = [], False
        return events, lost

    def check_integrity(self) -> None:
        """Raise if free + used != total, a free block is referenced, a referenced block is
        free, or the key map and the blocks' keys disagree."""
        refs = self._ref_counts
        used = sum(1 for r in refs if r > 0)
        if len(self._free) + used != self.num_blocks:
            raise AssertionError(
                f"pool integrity: free {len(self._free)} + used {used} != total {self.num_blocks}"
            )
        for b in self._free:
            if refs[b] != 0:
                raise AssertionError(f"free block {b} has reference count {refs[b]}")
        if any(r < 0 for r in refs):
            raise AssertionError("a negative reference count")
        for key, b in self._cached.items():
            if self._key_of[b] != key:
                raise AssertionError(f"key map names block {b}, which holds another key")
        num_keyed = sum(1 for k in self._key_of if k is not None)
        if num_keyed != len(self._cached):
            raise AssertionError(f"{num_keyed} blocks hold a key but the key map has {len(self._cached)}")
