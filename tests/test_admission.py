"""The scheduler's worker table: admission and victim choice, from reports alone (no processes)."""

from __future__ import annotations

from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.queue import Pending
from pagefleet.scheduler.workers import WorkerEntry, pick_victims, pick_worker

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
    assert pick_worker([w], second, HEADROOM) is None


def test_a_finished_request_is_owed_nothing():
    w = WorkerEntry("w", "addr", report=report(free=32))
    w.place(pending("a", 60, 200), HEADROOM)
    w.apply_report(report(free=28, held={"a": 4}))
    done = cluster_pb2.OccupancyReport()
    done.CopyFrom(report(free=32))
    done.finished_request_ids.append("a")
    finished, _ = w.apply_report(done)
    assert finished == ["a"]
    assert w.num_available_blocks == 32


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
