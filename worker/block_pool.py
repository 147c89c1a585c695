"""The block pool: a free list and reference counts. It only allocates and frees.

Who gets blocks and who loses them is decided elsewhere (the scheduler's policy);
this class never evicts anything on its own.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int] | None:
        """``num`` fresh blocks with a reference count of one, or ``None`` if too few are free."""
        if num > len(self._free):
            return None
        pop = self._free.popleft
        ids = [pop() for _ in range(num)]
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        refs = self._ref_counts
        for b in block_ids:
            if refs[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            refs[b] -= 1
            if refs[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Raise if free + used != total or a block is both free and referenced."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        used = sum(1 for r in self._ref_counts if r > 0)
        if len(free) + used != self.num_blocks:
            raise AssertionError(
                f"pool integrity: free {len(free)} + used {used} != total {self.num_blocks}"
            )
        for b in free:
            if self._ref_counts[b] != 0:
                raise AssertionError(f"free block {b} has reference count {self._ref_counts[b]}")
