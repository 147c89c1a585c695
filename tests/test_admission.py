"""The scheduler's worker table: admission and victim choice, from reports alone (no processes)."""

from __future__ import annotations

from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.placement import PlacementConfig, Placer
from pagefleet.scheduler.prefix_index import PrefixIndex
from pagefleet.scheduler.queue import Pending
from pagefleet.scheduler.workers import WorkerEntry, pick_victims

HEADROOM = 1000


def pending(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Pending:
    msg = cluster_pb2.AssignRequest(
        request_id=rid, prompt_token_ids=[1] * prompt_len, priority=priority,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
    )
    return Pending(rid, f"{rid}-entry", msg, 0)


def report(free: int, held: dict[str, int] | None = None, swapped: int = 0) -> cluster_pb2.OccupancyReport:
    return cluster_pb2.OccupancyReport(
        worker_id="w", num_blocks=32, num_free_blocks=free, block_size=16, max_num_seqs=256,
        max_model_len=2048, blocks_per_request=held or {}, request_ids=list(held or {}),
        num_swapped_blocks=swapped,
    )


def test_a_request_is_owed_its_headroom_until_it_has_grown_into_it():
    w = WorkerEntry("w", "addr", report=report(free=32))
    first = pending("a", prompt_len=60, max_tokens=200)  # ceil(260 / 16) = 17 blocks
    assert w.fits(first, HEADROOM)
    w.place(first, HEADROOM)
    assert w.num_available_blocks == 15
    second = pending("b", prompt_len=60, max_tokens=200)
    assert not w.fits(second, HEADROOM)
    # The report shows `a` holding its prompt's 4 blocks: 13 more are still owed to it.
    w.apply_report(report(free=28, held={"a": 4}))
    assert w.num_available_blocks == 28 - 13
    assert not w.fits(second, HEADROOM), "filling the worker now would only cause preemptions there"
    # `a` has grown into what it was owed: nothing more is owed.
    w.apply_report(report(free=15, held={"a": 17}))
    assert w.num_available_blocks == 15
    assert Placer(PlacementConfig(), PrefixIndex()).choose([w], second, HEADROOM) is None


def test_a_finished_request_is_owed_nothing():
    w = WorkerEntry("w", "addr", report=report(free=32))
    w.place(pending("a", 60, 200), HEADROOM)
    w.apply_report(report(free=28, held={"a": 4}))
    done = cluster_pb2.OccupancyReport()
    done.CopyFrom(report(free=32))
    done.finished_request_ids.append("a")
    vanished, _ = w.apply_report(done)
    assert vanished == []  # finished, not lost
    assert w.placed["a"].finished  # placed until its final write is seen in Redis, owed nothing
    assert w.num_available_blocks == 32


def test_a_request_that_vanishes_unfinished_is_reported_to_be_resumed():
    w = WorkerEntry("w", "addr", report=report(free=32))
    w.place(pending("a", 60, 200), HEADROOM)
    w.apply_report(report(free=28, held={"a": 4}))
    vanished, orphans = w.apply_report(report(free=32, held={"b": 1}))
    assert vanished == ["a"] and orphans == ["b"]


def test_swapped_sequences_hold_their_room_once():
    w = WorkerEntry("w", "addr", report=report(free=32))
    w.place(pending("a", 60, 200), HEADROOM)
    w.apply_report(report(free=28, held={"a": 4}))
    # Swapped out: its 4 blocks sit in the swap pool and come back first; nothing else owed now.
    w.apply_report(report(free=32, held={"a": 0}, swapped=4))
    assert w.num_available_blocks == 28


def test_victims_make_room_for_what_they_hold_and_what_they_were_owed():
    w = WorkerEntry("w", "addr", report=report(free=32))
    for rid in ("lo1", "lo2"):
        w.place(pending(rid, 60, 180, priority=0), HEADROOM)  # 15 blocks each
    w.apply_report(report(free=22, held={"lo1": 5, "lo2": 5}))
    assert w.num_available_blocks == 2
    high = pending("hi", 392, 8, priority=10)  # 25 blocks
    found = pick_victims([w], high, HEADROOM, cooldown_s=0.0)
    assert found is not None
    worker, victims = found
    assert worker is w
    assert [v.pending.request_id for v in victims] == ["lo2", "lo1"]  # most recently placed first
    same = pending("eq", 392, 8, priority=0)
    assert pick_victims([w], same, HEADROOM, cooldown_s=0.0) is None, "never for an equal priority"


def test_a_worker_with_every_seat_taken_gives_one_up_for_a_higher_priority():
    """Blocks to spare but all ``max_num_seqs`` seats running lower priorities: preempting one
    of them is what makes room (before, no victim was picked and the request waited for a
    long one to end)."""
    seats = cluster_pb2.OccupancyReport(worker_id="w", num_blocks=1000, num_free_blocks=1000, block_size=16,
                                        max_num_seqs=2, max_model_len=8192)
    w = WorkerEntry("w", "addr", report=seats)
    for rid in ("lo1", "lo2"):
        w.place(pending(rid, 60, 3000, priority=0), HEADROOM)
    seats.blocks_per_request.update({"lo1": 5, "lo2": 5})
    seats.request_ids[:] = ["lo1", "lo2"]
    seats.num_free_blocks = 990
    w.apply_report(seats)
    high = pending("hi", 60, 8, priority=100)
    assert not w.fits(high, HEADROOM), "no seat"
    found = pick_victims([w], high, HEADROOM, cooldown_s=0.0)
    assert found is not None and [v.pending.request_id for v in found[1]] == ["lo2"]
    assert pick_victims([w], pending("eq", 60, 8, priority=0), HEADROOM, cooldown_s=0.0) is None


def test_blocks_shared_with_running_requests_cost_nothing_but_unused_cached_ones_count():
    """An unused cached block is among the worker's free blocks and stops being free when
    reused: only the blocks shared with a request in flight there are not taken again."""
    w = WorkerEntry("w", "addr", report=report(free=20))
    p = pending("p", prompt_len=16 * 16 + 32, max_tokens=64)  # 18 prompt blocks + 4 of headroom
    assert w.blocks_needed(p, 64) == 22
    assert not w.fits(p, 64), "its 16 cached blocks are among the 20 free: 22 > 20"
    assert w.fits(p, 64, num_shared_blocks=16), "16 shared with a running request: 6 new blocks"
    w.place(p, 64, num_shared_blocks=16)
    assert w.num_available_blocks == 20 - 6
    # Once reported, it is owed what its table (shared blocks included) has yet to grow: 22 - 18.
    w.apply_report(report(free=14, held={"p": 18}))
    assert w.num_available_blocks == 14 - 4
