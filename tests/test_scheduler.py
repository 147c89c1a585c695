"""The iteration-level scheduler with fake model outputs (no model, no tensors)."""

from __future__ import annotations

from pagefleet.common.sampling_params import SamplingParams
from pagefleet.worker.continuous_scheduler import ContinuousScheduler
from pagefleet.worker.kv_cache_manager import KVCacheManager
from pagefleet.worker.request import Request, RequestStatus
from pagefleet.worker.static_scheduler import StaticScheduler

_arrivals = iter(range(10**9))


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, list(range(1, prompt_len + 1)), params, priority=priority, arrival_seq=next(_arrivals))


def run_step(sched, fake_token: int = 7) -> dict[str, int]:
    """One step with a fake runner: every request whose step reaches its end samples a token."""
    out = sched.schedule()
    plan = {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)}
    sampled = [r for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
               if n and not r.is_finished and r.num_computed_tokens + n == r.num_tokens]
    sched.update_after_step(out)
    for r in sampled:
        r.append_token(fake_token)
        if r.check_stop_token(fake_token) is not None:
            r.status = RequestStatus.FINISHED_LENGTH
            sched.remove(r)
    return plan


def test_decode_first_then_chunked_prefill_under_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a = make_request("a", 3)
    s.add(a)
    assert run_step(s) == {"a": 3}
    long = make_request("long", 25)
    s.add(long)
    # a decodes (1 token), long gets the rest of the budget as a chunk.
    assert run_step(s) == {"a": 1, "long": 9}
    assert run_step(s) == {"a": 1, "long": 9}
    assert run_step(s) == {"a": 1, "long": 7}
    assert long.num_computed_tokens == 25 and long.num_output_tokens == 1
    assert run_step(s) == {"a": 1, "long": 1}
    kv.check_integrity()


def test_max_num_seqs_caps_running():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = ContinuousScheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(make_request(f"r{i}", 2))
    assert set(run_step(s)) == {"r0", "r1"}
    assert s.num_running == 2 and s.num_waiting == 2


def test_waiting_is_fcfs_and_blocks_gate_admission():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    s.add(make_request("big", 12))  # 3 blocks
    s.add(make_request("small", 8))  # 2 blocks: does not fit behind big
    s.add(make_request("tiny", 1))  # would fit, but must not jump the queue
    assert run_step(s) == {"big": 12}
    assert s.num_waiting == 2


def test_preemption_frees_the_lowest_priority_latest_request():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    lo = make_request("lo", 2, max_tokens=10, priority=0)
    hi = make_request("hi", 2, max_tokens=10, priority=5)
    s.add(lo)  # arrives first, and is still the victim: priority comes before age
    s.add(hi)
    run_step(s)  # both prefilled: 1 block each, 1 free
    plan = run_step(s)  # both need a second block: hi takes the free one, lo is the victim
    assert lo.status == RequestStatus.PREEMPTED and lo.num_computed_tokens == 0
    assert plan == {"hi": 1}
    assert s.num_preemptions_total == 1
    assert s.waiting.peek() is lo
    kv.check_integrity()


def test_preempted_request_is_recomputed_with_its_output():
    kv = KVCacheManager(num_blocks=3, block_size=2)  # each fits alone, not both
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 2, max_tokens=4), make_request("b", 1, max_tokens=4)
    s.add(a)
    s.add(b)
    for _ in range(20):
        if not s.has_unfinished():
            break
        run_step(s)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert s.num_preemptions_total >= 1
    assert kv.num_free_blocks == 3
    kv.check_integrity()


def test_request_preempting_itself_waits():
    kv = KVCacheManager(num_blocks=1, block_size=2)
    s = ContinuousScheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_request("a", 2, max_tokens=3)
    s.add(a)
    run_step(s)
    plan = run_step(s)  # needs a second block, nobody else to preempt
    assert plan == {}
    assert a.status == RequestStatus.PREEMPTED


def test_static_batch_runs_every_row_until_the_longest_is_done():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = StaticScheduler(kv, max_num_seqs=2)
    short, long_, later = make_request("s", 3, 1), make_request("l", 5, 4), make_request("x", 2, 1)
    for r in (short, long_, later):
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["s", "l"]
    assert out.num_scheduled_tokens == [3, 5] and out.num_padding_tokens == [2, 0]
    # Reserved up front: padded prompt (5) + longest max_tokens (4) = 9 tokens = 3 blocks per row.
    assert kv.num_free_blocks == 64 - 6
    s.update_after_step(out)
    for r in out.requests:
        r.append_token(7)
    short.status = RequestStatus.FINISHED_LENGTH
    s.remove(short)
    for _ in range(3):
        out = s.schedule()
        assert [r.request_id for r in out.requests] == ["s", "l"], "the done row still runs"
        assert out.num_padding_tokens[0] == 1
        s.update_after_step(out)
        long_.append_token(7)
    long_.status = RequestStatus.FINISHED_LENGTH
    s.remove(long_)
    assert kv.num_free_blocks == 64
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["x"]
