"""Block pool and KV cache manager, without a model."""

from __future__ import annotations

import pytest

from pagefleet.common.blocks import block_hashes
from pagefleet.common.sampling_params import SamplingParams
from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.kv_cache_manager import KVCacheManager
from pagefleet.worker.request import Request


def test_pool_allocates_and_frees():
    pool = BlockPool(8)
    a = pool.allocate(5)
    assert a is not None and len(set(a)) == 5
    assert pool.num_free_blocks == 3
    assert pool.allocate(4) is None, "asking for too many must change nothing"
    assert pool.num_free_blocks == 3
    pool.free(a)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_pool_ref_counts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.num_free_blocks == 1, "still referenced once"
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="free block"):
        pool.incref([b])


def test_pool_integrity_detects_corruption():
    pool = BlockPool(4)
    (a, _) = pool.allocate(2)
    pool._free[a] = None  # in use and free at once
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache(a, b"k")
    pool._cached[b"other"] = a  # the key map names a block that holds another key
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_manager_grows_tables_on_demand():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 1) is not None
    assert len(kv.block_tables["a"]) == 1
    assert kv.allocate_slots("a", 4) == [], "still fits the first block"
    new = kv.allocate_slots("a", 5)
    assert new is not None and len(new) == 1
    assert len(kv.block_tables["a"]) == 2
    kv.check_integrity()


def test_manager_does_not_fit_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8)
    before = (kv.num_free_blocks, list(kv.block_tables["a"]))
    assert kv.allocate_slots("a", 20) is None
    assert kv.allocate_slots("b", 9) is None
    assert (kv.num_free_blocks, kv.block_tables["a"]) == before
    assert "b" not in kv.block_tables
    assert kv.can_allocate("b", 4)
    kv.check_integrity()


def test_manager_free_returns_everything():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 3)
    assert kv.free("a") == 3
    assert kv.free("a") == 0
    assert kv.free("b") == 2
    assert kv.num_free_blocks == 5
    kv.check_integrity()


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


# -- prefix caching --------------------------------------------------------------------


def test_cached_free_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        assert pool.cache(b, bytes([i]))
    pool.free([ids[2]])
    pool.free([ids[0]])
    pool.free([ids[3]])
    assert pool.num_free_blocks == 3, "cached free blocks count as free"
    pool.take_events()
    assert pool.allocate(1) == [ids[2]], "the least recently freed goes first"
    assert pool.cached_block(bytes([2])) is None, "eviction removes the key"
    assert pool.cached_block(bytes([0])) == ids[0]
    assert pool.take_events() == ([(bytes([2]), False)], False)
    pool.check_integrity()


def test_uncached_free_blocks_go_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a")
    pool.free([a])
    pool.free([b])  # freed later, but holds nothing worth keeping
    assert pool.allocate(1) == [b]
    assert pool.cached_block(b"a") == a
    pool.free([c])
    pool.check_integrity()


def test_touch_takes_a_cached_block_back_from_the_free_queue():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"a")
    assert not pool.cache(b, b"a"), "a key is cached once"
    assert not pool.cache(a, b"other"), "a block holds one key"
    pool.free([a, b])
    assert pool.num_free_blocks == 2
    pool.touch([a])  # a hit after the free
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.num_free_blocks == 1, "still referenced once"
    with pytest.raises(RuntimeError, match="uncached"):
        pool.touch([b])
    assert pool.allocate(1) == [b], "the referenced cached block is not evictable"
    pool.free([a, b])
    pool.check_integrity()


def test_event_record_is_bounded():
    pool = BlockPool(1)
    for i in range(pool._max_events + 1):
        (b,) = pool.allocate(1)
        pool.cache(b, i.to_bytes(4, "little"))
        pool.free([b])
    events, lost = pool.take_events()
    assert lost and len(events) <= pool._max_events
    assert pool.take_events() == ([], False)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def test_manager_matches_cached_prefix_and_shares_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = _req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    assert kv.allocate_slots("a", 10, kv.match_prefix(a)) is not None
    a.num_computed_tokens = 10
    kv.cache_blocks(a)
    assert a.block_hashes == block_hashes(a.all_token_ids, 4)
    assert kv.pool.num_cached_blocks == 2
    b = _req("b", list(range(1, 9)) + [50, 51, 52])  # shares a's 2 full blocks
    m = kv.match_prefix(b)
    assert m.block_ids == kv.block_tables["a"][:2] and m.num_tokens == 8 and m.num_queried_tokens == 11
    before = kv.num_free_blocks
    assert kv.allocate_slots("b", 11, m) is not None
    assert kv.num_free_blocks == before - 1, "only the third block is new"
    assert kv.block_tables["b"][:2] == kv.block_tables["a"][:2]
    assert (kv.prefix_cache_queries_total, kv.prefix_cache_hits_total) == (10 + 11, 8)
    assert kv.num_shared_prefix_blocks("b", 3) == 2
    kv.check_integrity()
    kv.free("a")
    assert kv.num_shared_prefix_blocks("b", 3) == 0
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2
    kv.check_integrity()


def test_a_whole_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = _req("a", list(range(1, 9)))  # exactly 2 blocks
    kv.allocate_slots("a", 8, kv.match_prefix(a))
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.free("a")
    again = _req("again", list(range(1, 9)))
    m = kv.match_prefix(again)
    assert m.num_tokens == 4, "capped at len - 1 tokens, whole blocks"
    longer = _req("longer", list(range(1, 10)))
    assert kv.match_prefix(longer).num_tokens == 8


def test_prefix_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots("a", 5, kv.match_prefix(a))
    a.num_computed_tokens = 5
    kv.cache_blocks(a)
    kv.free("a")  # 3 free blocks, 2 of them cached
    b = _req("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    m = kv.match_prefix(b)
    assert len(m.block_ids) == 2
    assert kv.num_new_blocks("b", 9, m) == 5, "the free hits are taken from the free queue too"
    assert kv.allocate_slots("b", 9, m) is None
    assert "b" not in kv.block_tables and kv.num_free_blocks == 3 and kv.pool.num_cached_blocks == 2
    assert kv.prefix_cache_queries_total == 5, "a lookup that does not fit is not counted"
    assert kv.allocate_slots("b", 6, m) == [kv.block_tables["b"][2]]
    kv.free("b")
    kv.check_integrity()


def test_free_puts_a_sequence_tail_first_in_the_eviction_order():
    kv = KVCacheManager(num_blocks=3, block_size=1, enable_caching=True)
    a = _req("a", [1, 2, 3, 4])
    kv.allocate_slots("a", 3)
    a.num_computed_tokens = 3
    kv.cache_blocks(a)
    first, second, third = kv.block_tables["a"]
    kv.free("a")
    assert kv.pool.allocate(1) == [third]
    assert kv.pool.allocate(1) == [second]
    kv.pool.free([third, second])


def test_caching_off_caches_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    m = kv.match_prefix(a)
    assert m.block_ids == [] and m.num_queried_tokens == 0
    kv.allocate_slots("a", 5, m)
    kv.free("a")
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_queries_total == 0
    kv.check_integrity()
