"""Per-request block tables on top of the block pool.

``allocate_slots`` grows a request's table so it can hold a given number of tokens,
or returns ``None`` with nothing changed; ``free`` hands a request's blocks back.
"""

from __future__ import annotations

from pagefleet.common.blocks import num_blocks_for

from .block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks ``request_id`` needs to hold ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the table to hold ``num_tokens`` tokens; the new block ids, or ``None`` if they don't fit."""
        table = self.block_tables.get(request_id)
        need = num_blocks_for(num_tokens, self.block_size) - (0 if table is None else len(table))
        if need <= 0:
            if table is None:
                self.block_tables[request_id] = []
            return []
        new = self.pool.allocate(need)
        if new is None:
            return None
        if table is None:
            self.block_tables[request_id] = new
        else:
            table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Return every block of ``request_id`` to the pool; the number freed."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        self.pool.free(table)
        return len(table)

    def num_allocated_slots(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = [b for t in self.block_tables.values() for b in t]
        if len(owned) != len(set(owned)):
            raise AssertionError("a block is owned by two requests")
        if len(owned) != self.pool.num_used_blocks:
            raise AssertionError(
                f"tables hold {len(owned)} blocks but the pool has {self.pool.num_used_blocks} in use"
            )
