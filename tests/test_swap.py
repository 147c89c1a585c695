"""Preemption by swap: the swap pool, the policy, the cost model, and the engine under pressure."""

from __future__ import annotations

import pytest
import torch

from pagefleet import Engine, SamplingParams
from pagefleet.worker.continuous_scheduler import ContinuousScheduler
from pagefleet.worker.cost_model import CostModel
from pagefleet.worker.kv_cache_manager import KVCacheManager
from pagefleet.worker.policy import PreemptionPolicy, pick_victim
from pagefleet.worker.request import Request, RequestStatus
from pagefleet.worker.swap import SwapAllocator, SwapSpace

# -- the mechanism ----------------------------------------------------------------------


def test_swap_allocator_prefers_one_extent_and_merges_on_free():
    a = SwapAllocator(10)
    assert a.allocate("x", 3) == [0, 1, 2]
    assert a.allocate("y", 4) == [3, 4, 5, 6]
    assert a.allocate("z", 3) == [7, 8, 9]
    assert a.allocate("w", 1) is None and "w" not in a.block_tables
    a.free("x")
    a.free("z")
    # 3 + 3 free in two extents: a 5-block request takes both, largest first.
    assert sorted(a.allocate("v", 5)) == [0, 1, 2, 7, 8]
    a.free("y")
    a.free("v")
    assert a._free == [(0, 10)], "freed extents merge back into one"
    a.check_integrity()


@pytest.mark.parametrize("contiguous", [True, False])
def test_swap_space_round_trip_is_exact(contiguous):
    cache = torch.randn(3, 2, 12, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, heads, dim]
    before = cache.clone()
    space = SwapSpace(cache, num_blocks=6)
    src = [4, 5, 6] if contiguous else [9, 2, 7]
    space.swap_out(list(zip(src, [1, 2, 3], strict=True)))
    cache[:, :, src] = 0.0
    dst = [0, 1, 2] if contiguous else [11, 3, 8]
    space.swap_in(list(zip([1, 2, 3], dst, strict=True)))
    space.fence()
    assert torch.equal(cache[:, :, dst], before[:, :, src])
    assert space.num_bytes_moved == 2 * 3 * space.block_bytes
    assert space.bytes_per_second > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_swap_round_trip_on_a_side_stream():
    cache = torch.randn(2, 2, 64, 16, 4, 32, device="cuda")
    before = cache.clone()
    space = SwapSpace(cache, num_blocks=32)
    assert space.cache.is_pinned()
    src = [5, 9, 10, 11, 40]
    space.swap_out(list(zip(src, [3, 4, 5, 6, 7], strict=True)))
    cache[:, :, src] = 0.0  # compute-stream writes wait for the gather only
    dst = [60, 1, 2, 3, 30]
    space.swap_in(list(zip([3, 4, 5, 6, 7], dst, strict=True)))
    space.fence()  # the compute stream now waits for the swap-in
    assert torch.equal(cache[:, :, dst], before[:, :, src])
    space.synchronize()
    assert space.bytes_per_second > 0


# -- the policy ---------------------------------------------------------------------------


def _req(rid, priority=0, admit_seq=0, arrival=0) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority, arrival_seq=arrival)
    r.admit_seq = admit_seq
    return r


def test_victim_is_lowest_priority_then_latest_admitted_and_never_just_resumed():
    old, new, important = _req("old", 0, 1), _req("new", 0, 2), _req("vip", 5, 3)
    assert pick_victim([old, new, important]) is new
    assert pick_victim([old, important]) is old
    new.num_preemptions, new.resumed_at_step = 1, 10  # resumed at step 10
    assert pick_victim([old, new, important], step=12, min_resident_steps=4) is old
    assert pick_victim([old, new, important], step=14, min_resident_steps=4) is new
    assert pick_victim([new], step=12, min_resident_steps=4) is None


