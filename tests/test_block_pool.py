"""Block pool and KV cache manager, without a model."""

from __future__ import annotations

import pytest

from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.kv_cache_manager import KVCacheManager


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
    pool.allocate(2)
    pool._free.append(pool._free[0])
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
