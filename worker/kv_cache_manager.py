"""Per-request block tables on top of the block pool, and the prefix cache's lookups.

``allocate_slots`` grows a request's table so it can hold a given number of tokens,
or returns ``None`` with nothing changed; ``free`` hands a request's blocks back.

With ``enable_caching``: ``match_prefix`` finds the longest run of a request's full
blocks already cached (by key: ``pagefleet.common.blocks.block_hashes`` over its token
ids, kept on the request and extended only as blocks fill), ``allocate_slots(...,
prefix)`` starts the request's table with them, and ``cache_blocks`` caches the
request's blocks as they fill with computed tokens. A table may then share blocks with
other tables (reference counts); a shared block is never written, since only whole
blocks of computed tokens are matched and a request writes past its computed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefleet.common.blocks import block_hashes, num_blocks_for

from .block_pool import BlockPool

if TYPE_CHECKING:
    from .request import Request

# What separates K/V beyond the tokens (e.g. an adapter id); one model, none yet. The
# gateway computes the same keys over a prompt (AssignRequest.block_hashes).
_EXTRA_KEY = b""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A request's cached prefix: ``block_ids`` hold its first ``num_tokens`` tokens.

    ``num_queried_tokens``: the tokens an admission looked up (0 for other lookups, which
    the prefix-cache counters leave out).
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_queried_tokens: int = 0


class KVCacheManager:
    """Block tables per request id. Counters ending in ``_total`` are cumulative."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.set_aside_blocks: list[int] = []  # written by a read that could not be stopped: never reused
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a table cache_blocks has seen
        self.prefix_cache_queries_total = 0  # tokens looked up when admitted
        self.prefix_cache_hits_total = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """How many free blocks ``request_id`` takes to hold ``num_tokens`` tokens
        (starting from ``prefix`` if it has no table: its blocks that are free count)."""
        have = len(self.block_tables.get(request_id, ()))
        if prefix is None or have:
            return max(0, self.num_blocks_for(num_tokens) - have)
        refs = self.pool.ref_count
        num_free_hits = sum(1 for b in prefix.block_ids if refs(b) == 0)
        return max(0, self.num_blocks_for(num_tokens) - len(prefix.block_ids)) + num_free_hits

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def allocate_slots(
        self, request_id: str, num_tokens: int, prefix: PrefixMatch | None = None
    ) -> list[int] | None:
        """Grow the table to hold ``num_tokens`` tokens; the new block ids, or ``None`` if they don't fit.

        ``prefix`` (from ``match_prefix``, for a request with no table) starts the table with
        the cached blocks; the new ids are the fresh blocks after them. Counts an admission's lookup.
        """
        table = self.block_tables.get(request_id)
        if prefix is not None and table is None:
            return self._allocate_with_prefix(request_id, num_tokens, prefix)
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

    def _allocate_with_prefix(self, request_id: str, num_tokens: int, prefix: PrefixMatch) -> list[int] | None:
        hits = prefix.block_ids
        if not self.pool.can_allocate(self.num_new_blocks(request_id, num_tokens, prefix)):
            return None
        self.pool.touch(hits)  # first: the fresh blocks must not evict them
        new = self.pool.allocate(max(0, self.num_blocks_for(num_tokens) - len(hits)))
        self.block_tables[request_id] = hits + new
        self._num_cached[request_id] = len(hits)
        if prefix.num_queried_tokens:
            self.prefix_cache_queries_total += prefix.num_queried_tokens
            self.prefix_cache_hits_total += prefix.num_tokens
        return new

    def free(self, request_id: str) -> int:
        """Drop every block reference of ``request_id``; the number dropped. Its last blocks
        go first, so the cache evicts a sequence's tail before the prefix others may share."""
        self._num_cached.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        self.pool.free(reversed(table))
        return len(table)

    def set_aside(self, request_id: str, block_ids: list[int]) -> None:
        """Take ``block_ids`` out of ``request_id``'s table without freeing them: a read that
        could not be stopped may still write them, so they are never handed out again
        (``set_aside_blocks``; the pool counts them used). A later ``free`` frees the rest."""
        table = self.block_tables.get(request_id, [])
        gone = set(block_ids)
        self.block_tables[request_id] = [b for b in table if b not in gone]
        self.set_aside_blocks.extend(b for b in table if b in gone)

    def num_allocated_slots(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    # -- the prefix cache ----------------------------------------------------------------
    def match_prefix(self, req: Request, max_blocks: int | None = None) -> PrefixMatch:
        """The longest run of ``req``'s leading full blocks that is cached, at most
        ``max_blocks`` blocks. Without ``max_blocks`` it is an admission's lookup (counted
        once admitted): up to but never including the last token, whose logits are needed.
        Changes nothing but ``req.block_hashes`` (extended)."""
        if not self.enable_caching:
            return PrefixMatch()
        bs = self.block_size
        num_queried = 0
        if max_blocks is None:
            max_blocks = (req.num_tokens - 1) // bs
            num_queried = req.num_tokens
        keys = self._keys(req, max_blocks)
        lookup = self.pool.cached_block
        hits: list[int] = []
        for key in keys[:max_blocks]:
            b = lookup(key)
            if b is None:
                break
            hits.append(b)
        return PrefixMatch(hits, len(hits) * bs, num_queried)

    def cache_blocks(self, req: Request) -> None:
        """Cache ``req``'s blocks that are full of computed tokens and not seen yet.

        A block whose key is cached already (another block computed the same tokens first)
        stays uncached. Costs nothing per call beyond the blocks it sees.
        """
        rid = req.request_id
        table = self.block_tables[rid]
        start = self._num_cached.get(rid, 0)
        end = min(req.num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        keys = self._keys(req, end)
        cache = self.pool.cache
        for i in range(start, end):
            cache(table[i], keys[i])
        self._num_cached[rid] = end

    def keys_filled(self, req: Request, num_new_tokens: int) -> list[bytes]:
        """Keys of the blocks ``req`` fills by computing its next ``num_new_tokens`` tokens
        ([] with caching off). Hashes nothing ``cache_blocks`` would not hash anyway."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        start = req.num_computed_tokens // bs
        end = (req.num_computed_tokens + num_new_tokens) // bs
        return self._keys(req, end)[start:end] if end > start else []

    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """``req.block_hashes``, extended to at least ``num_blocks`` keys where it has the tokens."""
        keys = req.block_hashes
        have = len(keys)
        if have < num_blocks:
            bs = self.block_size
            keys.extend(block_hashes(req.all_token_ids[have * bs : num_blocks * bs], bs, _EXTRA_KEY,
                                     keys[-1] if keys else None))
        return keys

    def num_shared_prefix_blocks(self, request_id: str, num_blocks: int) -> int:
        """How many of the first ``num_blocks`` blocks of the table, from its start, another
        table holds too."""
        refs = self.pool.ref_count
        n = 0
        for b in self.block_tables.get(request_id, ())[:num_blocks]:
            if refs(b) < 2:
                break
            n += 1
        return n

    def take_events(self) -> tuple[list[tuple[bytes, bool]], bool]:
        """Keys stored and evicted since the last call (see ``BlockPool.take_events``)."""
        return self.pool.take_events()

    def cached_keys(self) -> list[bytes]:
        return self.pool.cached_keys()

    def check_integrity(self) -> None:
        """The pool's checks, plus: every reference is a table's (or a block set aside), no table holds a free block
        or one block twice, and caching off caches nothing."""
        pool = self.pool
        pool.check_integrity()
        counts: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} holds a block twice")
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        for b in self.set_aside_blocks:
            counts[b] = counts.get(b, 0) + 1
        for b in range(pool.num_blocks):
            if pool.ref_count(b) != counts.get(b, 0):
                raise AssertionError(
                    f"block {b}: reference count {pool.ref_count(b)} but {counts.get(b, 0)} tables hold it"
                )
        if not set(self._num_cached) <= set(self.block_tables):
            raise AssertionError("cache progress kept for a request without a table")
        if not self.enable_caching and pool.num_cached_blocks:
            raise AssertionError("caching is off but blocks are cached")