def test_cost_model_chooses_the_cheaper_way_per_victim():
    # 1 MB blocks over 10 GB/s: 0.2 ms per block out and back; prefill 16k tokens/s.
    cm = CostModel(block_bytes=1 << 20, copy_bytes_per_s=10e9, copy_overhead_s=1e-3,
                   prefill_tokens_per_s=16_000)
    auto = PreemptionPolicy("auto")
    # Long sequence: 64 blocks of 16 tokens, swap ~15 ms vs recompute 64 ms.
    assert auto.choose(64, 1024, swap_has_room=True, cost_model=cm) == "swap"
    # Short one: the fixed copy overhead dominates (2.2 ms) vs recompute of 16 tokens (1 ms).
    assert auto.choose(1, 16, swap_has_room=True, cost_model=cm) == "recompute"
    assert auto.choose(64, 1024, swap_has_room=False, cost_model=cm) == "recompute"
    assert PreemptionPolicy("swap").choose(1, 16, swap_has_room=True, cost_model=cm) == "swap"
    assert PreemptionPolicy("recompute").choose(64, 1024, swap_has_room=True, cost_model=cm) == "recompute"


def test_swap_in_keeps_a_watermark_unless_idle():
    p = PreemptionPolicy("swap", watermark=0.02)
    assert p.watermark_blocks(1000) == 20
    assert p.can_swap_in(120, 100, 1000, idle=False)
    assert not p.can_swap_in(119, 100, 1000, idle=False)
    assert p.can_swap_in(100, 100, 1000, idle=True)


def test_swapped_sequence_comes_back_before_new_admissions():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, swap=SwapAllocator(8),
                  policy=PreemptionPolicy("swap", watermark=0.0))
    a = Request("a", [1, 2], SamplingParams(max_tokens=8), arrival_seq=0)
    b = Request("b", [1, 2], SamplingParams(max_tokens=8), arrival_seq=1)
    for r in (a, b):
        s.add(r)
    out = s.schedule()
    s.update_after_step(out)
    assert s.preempt(b, "swap") and b.status == RequestStatus.SWAPPED
    late = Request("late", [1, 2], SamplingParams(max_tokens=8), arrival_seq=2)
    s.add(late)
    out = s.schedule()  # b's copy-out runs this step; it cannot come back in the same step
    assert len(out.blocks_to_swap_out) == 1 and not out.blocks_to_swap_in
    s.update_after_step(out)
    out = s.schedule()
    assert b.status == RequestStatus.SWAPPING_IN and out.blocks_to_swap_in
    s.update_after_step(out)
    out = s.schedule()
    assert b.status == RequestStatus.RUNNING and b in out.requests
    kv.check_integrity()
    s.swap.check_integrity()


# -- the engine under pressure ----------------------------------------------------------

PROMPTS = [[5 + (7 * i + j) % 150 for j in range(6 + 3 * i)] for i in range(6)]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(3)]
    return [greedy, seeded[0], greedy, seeded[1], greedy, seeded[2]]


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=256, block_size=4)
    return [o.token_ids for o in engine.generate(PROMPTS, _params())]


def _small(llama_dir, mode: str, num_swap_blocks: int = 64) -> Engine:
    # Peak demand is ~6 x 13 = 78 blocks; 14 blocks force many preemptions.
    return Engine(str(llama_dir), device="cpu", num_blocks=14, block_size=4,
                  num_swap_blocks=num_swap_blocks, preemption=mode)


def _assert_all_free(engine: Engine) -> None:
    s = engine.stats()
    assert s.num_free_blocks == s.num_blocks and s.num_free_swap_blocks == s.num_swap_blocks
    assert s.num_swapped == 0
    engine.check_integrity()


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_small_pool_gives_exactly_the_unconstrained_tokens(llama_dir, reference, mode):
    engine = _small(llama_dir, mode)
    outs = engine.generate(PROMPTS, _params())
    assert [o.token_ids for o in outs] == reference
    s = engine.stats()
    assert s.num_preemptions_total > 0
    if mode == "swap":
        assert s.num_swapped_out_blocks_total > 0 and s.num_swapped_in_blocks_total == s.num_swapped_out_blocks_total
        assert s.num_recomputes_total == 0
    if mode == "recompute":
        assert s.num_swapped_out_blocks_total == 0 and s.num_recomputes_total == s.num_preemptions_total
    _assert_all_free(engine)


