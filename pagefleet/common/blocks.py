"""Block arithmetic shared by the worker (its pool) and the scheduler (admission)."""

from __future__ import annotations


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: the ceiling of ``num_tokens / block_size``."""
    return -(-num_tokens // block_size)
