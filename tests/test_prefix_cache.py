"""Automatic prefix caching: the same tokens with it on, off and in `transformers`, under
every setting that changes the step plan; blocks shared, re-used, freed and published."""

from __future__ import annotations

import random
import time

import pytest
from conftest import hf_greedy

from pagefleet import Engine, SamplingParams
from pagefleet.common.blocks import block_hashes
from pagefleet.worker.continuous_scheduler import ContinuousScheduler
from pagefleet.worker.kv_cache_manager import KVCacheManager
from pagefleet.worker.kv_events import KVEventLog
from pagefleet.worker.policy import PreemptionPolicy
from pagefleet.worker.request import Request, RequestStatus
from pagefleet.worker.swap import SwapAllocator

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

_rng = random.Random(0)
SYSTEM = [_rng.randrange(3, 199) for _ in range(24)]  # 6 blocks of 4, 1.5 of 16
PROMPTS = [
    SYSTEM + [_rng.randrange(3, 199) for _ in range(5)],
    SYSTEM + [_rng.randrange(3, 199) for _ in range(9)],
    SYSTEM[:16],  # a prefix of the others, a whole number of blocks
    SYSTEM + [_rng.randrange(3, 199) for _ in range(8)],  # 32 tokens: whole blocks of 4 and 16
    SYSTEM[:10] + [_rng.randrange(3, 199) for _ in range(7)],  # diverges inside a block
    [_rng.randrange(3, 199) for _ in range(13)],  # shares nothing
]
PROMPTS.append(list(PROMPTS[0]))  # the same prompt twice

SETTINGS = {
    "block-size-16": dict(),
    "block-size-4": dict(block_size=4),
    "chunked-prefill": dict(block_size=4, max_num_batched_tokens=8),
    "few-seqs": dict(block_size=4, max_num_seqs=2),  # later prompts find earlier ones cached
    "recompute-pressure": dict(block_size=4, num_blocks=14, max_num_batched_tokens=16),
    "swap-pressure": dict(block_size=4, num_blocks=14, num_swap_blocks=64, preemption="swap"),
}


@pytest.fixture(autouse=True)
def caches_end_consistent(_engine_registry):
    """After every test, each idle engine's cache: every block free, every cached key maps
    to a block that holds it and sits in the free queue once."""
    yield
    for engine in list(_engine_registry):
        if engine.has_unfinished_requests():
            continue
        pool = engine.kv.pool
        assert not engine.kv.block_tables
        assert list(sorted(pool._free)) == list(range(pool.num_blocks))
        for key in pool.cached_keys():
            b = pool.cached_block(key)
            assert pool.ref_count(b) == 0 and pool._key_of[b] == key and b in pool._free
        assert pool.num_cached_blocks <= pool.num_blocks
        if not engine.kv.enable_caching:
            assert pool.num_cached_blocks == 0


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, GREEDY.max_tokens)


def _generate_recording_starts(engine: Engine, prompts, params=GREEDY):
    """``engine.generate``, and each request's ``num_computed_tokens`` when first scheduled."""
    starts: dict[str, int] = {}
    update = engine.scheduler.update_after_step

    def spy(out):
        for r in out.requests:
            starts.setdefault(r.request_id, r.num_computed_tokens)
        update(out)

    engine.scheduler.update_after_step = spy
    try:
        outs = engine.generate(prompts, params)
    finally:
        del engine.scheduler.update_after_step
    return [o.token_ids for o in outs], [starts[o.request_id] for o in outs]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_tokens_with_caching_on_off_and_in_transformers(llama_dir, reference, setting):
    kwargs = {"device": "cpu", "num_blocks": 256, **SETTINGS[setting]}
    off = Engine(str(llama_dir), enable_prefix_caching=False, **kwargs)
    assert [o.token_ids for o in off.generate(PROMPTS, GREEDY)] == reference
    assert off.stats().prefix_cache_queries_total == 0

    on = Engine(str(llama_dir), **kwargs)
    first, _ = _generate_recording_starts(on, PROMPTS)
    assert first == reference
    s1 = on.stats()
    assert s1.prefix_cache_queries_total >= sum(len(p) for p in PROMPTS)
    if setting in ("few-seqs", "recompute-pressure"):
        assert s1.prefix_cache_hits_total > 0, "later admissions find earlier prompts cached"

    again, starts = _generate_recording_starts(on, PROMPTS)  # the same prompts: blocks re-used
    assert again == reference
    s2 = on.stats()
    assert s2.prefix_cache_hits_total > s1.prefix_cache_hits_total
    bs = on.block_size
    for p, start in zip(PROMPTS, starts, strict=True):
        assert start % bs == 0 and start <= len(p) - 1, "whole blocks, never the last token"
    if "pressure" not in setting:  # with room, every shared block is still there
        expected = [(len(p) - 1) // bs * bs for p in PROMPTS]
        assert starts == expected
    on.check_integrity()


def test_exact_block_multiple_recomputes_only_its_last_block(llama_dir, reference):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=64, block_size=4)
    prompt = PROMPTS[2]  # 16 tokens
    engine.generate([prompt], GREEDY)
    toks, starts = _generate_recording_starts(engine, [prompt])
    assert starts == [12] and toks == [reference[2]]