def test_full_swap_pool_falls_back_to_recompute(llama_dir, reference):
    engine = _small(llama_dir, "swap", num_swap_blocks=6)
    outs = engine.generate(PROMPTS, _params())
    assert [o.token_ids for o in outs] == reference
    s = engine.stats()
    assert s.num_recomputes_total > 0 and s.num_swapped_out_blocks_total > 0
    _assert_all_free(engine)


def _run_until(engine: Engine, status: RequestStatus, limit: int = 400) -> Request:
    for _ in range(limit):
        for r in engine.requests.values():
            if r.status == status:
                return r
        engine.step()
    raise AssertionError(f"no request reached {status.name}")


def _drain(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("status", [RequestStatus.SWAPPED, RequestStatus.SWAPPING_IN])
def test_abort_frees_both_pools_at_once(llama_dir, reference, status):
    engine = _small(llama_dir, "swap")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, _params(), strict=True)]
    reqs = dict(engine.requests)
    victim = _run_until(engine, status)
    rid = victim.request_id
    assert engine.stats().num_blocks_of(rid) > 0
    assert engine.abort_request(rid).finish_reason == "abort"
    assert engine.stats().num_blocks_of(rid) == 0
    assert rid not in engine.scheduler.swap.block_tables and rid not in engine.kv.block_tables
    engine.check_integrity()
    _drain(engine)
    for i, r in enumerate(ids):
        if r != rid:
            assert reqs[r].output_token_ids == reference[i]
    _assert_all_free(engine)


def test_directed_preemption_and_occupancy(llama_dir, reference):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=64, block_size=4, num_swap_blocks=32,
                    preemption="swap")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], _params()[:3], strict=True)]
    reqs = dict(engine.requests)
    for _ in range(3):
        engine.step()
    occ = engine.stats()
    held = occ.blocks_per_request[ids[1]]
    assert occ.num_running == 3 and occ.num_swapped == 0 and occ.num_swapped_blocks == 0
    assert engine.preempt_request(ids[1], mode="swap")
    occ = engine.stats()
    assert occ.num_running == 2 and occ.num_swapped == 1
    assert occ.num_swapped_blocks == held and occ.num_free_blocks == occ.num_blocks - sum(
        n for r, n in occ.blocks_per_request.items() if r != ids[1]
    )
    assert not engine.preempt_request(ids[1])  # not on the device any more
    assert not engine.preempt_request("nobody")
    _drain(engine)
    for i, rid in enumerate(ids):
        assert reqs[rid].output_token_ids == reference[i]
    assert engine.stats().num_swapped_in_blocks_total == held
    _assert_all_free(engine)


def test_bench_preemption_runs_every_mode_and_writes_json(tmp_path):
    """``pagefleet bench preemption`` in small: each mode's run, the swap's bandwidth beside a
    plain copy of the same bytes, the engine's counters read by their names."""
    import json

    from pagefleet.benchmarks.preemption import main

    out = tmp_path / "preemption.json"
    assert main(["--requests", "6", "--traces", "mixed", "--repeats", "1", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {r["mode"] for r in runs} == {"swap", "recompute", "auto"}
    swap = next(r for r in runs if r["mode"] == "swap")
    assert swap["num_steps"] > 0 and swap["num_swapped_out_blocks"] > 0 and swap["plain_copy_gbps"] > 0


def test_auto_preemption_calibrates_on_a_model_of_a_small_vocabulary(tmp_path):
    """The cost model's prefill measure fed token ids up to 99 whatever the vocabulary: a model
    of 64 tokens could not start with a swap pool and ``preemption="auto"`` (the worker's
    default), an IndexError in its embedding."""
    from conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", vocab_size=64)
    engine = Engine(str(tmp_path), device="cpu", num_blocks=64, block_size=4, num_swap_blocks=16, preemption="auto")
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3 and all(0 <= t < 64 for t in out.token_ids)