def test_sampled_request_same_tokens_with_caching_on_and_off(llama_dir):
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    runs = []
    for enable in (False, True, True):
        engine = Engine(str(llama_dir), device="cpu", num_blocks=256, block_size=4,
                        enable_prefix_caching=enable)
        runs.append([o.token_ids for o in engine.generate(PROMPTS, params)])
        if enable:
            runs.append([o.token_ids for o in engine.generate(PROMPTS, params)])  # from the cache
            assert engine.stats().prefix_cache_hits_total > 0
    assert all(r == runs[0] for r in runs)


def test_abort_of_a_sharing_request_frees_only_its_own_blocks(llama_dir, reference):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=64, block_size=4)
    a = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # a's prompt computed and cached
    b = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()  # b admitted on a's prefix
    ta, tb = engine.kv.block_tables[a], engine.kv.block_tables[b]
    shared = engine.kv.num_shared_prefix_blocks(b, len(tb))
    assert shared == len(SYSTEM) // 4 and tb[:shared] == ta[:shared]
    free = engine.kv.num_free_blocks
    engine.abort_request(b)
    assert engine.kv.num_free_blocks == free + len(tb) - shared
    assert all(engine.kv.pool.ref_count(x) == 1 for x in ta)
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests == {}
    # a's output is the reference: nothing it reads was freed under it
    c = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert c.token_ids == reference[0]


def test_output_blocks_are_cached_too(llama_dir, reference):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=64, block_size=4)
    out = engine.generate([PROMPTS[5]], GREEDY)[0]  # 13 + 16 tokens: the last one never computed
    keys = block_hashes(PROMPTS[5] + out.token_ids[:-1], 4)
    assert set(keys) <= set(engine.kv.cached_keys())
    longer = PROMPTS[5] + out.token_ids
    toks, starts = _generate_recording_starts(engine, [longer], SamplingParams(max_tokens=4, temperature=0))
    assert starts == [len(keys) * 4]


def test_static_batching_ignores_the_cache(llama_dir, reference):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=256, block_size=4, batching="static")
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    s = engine.stats()
    assert s.prefix_cache_queries_total == 0 and engine.kv.pool.num_cached_blocks == 0


# -- the scheduler alone: swap with shared blocks ----------------------------------------


def _step(sched: ContinuousScheduler, token: int = 7):
    out = sched.schedule()
    sampled = [r for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
               if r.num_computed_tokens + n == r.num_tokens]
    sched.update_after_step(out)
    for r in sampled:
        r.append_token(token)
    return out


def test_a_burst_with_one_prefix_computes_it_once():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    system = list(range(1, 21))  # 5 blocks
    first, second = (Request(f"s{i}", system + [50 + i], SamplingParams(max_tokens=4), arrival_seq=i)
                     for i in range(2))
    other = Request("other", list(range(100, 113)), SamplingParams(max_tokens=4), arrival_seq=2)
    for r in (first, second, other):
        s.add(r)
    out = _step(s)
    assert out.requests == [first, other], "second sits out: first fills the blocks it would compute"
    assert s.waiting.peek() is second
    out = _step(s)
    assert second in out.requests and second.num_computed_tokens == 21
    assert kv.prefix_cache_hits_total == 20 and kv.block_tables["s1"][:5] == kv.block_tables["s0"][:5]
    for r in (first, second, other):
        r.status = RequestStatus.FINISHED_ABORTED
        s.remove(r)
    kv.check_integrity()


def _swap_setup():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, swap=SwapAllocator(8),
                            policy=PreemptionPolicy("swap", watermark=0.0, min_resident_steps=0))
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50), arrival_seq=0)
    b = Request("b", [1, 2, 3, 4, 9], SamplingParams(max_tokens=50), arrival_seq=1)
    s.add(a)
    _step(s)  # a computed, its 2 full blocks cached
    s.add(b)
    out = _step(s)
    assert out.num_scheduled_tokens == [1, 1] and b.num_computed_tokens == 5, "b started at 4 cached tokens"
    shared, own = kv.block_tables["b"][:2], kv.block_tables["b"][2]
    assert shared == kv.block_tables["a"][:2]
    assert s.preempt(b, "swap")
    out = s.schedule()  # the copy-out of b: its own block only
    assert [d for d, _ in out.blocks_to_swap_out] == [own] and "b" not in kv.block_tables
    s.update_after_step(out)
    for r in out.requests:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    return kv, s, a, b, shared


def test_swap_keeps_shared_blocks_on_the_device_and_finds_them_again():
    kv, s, a, b, shared = _swap_setup()
    assert all(kv.pool.ref_count(x) == 1 for x in shared), "b dropped its references"
    out = s.schedule()
    assert b.status == RequestStatus.SWAPPING_IN and len(out.blocks_to_swap_in) == 1
    assert kv.block_tables["b"][:2] == shared
    s.update_after_step(out)
    _step(s)
    assert b.status == RequestStatus.RUNNING and s.num_recomputes_total == 0
    for r in (a, b):
        r.status = RequestStatus.FINISHED_ABORTED
        s.remove(r)
    kv.check_integrity()
    s.swap.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and s.swap.num_free_blocks == s.swap.num_blocks


def test_swapped_sequence_whose_shared_block_was_evicted_is_recomputed():
    kv, s, a, b, shared = _swap_setup()
    a.status = RequestStatus.FINISHED_STOPPED
    s.remove(a)
    taken = kv.pool.allocate(kv.num_free_blocks)  # pressure evicts every cached block
    assert kv.pool.num_cached_blocks == 0
    kv.pool.free(taken)
    out = s.schedule()
    assert not out.blocks_to_swap_in and s.num_recomputes_total == 1
    assert s.swap.num_free_blocks == s.swap.num_blocks, "its swap copy is dropped"
    assert out.requests == [b] and out.num_scheduled_tokens == [b.num_tokens], "recomputed from 0"
    s.update_after_step(out)
    b.status = RequestStatus.FINISHED_ABORTED
    s.remove(b)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


# -- KV events: what the worker's occupancy streams publish -------------------------------


def test_event_streams_start_with_a_reset_and_then_carry_net_changes(llama_dir):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=16, block_size=4)
    log = KVEventLog(engine.kv)
    first = log.subscribe()
    assert first.take() == ([], [], True)
    engine.generate(PROMPTS[:2], GREEDY)
    log.publish(engine.kv)
    stored, evicted, reset = first.take()
    assert not reset and set(stored) == set(engine.kv.cached_keys())
    assert not set(evicted) & set(stored), "stored and evicted in between: reported evicted"
    late = log.subscribe()
    stored2, evicted2, reset2 = late.take()
    assert reset2 and set(stored2) == set(engine.kv.cached_keys()) and not evicted2
    before = set(engine.kv.cached_keys())
    engine.generate([PROMPTS[5]], GREEDY)  # 16 blocks: evicts some of the others
    log.publish(engine.kv)
    after = set(engine.kv.cached_keys())
    for stream in (first, late):
        stored, evicted, reset = stream.take()
        assert not reset
        assert set(stored) == after - before
        assert set(evicted) >= before - after and not set(evicted) & after
    assert first.take() == ([], [], False)
    log.unsubscribe(late)


def test_a_stream_that_falls_behind_is_reset_within_its_bound(llama_dir):
    engine = Engine(str(llama_dir), device="cpu", num_blocks=16, block_size=4)
    log = KVEventLog(engine.kv)
    log._limit = 3
    stream = log.subscribe()
    stream.take()
    for p in PROMPTS[:3]:
        engine.generate([p[:-1] + [5]], GREEDY)
        log.publish(engine.kv)
    stored, evicted, reset = stream.take()
    assert reset and set(stored) == set(engine.kv.cached_keys()) and not evicted


def test_engine_loop_publishes_keys_and_reports_carry_them(llama_dir):
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.report import occupancy_report

    engine = Engine(str(llama_dir), device="cpu", num_blocks=64, block_size=4)
    loop = EngineLoop(engine, emit=lambda batch: None, notify=lambda: None)
    stream = loop.kv_events.subscribe()
    loop.start()
    try:
        loop.call(lambda: engine.add_request(PROMPTS[0], GREEDY, request_id="x")).result(5)
        deadline = time.monotonic() + 60
        while loop.num_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        keys = loop.call(engine.kv.cached_keys).result(5)
    finally:
        loop.stop()
    stored, evicted, reset = stream.take()
    assert reset and set(stored) == set(keys) and len(keys) == (len(PROMPTS[0]) + 15) // 4
    report = occupancy_report(
        loop.snapshot, worker_id="w", seq=1, finished_request_ids=[], max_num_seqs=8,
        max_model_len=512, draining=False, stored_block_hashes=stored, evicted_block_hashes=evicted,
        block_hashes_reset=reset,
    )
    assert isinstance(report, cluster_pb2.OccupancyReport)
    assert report.block_hashes_reset and set(report.stored_block_hashes) == set(keys)
    assert report.prefix_cache_queries_total == len(PROMPTS[0])
    assert report.prefix_cache_hits_total == 0


def test_prefix_cache_counters_reach_prometheus():
    from types import SimpleNamespace

    from pagefleet.common.metrics import WorkerMetrics

    m = WorkerMetrics()
    base = dict(num_blocks=10, num_free_blocks=10, num_running=0, num_waiting=0)
    m.observe_stats(SimpleNamespace(**base, prefix_cache_queries_total=40, prefix_cache_hits_total=32))
    m.observe_stats(SimpleNamespace(**base, prefix_cache_queries_total=50, prefix_cache_hits_total=32))
    get = m.registry.get_sample_value
    assert get("pagefleet:prefix_cache_queries_total") == 50
    assert get("pagefleet:prefix_cache_hits_total") == 32


def test_worker_flag():
    from pagefleet.worker.service import build_parser

    assert build_parser().parse_args([]).enable_prefix_caching is True
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
