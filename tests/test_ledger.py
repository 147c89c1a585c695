"""The scheduler's ledger, driven directly: no Redis, no gRPC, no sleeps; a clock of our own.

Hand-written sequences check each operation's answer; a property test runs random event
sequences (arrive, place, answer, report, finish, drop, fenced, die, cancel, deadline, preempt) and
checks the invariants after every step and that every request ends exactly once."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.common.blocks import block_hashes
from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.ledger import MOVE_RETRY_S, ROUND, Decision, Ledger, LedgerConfig
from pagefleet.scheduler.moves import DRAIN_TRANSFERS_PER_SOURCE, MoveConfig
from pagefleet.scheduler.prefix_index import Match
from pagefleet.scheduler.workers import WorkerEntry

BS = 16
HEADROOM = 64
SYSTEM = list(range(1, 16 * BS + 1))  # a 16-block shared prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def assign(rid: str, prompt: list[int], max_tokens: int = 64, priority: int = 0,
           deadline_s: float | None = None) -> cluster_pb2.AssignRequest:
    return cluster_pb2.AssignRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
        block_hashes=block_hashes(prompt, BS), hash_block_size=BS, priority=priority,
        deadline_unix_ms=int(deadline_s * 1000) if deadline_s is not None else 0)


def report(wid: str, free: int = 256, num_blocks: int = 256, max_num_seqs: int = 256,
           **kw) -> cluster_pb2.OccupancyReport:
    return cluster_pb2.OccupancyReport(worker_id=wid, num_blocks=num_blocks, num_free_blocks=free, block_size=BS,
                                       max_num_seqs=max_num_seqs, max_model_len=4096, **kw)


def ledger_with(*wids: str, clock: Clock | None = None, **cfg) -> Ledger:
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, **cfg), clock=clock or Clock(), wall_clock=clock or Clock())
    for wid in wids:
        ledger.add_worker(WorkerEntry(wid, f"{wid}-addr"))
        ledger.on_report(ledger.workers[wid], report(wid))
    return ledger


def place_all(ledger: Ledger) -> list[tuple[str, str]]:
    """Rounds until the queue's head waits, every Assign accepted; (request, worker) claimed."""
    out = []
    while (d := ledger.decide_round()).claims:
        for p, pl in d.claims:
            ledger.settled(p, pl.worker, True)
            out.append((p.request_id, pl.worker.worker_id))
        ledger.check_integrity()
    return out


# -- one operation at a time -----------------------------------------------------------------------
def test_reports_teach_the_index_placements_hold_keys_and_finishes_release_them():
    ledger = ledger_with("a", "b")
    cached = assign("x", SYSTEM).block_hashes
    ledger.on_report(ledger.workers["b"], report("b", block_hashes_reset=True, stored_block_hashes=cached))
    assert ledger.index.num_worker_keys("b") == 16
    for i in range(3):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", SYSTEM + [50 + i] * 8))
    d = ledger.decide_round()
    assert [(p.request_id, pl.worker.worker_id, pl.decision) for p, pl in d.claims] == [
        ("r0", "b", "cache"), ("r1", "b", "cache"), ("r2", "b", "cache")]
    for p, pl in d.claims:
        ledger.settled(p, pl.worker, True)
    ledger.check_integrity()
    # b evicts the prefix and reports the requests finished: placed until their writes are durable.
    out = ledger.on_report(ledger.workers["b"], report("b", evicted_block_hashes=cached,
                                                       finished_request_ids=["r0", "r1", "r2"]))
    assert out.resume == [] and out.withdraw == []
    assert set(ledger.where) == {"r0", "r1", "r2"}
    for rid in ("r0", "r1", "r2"):
        ledger.forget(rid)
        ledger.check_integrity()
    assert ledger.index.match(cached) == {} and not ledger.where and not ledger.known
    # A report older than those finishes still lists r0: no orphan. One never placed is.
    out = ledger.on_report(ledger.workers["b"], report("b", free=250, request_ids=["r0", "zz"],
                                                       blocks_per_request={"r0": 3, "zz": 3}))
    assert out.withdraw == ["zz"]
    ledger.check_integrity()


def test_a_dead_workers_requests_are_handed_back_and_placed_elsewhere_with_their_keys():
    ledger = ledger_with("a", "b")
    ledger.take("r3", "e3", assign("r3", SYSTEM))
    ((rid, wid),) = place_all(ledger)
    cached = ledger.known["r3"].assign.block_hashes
    assert set(ledger.index.match(cached)) == {wid}
    resume = ledger.worker_dead(ledger.workers[wid])
    assert [p.request_id for p in resume] == ["r3"] and ledger.num_reassigned == 1
    ledger.check_integrity()  # r3 is in hand: neither queued nor placed
    assert ledger.worker_dead(WorkerEntry(wid, "x", alive=False)) is None
    assert ledger.resume(resume[0], [7, 8])
    assert list(ledger.queue.peek().assign.output_token_ids) == [7, 8]
    (other,) = {"a", "b"} - {wid}
    assert place_all(ledger) == [("r3", other)]
    assert ledger.index.match(cached) == {other: Match(16, 16)}
    ledger.check_integrity()


def test_a_request_with_nothing_left_to_generate_stays_in_hand_to_be_finished():
    ledger = ledger_with("a")
    ledger.take("r", "e", assign("r", [1, 2, 3], max_tokens=2))
    place_all(ledger)
    (p,) = ledger.worker_dead(ledger.workers["a"])
    assert not ledger.resume(p, [5, 6])
    assert len(ledger.queue) == 0 and "r" in ledger.known
    ledger.check_integrity()
    ledger.forget("r")
    assert not ledger.known and ledger.finished_recently("r")
    ledger.check_integrity()


def test_a_request_forgotten_while_in_hand_is_not_queued_again():
    ledger = ledger_with("a")
    ledger.take("r", "e", assign("r", [1, 2, 3]))
    place_all(ledger)
    (p,) = ledger.worker_dead(ledger.workers["a"])
    ledger.forget("r")  # cancelled while its output was being read
    assert ledger.resume(p, [5]) and len(ledger.queue) == 0
    ledger.check_integrity()


def test_a_refused_assign_sends_the_request_back_and_the_worker_takes_no_more():
    ledger = ledger_with("a", "b")
    ledger.take("r", "e", assign("r", [1] * 40))
    (p, pl), = ledger.decide_round().claims
    ledger.settled(p, pl.worker, False)
    assert not pl.worker.accepting and ledger.queue.peek() is p
    ledger.check_integrity()
    (other,) = {"a", "b"} - {pl.worker.worker_id}
    assert place_all(ledger) == [("r", other)]


def test_an_answer_for_a_request_no_longer_placed_there_changes_nothing():
    ledger = ledger_with("a")
    ledger.take("r", "e", assign("r", [1] * 40, deadline_s=2000))
    (p, pl), = ledger.decide_round().claims
    ledger.forget("r")
    ledger.settled(p, pl.worker, False)
    assert pl.worker.accepting and len(ledger.queue) == 0
    ledger.check_integrity()


def test_a_vanished_request_is_handed_back_and_the_round_may_gain():
    ledger = ledger_with("a")
    ledger.take("r", "e", assign("r", [1] * 40))
    place_all(ledger)
    w = ledger.workers["a"]
    assert ledger.on_report(w, report("a", free=250, request_ids=["r"], blocks_per_request={"r": 3})).resume == []
    out = ledger.on_report(w, report("a"))  # gone, never reported finished
    assert [p.request_id for p in out.resume] == ["r"] and out.room
    assert not ledger.where
    ledger.check_integrity()


def test_a_request_dropped_while_waiting_on_its_worker_is_handed_back():
    ledger = ledger_with("a")
    ledger.take("r", "e", assign("r", [1] * 40))
    ((p, pl),) = ledger.decide_round().claims
    ledger.settled(p, pl.worker, True)
    w = ledger.workers["a"]
    # Not named yet (the Assign may not have reached the engine): nothing is concluded.
    assert ledger.on_report(w, report("a", holdings_delta=True)).resume == []
    # Named held without device blocks (waiting in the worker's own queue), then released unfinished.
    assert ledger.on_report(w, report("a", holdings_delta=True, request_ids=["r"])).resume == []
    ledger.check_integrity()
    out = ledger.on_report(w, report("a", holdings_delta=True, released_request_ids=["r"]))
    assert [q.request_id for q in out.resume] == ["r"] and out.room
    assert not ledger.where and not w.placed and ledger.index.holder("r") is None
    ledger.check_integrity()
    assert ledger.resume(p, []) and [q.request_id for q in ledger.queue.ordered()] == ["r"]
    ledger.check_integrity()


def test_dropped_hands_back_only_what_is_still_placed_there_and_unfinished():
    ledger = ledger_with("a")
    for rid in ("r", "s"):
        ledger.take(rid, f"e{rid}", assign(rid, [1] * 40))
    assert place_all(ledger) == [("r", "a"), ("s", "a")]
    a = ledger.workers["a"]
    ledger.on_report(a, report("a", holdings_delta=True, request_ids=["r", "s"], finished_request_ids=["s"]))
    ledger.add_worker(WorkerEntry("b", "b-addr"))
    b = ledger.workers["b"]
    ledger.on_report(b, report("b"))
    assert ledger.dropped(b, ["r", "s", "never-placed"]) == []  # placed on a, not b
    out = ledger.dropped(a, ["r", "s", "never-placed"])
    assert [p.request_id for p in out] == ["r"]
    assert ledger.where == {"s": "a"}  # reported finished: it waits for its final write there
    assert ledger.dropped(a, ["r"]) == []  # in hand already
    ledger.check_integrity()


def test_deadlines_take_waiting_requests_out_and_name_running_ones():
    clock = Clock()
    ledger = ledger_with("a", clock=clock)
    ledger.take("run", "e1", assign("run", [1] * 40, deadline_s=clock.now + 5))
    place_all(ledger)
    ledger.take("big", "e2", assign("big", [1] * 4000, deadline_s=clock.now + 1))  # fits nowhere now
    assert place_all(ledger) == [] and ledger.decide_round().refused == []  # it would, on an empty worker
    assert ledger.expired() == ([], [])
    clock.now += 2
    waited, running = ledger.expired()
    assert [p.request_id for p in waited] == ["big"] and running == []
    ledger.check_integrity()  # "big" is in hand until it is finished
    ledger.forget("big")
    clock.now += 5
    assert ledger.expired() == ([], ["run"]) and "run" in ledger.where


def test_a_request_no_single_worker_takes_is_refused_and_the_queue_goes_on():
    """A long context on one worker and a large pool on another take nothing neither takes
    alone: such a head is refused, not left to hold the queue; a dead worker's limits count
    while it may come back, then no more."""
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock)
    for wid, blocks, context in [("long", 100, 8192), ("wide", 10_000, 2048)]:  # 1,600 tokens; 160,000
        ledger.add_worker(WorkerEntry(wid, f"{wid}-addr"))
        ledger.on_report(ledger.workers[wid], cluster_pb2.OccupancyReport(
            worker_id=wid, num_blocks=blocks, num_free_blocks=blocks, block_size=BS, max_num_seqs=256,
            max_model_len=context))
    ledger.take("big", "e0", assign("big", [1] * 2000, max_tokens=100))  # 2,100 tokens
    for i in range(3):
        ledger.take(f"small{i}", f"e{i + 1}", assign(f"small{i}", [2 + i] * 10, max_tokens=10))
    d = ledger.decide_round()
    assert [(p.request_id, "2100 tokens of KV cache" in why) for p, why in d.refused] == [("big", True)]
    assert sorted(p.request_id for p, _ in d.claims) == ["small0", "small1", "small2"]
    ledger.forget("big")
    # the one worker that takes a long request dies: it is waited for, then not
    ledger.add_worker(WorkerEntry("huge", "huge-addr"))
    ledger.on_report(ledger.workers["huge"], cluster_pb2.OccupancyReport(
        worker_id="huge", num_blocks=10_000, num_free_blocks=10_000, block_size=BS, max_num_seqs=256,
        max_model_len=8192))
    ledger.worker_dead(ledger.workers["huge"])
    ledger.worker_dead(ledger.workers["long"])
    ledger.take("long", "e9", assign("long", [9] * 3000, max_tokens=100))
    assert ledger.decide_round().refused == []
    clock.now += 301
    (refused,) = ledger.decide_round().refused
    assert refused[0].request_id == "long" and "the longest any worker takes is 2048" in refused[1]


def test_a_request_queued_for_another_model_is_refused_not_answered_by_this_one():
    """Gateways map models to shards by ``--shards`` or by the order of ``--model``: two that
    disagreed sent one model's requests to the other's shard, whose workers answered them. A
    request says its model; a scheduler of another refuses it by name (one of no model, or a
    scheduler told none, is placed)."""
    ledger = ledger_with("a", model="tiny")
    for rid, model in [("mine", "tiny"), ("other", "llama"), ("any", "")]:
        msg = assign(rid, [1, 2, 3])
        msg.model = model
        ledger.take(rid, f"e-{rid}", msg)
    d = ledger.decide_round()
    assert [(p.request_id, "serves model 'tiny', not 'llama'" in why) for p, why in d.refused] == [("other", True)]
    assert sorted(p.request_id for p, _ in d.claims) == ["any", "mine"]
    told_none = ledger_with("a")
    msg = assign("other", [1, 2, 3])
    msg.model = "llama"
    told_none.take("other", "e", msg)
    assert place_all(told_none) == [("other", "a")]


def test_a_request_whose_deadline_passed_in_the_queue_is_never_placed():
    """Deadlines were looked at on the scheduler's tick: one that passed while the scheduler
    was held up (stopped, busy) was placed and run first, then cut as "while running"."""
    clock = Clock()
    ledger = ledger_with("a", clock=clock)
    ledger.take("late", "e1", assign("late", [1] * 8, deadline_s=clock.now + 1))
    ledger.take("fine", "e2", assign("fine", [2] * 8, deadline_s=clock.now + 60))
    clock.now += 2
    d = ledger.decide_round()
    assert [(p.request_id, why) for p, why in d.refused] == [("late", "deadline exceeded while waiting")]
    assert [p.request_id for p, _ in d.claims] == ["fine"]
    ledger.forget("late")
    ledger.check_integrity()


def test_a_silent_worker_is_named_on_the_ledgers_clock():
    clock = Clock()
    ledger = ledger_with("a", "b", clock=clock)
    clock.now += 3
    ledger.on_report(ledger.workers["b"], report("b"))
    assert [w.worker_id for w in ledger.silent_workers(2.0)] == ["a"]


def test_a_takeover_adopts_what_workers_hold_and_withdraws_orphans_once_done():
    ledger = ledger_with("a")
    ledger.adopting = True
    out = ledger.on_report(ledger.workers["a"], report("a", free=200, request_ids=["r", "zz"],
                                                       blocks_per_request={"r": 4, "zz": 4}))
    assert out.withdraw == []  # not before every pending entry was read
    holders = ledger.holders()
    assert ledger.take_over("r", "e1", assign("r", [1] * 40), holders.get("r")) is None
    p = ledger.take_over("q", "e2", assign("q", [1] * 40), holders.get("q"))
    assert p is not None and p.request_id == "q"  # ran nowhere known: resume it
    ledger.check_integrity()
    assert ledger.where == {"r": "a"} and ledger.workers["a"].placed["r"].reflected
    assert ledger.adopted() == [(ledger.workers["a"], ["zz"])] and not ledger.adopting


def full_of_low_priority(clock: Clock | None = None, **cfg) -> Ledger:
    """One worker of 64 blocks: 34 of them held by a running priority-0 request."""
    ledger = ledger_with(clock=clock, **cfg)
    w = WorkerEntry("a", "a-addr")
    ledger.add_worker(w)
    ledger.on_report(w, report("a", free=64, num_blocks=64))
    ledger.take("low", "e0", assign("low", [1] * 500, max_tokens=8))
    place_all(ledger)
    ledger.on_report(w, report("a", free=30, num_blocks=64, request_ids=["low"], blocks_per_request={"low": 34}))
    return ledger


def test_the_round_preempts_only_when_nothing_was_claimed_in_it():
    """The live rule: a blocked head ends a round that claimed something; the next round,
    claiming nothing, places it by preempting lower-priority sequences."""
    clock = Clock()
    ledger = full_of_low_priority(clock)
    ledger.take("small", "e1", assign("small", [2] * 40, max_tokens=8))
    ledger.take("high", "e2", assign("high", [3] * 480, max_tokens=8, priority=1))  # 31 blocks: 27 left
    d = ledger.decide_round()
    assert [p.request_id for p, _ in d.claims] == ["small"] and d.victims == []
    ledger.settled(d.claims[0][0], ledger.workers["a"], True)
    d = ledger.decide_round()
    assert [(p.request_id, pl.decision) for p, pl in d.claims] == [("high", "preempt")]
    assert [v.pending.request_id for v in d.victims] == ["low"]
    ledger.check_integrity()
    ledger.preempted(d.victims[0])
    assert ledger.num_preemptions == 1 and d.victims[0].preempted_at == clock.now


def test_no_preemption_when_it_is_off():
    ledger = full_of_low_priority(preempt=False)
    ledger.take("high", "e2", assign("high", [3] * 480, max_tokens=8, priority=1))  # 31 blocks: 30 free
    assert ledger.decide_round() == Decision()
    assert "high" in ledger.queue


def test_a_round_claims_at_most_a_round():
    ledger = ledger_with("a")
    ledger.on_report(ledger.workers["a"], report("a", free=100_000, num_blocks=100_000, max_num_seqs=10_000))
    for i in range(ROUND + 10):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [1] * 8, max_tokens=4))
    assert len(ledger.decide_round().claims) == ROUND
    assert len(ledger.decide_round().claims) == 10
    ledger.check_integrity()


def test_the_public_counts_read_the_structures():
    ledger = ledger_with("a", "b")
    for i in range(3):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 40))
    ledger.decide_round()
    ledger.take("q", "eq", assign("q", [9] * 40))
    assert (ledger.num_waiting, ledger.num_known, ledger.num_placed, ledger.num_workers) == (1, 4, 3, 2)
    assert ledger.placed_on("r0") is ledger.workers[ledger.where["r0"]] and ledger.placed_on("q") is None
    assert not ledger.is_new("q") and not ledger.is_new("r0") and ledger.is_new("x")
    ledger.forget("r0")
    assert ledger.placed_on("r0") is None and not ledger.is_new("r0")  # finished recently: not taken again
    ledger.check_integrity()


# -- moving KV: roles, disaggregation, migration, transfers ------------------------------------------
def roled(roles: dict[str, str], clock: Clock | None = None, free: dict[str, int] | None = None,
          num_blocks: int = 256, **moves) -> Ledger:
    """Workers by role, each with ``num_blocks`` blocks (``free`` of them free, by worker)."""
    clock = clock or Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, moves=MoveConfig(**moves)), clock=clock, wall_clock=clock)
    for wid, role in roles.items():
        ledger.add_worker(WorkerEntry(wid, f"{wid}-addr", role=role))
        ledger.on_report(ledger.workers[wid], report(wid, free=(free or {}).get(wid, num_blocks), num_blocks=num_blocks))
    return ledger


def holding(ledger: Ledger, wid: str, blocks: dict[str, int], num_blocks: int = 256) -> None:
    """``wid`` reports holding ``blocks`` (request -> device blocks), the rest of its pool free."""
    ledger.on_report(ledger.workers[wid], report(wid, free=num_blocks - sum(blocks.values()), num_blocks=num_blocks,
                                                 request_ids=list(blocks), blocks_per_request=blocks))


def prefilled_on_p(roles: dict[str, str] | None = None, clock: Clock | None = None,
                   free: dict[str, int] | None = None, **moves):
    """A 300-token prompt placed on prefill worker p and prefilled there: the ledger, and the
    transfers to a decoding worker that start at once."""
    ledger = roled(roles or {"p": "prefill", "d": "decode"}, clock=clock, free=free, **moves)
    ledger.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger) == [("r", "p")]
    holding(ledger, "p", {"r": 19})
    return ledger, ledger.prefilled("r")


def test_a_worker_role_is_both_unless_given_and_must_be_known():
    assert WorkerEntry("a", "x").role == "both"
    assert WorkerEntry("a", "x", role="prefill").role == "prefill"
    with pytest.raises(ValueError, match="role"):
        WorkerEntry("a", "x", role="decoder")
    with pytest.raises(ValueError, match="short_prompt_tokens"):
        MoveConfig(short_prompt_tokens=-1)
    with pytest.raises(ValueError, match="migrat"):
        MoveConfig(migrate_above=0.5, migrate_below=0.8)


def test_long_prompts_go_to_prefill_workers_and_short_ones_to_decoding_workers():
    ledger = roled({"p": "prefill", "d": "decode"}, short_prompt_tokens=100)
    ledger.take("long", "e1", assign("long", [1] * 300))
    ledger.take("short", "e2", assign("short", [2] * 50))
    assert place_all(ledger) == [("long", "p"), ("short", "d")]


def test_a_prefix_cached_on_a_decoding_worker_is_prefilled_there():
    ledger = roled({"p": "prefill", "d": "decode"}, short_prompt_tokens=0)
    cached = assign("x", SYSTEM).block_hashes
    ledger.on_report(ledger.workers["d"], report("d", block_hashes_reset=True, stored_block_hashes=cached))
    ledger.take("hit", "e1", assign("hit", SYSTEM + [9] * 8))  # 16 of its 16 blocks cached on d
    ledger.take("miss", "e2", assign("miss", [3] * 300))
    assert place_all(ledger) == [("hit", "d"), ("miss", "p")]


def test_a_prompt_prefills_on_a_decoding_worker_while_no_prefill_worker_has_room():
    ledger = roled({"p": "prefill", "d": "decode"}, free={"p": 4})
    ledger.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger) == [("r", "d")]
    ledger = roled({"p": "prefill", "d": "decode"}, free={"p": 4}, local_prefill_when_full=False)
    ledger.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger) == [] and "r" in ledger.queue


def test_a_prefill_worker_with_a_full_prefill_queue_takes_no_more_and_the_rest_prefill_locally():
    ledger = roled({"p": "prefill", "d": "decode"}, prefill_queue_tokens=1000)
    for i in range(4):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 400))
    assert place_all(ledger) == [("r0", "p"), ("r1", "p"), ("r2", "p"), ("r3", "d")]  # p full past 1,000 tokens
    holding(ledger, "p", {"r0": 26, "r1": 26, "r2": 26})
    ledger.prefilled("r0")  # moving on: no longer in p's queue (800 tokens left there)
    ledger.take("r4", "e4", assign("r4", [9] * 400))
    assert place_all(ledger) == [("r4", "p")]
    ledger.check_integrity()


def test_a_prefilled_request_moves_to_a_decoding_worker_owned_by_one_worker_until_handed_over():
    ledger = roled({"p": "prefill", "d1": "decode", "d2": "decode"}, free={"d1": 100})
    ledger.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger) == [("r", "p")]
    holding(ledger, "p", {"r": 19})
    assert ledger.prefilled("nope") == [] and ledger.decide_moves() == []
    (t,) = ledger.prefilled("r")
    assert (t.source.worker_id, t.target.worker_id, t.reason, t.num_blocks) == ("p", "d2", "disaggregation", 19)
    assert ledger.where == {"r": "p"} and "r" in ledger.workers["d2"].placed  # a reservation on d2
    assert ledger.workers["d2"].num_available_blocks == 256 - 23  # (300 + 64 headroom) tokens: 23 blocks owed
    ledger.check_integrity()
    assert ledger.prefilled("r") == []  # already moving
    assert ledger.transfer_done("r") and ledger.where == {"r": "d2"} and "r" not in ledger.workers["p"].placed
    assert not ledger.transfer_done("r") and ledger.num_transfers_done == 1
    assert ledger.index.holder("r") == "d2"
    ledger.check_integrity()
    # p still lists r after the handover: withdrawn from it.
    assert ledger.on_report(ledger.workers["p"], report("p", request_ids=["r"], blocks_per_request={"r": 19})).withdraw \
        == ["r"]


def test_a_prefilled_request_waits_for_a_decoding_worker_with_room():
    ledger, moves = prefilled_on_p(free={"d": 4})
    assert moves == [] and ledger.decide_moves() == []
    holding(ledger, "d", {})
    (t,) = ledger.decide_moves()
    assert t.target.worker_id == "d"
    ledger.check_integrity()


def test_a_transfer_past_its_deadline_is_taken_back_from_both_sides_and_counted():
    clock = Clock()
    ledger, (t,) = prefilled_on_p(clock=clock, timeout_s=2.0)
    clock.now += 1.5
    assert ledger.renew_transfer("r") and not ledger.renew_transfer("zz")
    clock.now += 1.9
    assert ledger.expired_transfers() == []
    clock.now += 0.2
    assert ledger.expired_transfers() == [t] and ledger.num_transfers_expired == 1
    assert not ledger.where and not ledger.workers["d"].placed and not ledger.workers["p"].placed
    ledger.check_integrity()  # in hand: resumed from its tokens
    assert ledger.resume(t.pending, [5]) and ledger.queue.peek() is t.pending
    assert not ledger.transfer_done("r")
    ledger.check_integrity()


def test_a_side_dying_calls_the_move_off_and_the_request_stays_with_exactly_one_worker():
    ledger, (t,) = prefilled_on_p({"p": "prefill", "d1": "decode", "d2": "decode"}, free={"d2": 100})
    assert t.target.worker_id == "d1"
    assert ledger.worker_dead(ledger.workers["d1"]) == []  # the target: r stays on p, waiting again
    assert ledger.called_off() == [t] and ledger.called_off() == [] and ledger.where == {"r": "p"}
    ledger.check_integrity()
    holding(ledger, "d2", {})
    (t2,) = ledger.decide_moves()
    assert t2.target.worker_id == "d2"
    (p,) = ledger.worker_dead(ledger.workers["p"])  # the source: r is in hand, d2's reservation goes
    assert p.request_id == "r" and ledger.called_off() == [t2] and not ledger.workers["d2"].placed
    ledger.check_integrity()
    assert ledger.decide_moves() == []


def test_a_refused_transfer_leaves_the_request_with_its_source_to_wait_for_another_target():
    clock = Clock()
    ledger, (t,) = prefilled_on_p(clock=clock)
    assert ledger.transfer_refused("r") and not ledger.transfer_refused("r")
    assert ledger.called_off() == [] and ledger.where == {"r": "p"} and not ledger.workers["d"].placed
    ledger.check_integrity()
    assert ledger.decide_moves() == []  # not handed off again at once
    ledger.take("q", "eq", assign("q", [2] * 300))  # prefilled after it: not held up by it
    assert place_all(ledger) == [("q", "p")]
    holding(ledger, "p", {"r": 19, "q": 19})
    (tq,) = ledger.prefilled("q")
    assert tq.request_id == "q" and tq.target.worker_id == "d"
    clock.now += MOVE_RETRY_S
    (t2,) = ledger.decide_moves()
    assert t2.request_id == "r" and t2.target.worker_id == "d" and t2 is not t
    ledger.check_integrity()


def test_the_target_dropping_what_it_received_calls_the_move_off():
    ledger, (t,) = prefilled_on_p()
    holding(ledger, "d", {"r": 19})  # the receiver lists it while the blocks come in
    assert ledger.on_report(ledger.workers["d"], report("d")).resume == []  # then drops it
    assert ledger.called_off() == [t] and ledger.where == {"r": "p"}
    ledger.check_integrity()


def test_finishing_a_request_in_transfer_calls_the_move_off():
    ledger, (t,) = prefilled_on_p()
    ledger.forget("r")
    assert ledger.called_off() == [t] and not ledger.workers["d"].placed and not ledger.transfers
    ledger.check_integrity()


def test_the_source_letting_go_at_the_handover_is_no_drop_the_answer_settles_it():
    ledger, (t,) = prefilled_on_p()
    holding(ledger, "p", {})  # p released r at the handover, before the Migrate answer came
    assert ledger.transfers == {"r": t} and ledger.where == {"r": "p"} and ledger.called_off() == []
    ledger.check_integrity()
    assert ledger.transfer_done("r") and ledger.where == {"r": "d"}
    ledger.check_integrity()
    ledger, (t,) = prefilled_on_p()
    holding(ledger, "p", {})  # p dropped it, and the move failed: resumed from its tokens
    assert ledger.transfer_refused("r") and ledger.where == {"r": "p"}
    (p,) = ledger.dropped(ledger.workers["p"], ["r"])
    assert p.request_id == "r" and not ledger.where
    ledger.check_integrity()


def test_a_refused_move_is_not_tried_again_at_once():
    clock = Clock()
    ledger = roled({"a": "both", "b": "both"}, clock=clock, num_blocks=64, free={"b": 0},
                   migrate_above=0.8, migrate_below=0.7)
    for i in range(3):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 200, max_tokens=8))
    place_all(ledger)
    holding(ledger, "a", {f"r{i}": 19 for i in range(3)}, num_blocks=64)
    holding(ledger, "b", {}, num_blocks=64)
    (t,) = ledger.decide_moves()
    assert ledger.transfer_refused(t.request_id)
    (t2,) = ledger.decide_moves()
    assert t2.request_id != t.request_id, "another request moves meanwhile"
    assert ledger.transfer_refused(t2.request_id)
    clock.now += MOVE_RETRY_S
    assert {x.request_id for x in ledger.decide_moves()} <= {t.request_id, t2.request_id}
    ledger.check_integrity()


def test_a_worker_draining_by_migration_sheds_its_requests_to_workers_with_room():
    ledger = roled({"a": "both", "b": "both", "c": "both"}, num_blocks=64, free={"c": 10})
    for i in range(6):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 100, max_tokens=8))
    placed = dict(place_all(ledger))
    on_a = {rid: 7 for rid, wid in placed.items() if wid == "a"}
    holding(ledger, "a", on_a, num_blocks=64)
    ledger.on_report(ledger.workers["a"], report("a", free=64 - 7 * len(on_a), num_blocks=64, request_ids=list(on_a),
                                                 blocks_per_request=on_a, draining=True))
    assert ledger.decide_moves() == [], "draining without migration: the requests stay (recomputed at the end)"
    ledger.on_report(ledger.workers["a"], report("a", free=64 - 7 * len(on_a), num_blocks=64, request_ids=list(on_a),
                                                 blocks_per_request=on_a, draining=True, drain_by_migration=True))
    moves = ledger.decide_moves()
    assert 0 < len(moves) <= min(len(on_a), DRAIN_TRANSFERS_PER_SOURCE)
    assert {(t.source.worker_id, t.target.worker_id, t.reason) for t in moves} == {("a", "b", "drain")}, \
        "c has no room for a request of 8 blocks"
    ledger.check_integrity()
    for t in moves:
        assert ledger.transfer_done(t.request_id)
    ledger.check_integrity()
    assert all(ledger.where[t.request_id] == "b" for t in moves)


def test_a_drain_promises_a_target_no_more_than_its_room():
    """Each drain move's reservation is in the table before the next target is chosen: a target
    with room for one request gets one, not every request of the draining worker."""
    ledger = ledger_with("s")
    rids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        ledger.take(rid, f"e{i}", assign(rid, [i + 1] * 320, max_tokens=64))  # 24 blocks each, with headroom
    assert len(place_all(ledger)) == 4
    ledger.on_report(ledger.workers["s"], report("s", free=256 - 80, request_ids=rids,
                                                 blocks_per_request={r: 20 for r in rids}, draining=True,
                                                 drain_by_migration=True))
    ledger.add_worker(WorkerEntry("t", "t-addr"))
    ledger.on_report(ledger.workers["t"], report("t", free=30))  # room for one
    moves = ledger.decide_moves()
    assert [(m.source.worker_id, m.target.worker_id) for m in moves] == [("s", "t")]
    assert ledger.workers["t"].num_available_blocks >= 0
    ledger.check_integrity()


def test_an_overloaded_worker_sheds_its_smallest_running_request_to_the_emptiest_worker():
    ledger = roled({"a": "both", "b": "both", "c": "both", "p": "prefill"}, num_blocks=64,
                   free={"b": 0, "c": 0, "p": 64}, migrate_above=0.8, migrate_below=0.6, short_prompt_tokens=4096)
    for rid, n in (("big", 500), ("small", 200)):
        ledger.take(rid, rid, assign(rid, [len(rid)] * n, max_tokens=8))
    assert place_all(ledger) == [("big", "a"), ("small", "a")]
    holding(ledger, "a", {"big": 40, "small": 14}, num_blocks=64)
    holding(ledger, "b", {"x": 20}, num_blocks=64)
    holding(ledger, "c", {"y": 10}, num_blocks=64)
    (t,) = ledger.decide_moves()
    assert (t.request_id, t.source.worker_id, t.target.worker_id, t.reason) == ("small", "a", "c", "balance")
    assert ledger.decide_moves() == []  # one move in flight out of a worker at a time
    ledger.check_integrity()


def test_balance_moves_shed_load_and_are_off_by_default():
    ledger = roled({"a": "both", "b": "both"}, num_blocks=64, free={"b": 0})
    for i in range(3):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 200, max_tokens=8))
    assert {w for _, w in place_all(ledger)} == {"a"}  # b had no room then
    holding(ledger, "a", {f"r{i}": 19 for i in range(3)}, num_blocks=64)
    holding(ledger, "b", {}, num_blocks=64)
    assert ledger.decide_moves() == []  # migrate_above is None
    ledger.cfg = LedgerConfig(headroom_tokens=HEADROOM, moves=MoveConfig(migrate_above=0.8, migrate_below=0.7))
    (t,) = ledger.decide_moves()
    assert (t.source.worker_id, t.target.worker_id, t.reason) == ("a", "b", "balance")
    assert ledger.transfer_done(t.request_id) and ledger.where[t.request_id] == "b"
    ledger.check_integrity()


def test_a_preemption_victim_moves_to_a_worker_that_can_hold_it_instead_of_being_swapped():
    clock = Clock()
    ledger = full_of_low_priority(clock, moves=MoveConfig(migrate_victims=True))
    w = WorkerEntry("b", "b-addr")
    ledger.add_worker(w)
    ledger.on_report(w, report("b", free=40, num_blocks=64))  # room for low (32 blocks), not for high
    ledger.take("high", "e2", assign("high", [3] * 900, max_tokens=8, priority=1))  # 57 blocks: only on a
    d = ledger.decide_round()
    assert [(p.request_id, pl.worker.worker_id) for p, pl in d.claims] == [("high", "a")]
    assert d.victims == [] and [(t.request_id, t.target.worker_id, t.reason) for t in d.moves] == [
        ("low", "b", "preemption")]
    ledger.check_integrity()
    assert ledger.transfer_done("low") and ledger.where == {"high": "a", "low": "b"}
    ledger.check_integrity()
    ledger2 = full_of_low_priority(Clock(), moves=MoveConfig(migrate_victims=True))  # nowhere to go: preempted
    ledger2.take("high", "e2", assign("high", [3] * 900, max_tokens=8, priority=1))
    d = ledger2.decide_round()
    assert [v.pending.request_id for v in d.victims] == ["low"] and d.moves == []


# -- random event sequences ------------------------------------------------------------------------
RIDS = [f"r{i}" for i in range(10)]
WIDS = ["a", "b"]
POOL = 32  # blocks a worker: a few requests fill it, so heads wait and preemption is tried

arrive = st.tuples(st.just("arrive"), st.sampled_from(RIDS), st.integers(1, 450), st.integers(0, 1),
                   st.sampled_from([None, None, 0.5, 3.0]))
EVENTS = (
    arrive,
    st.tuples(st.just("arrive"), st.sampled_from(RIDS), st.just(450), st.just(1), st.just(None)),  # a big urgent one
    st.tuples(st.just("round"), st.sampled_from([True, True, True, False])),
    st.tuples(st.just("run"), st.sampled_from(WIDS), st.integers(1, 12)),
    st.tuples(st.just("finish"), st.sampled_from(WIDS), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.sampled_from(WIDS), st.integers(0, 3)),
    st.tuples(st.just("report"), st.sampled_from(WIDS), st.booleans()),
    st.tuples(st.just("report"), st.sampled_from(WIDS), st.booleans()),
    st.tuples(st.just("durable"), st.sampled_from(RIDS)),
    st.tuples(st.just("cancel"), st.sampled_from(RIDS)),
    st.tuples(st.just("resume"), st.integers(0, 3)),
    st.tuples(st.just("die"), st.sampled_from(WIDS)),
    st.tuples(st.just("fenced"), st.sampled_from(WIDS)),
    st.tuples(st.just("revive"), st.sampled_from(WIDS)),
    st.tuples(st.just("tick"), st.floats(0.0, 1.5)),
)
event = st.one_of(*EVENTS)


class World:
    """The workers and Redis as the ledger's caller sees them, as plain data; every answer
    the ledger gives is checked against what has ended."""

    def __init__(self, roles: dict[str, str] | None = None, moves: MoveConfig = MoveConfig(),
                 pool: int = POOL) -> None:
        self.clock = Clock()
        self.pool = pool
        self.roles = roles or {}
        self.ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, policy="priority", moves=moves), clock=self.clock,
                             wall_clock=self.clock)
        self.running: dict[str, dict[str, int]] = {}  # worker -> request -> device blocks
        self.finished: dict[str, list[str]] = {}  # worker -> finished since its last report
        self.in_hand: list = []  # handed back by the ledger, to resume
        self.ended: dict[str, int] = {}  # request -> times it ended (a durable final write)
        self.taken: set[str] = set()
        self.done_by_worker: set[str] = set()  # finished by a worker, final write not yet seen
        self.draining: set[str] = set()  # workers that refused an Assign: they take no more, then leave
        for wid in WIDS:
            self.revive(wid)

    # the I/O layer's answers
    def revive(self, wid: str) -> None:
        if wid in self.ledger.workers:
            return
        self.ledger.add_worker(WorkerEntry(wid, f"{wid}-addr", role=self.roles.get(wid, "both")))
        self.running.setdefault(wid, {})  # a worker back after being declared dead still runs its requests
        self.finished[wid] = []
        self.draining.discard(wid)
        self.report(wid, whole=True)

    def report(self, wid: str, whole: bool) -> None:
        w = self.ledger.workers.get(wid)
        if w is None:
            return
        held = self.running[wid]
        r = report(wid, free=max(0, self.pool - sum(held.values())), num_blocks=self.pool, request_ids=list(held),
                   blocks_per_request={rid: n for rid, n in held.items() if n}, finished_request_ids=self.finished[wid],
                   draining=wid in self.draining)
        if not whole:  # a delta naming everything held: the same holdings
            r.holdings_delta = True
            r.released_request_ids.extend(rid for rid in w.held if rid not in held)
        self.finished[wid] = []
        out = self.ledger.on_report(w, r)
        self.handed_back(out.resume)
        for rid in out.withdraw:
            assert rid not in self.ledger.where or self.ledger.where[rid] != wid
            held.pop(rid, None)

    def handed_back(self, pendings) -> None:
        for p in pendings:
            assert self.ended.get(p.request_id, 0) == 0, f"{p.request_id} handed back after it ended"
            self.in_hand.append(p)

    def end(self, rid: str) -> None:
        assert rid in self.ledger.known, f"{rid} ended while the ledger did not know it"
        self.ended[rid] = self.ended.get(rid, 0) + 1
        for held in self.running.values():
            held.pop(rid, None)
        self.ledger.forget(rid)

    def round(self, accept: bool) -> None:
        d = self.ledger.decide_round()
        for p, _ in d.refused:  # past its deadline, or too large for any worker: finished by the caller
            self.end(p.request_id)
        for p, pl in d.claims:
            assert self.ended.get(p.request_id, 0) == 0, f"{p.request_id} placed after it ended"
            wid = pl.worker.worker_id
            ok = (accept or bool(d.victims)) and wid not in self.draining
            self.ledger.settled(p, pl.worker, ok)
            if ok:
                self.running[wid].setdefault(p.request_id, 0)
            else:
                self.draining.add(wid)
        for v in d.victims:
            self.ledger.preempted(v)
        self.moving(d.moves)

    def moving(self, transfers) -> None:
        for t in transfers:
            assert self.ended.get(t.request_id, 0) == 0, f"{t.request_id} moved after it ended"
            assert self.ledger.where[t.request_id] == t.source.worker_id

    def handover(self, k: int) -> None:
        """The copy of one transfer in flight is complete: the target takes the request over
        only if its source still runs it (a source that let it go hands nothing over)."""
        transfers = list(self.ledger.transfers.values())
        if not transfers:
            return
        t = transfers[k % len(transfers)]
        src, dst = t.source.worker_id, t.target.worker_id
        if t.request_id not in self.running[src]:
            return
        assert self.ledger.transfer_done(t.request_id)
        self.running[dst][t.request_id] = self.running[src].pop(t.request_id) or 1

    def step(self, e: tuple) -> None:
        kind, ledger = e[0], self.ledger
        if kind == "arrive" and e[1] not in self.taken:
            self.taken.add(e[1])
            deadline = None if e[4] is None else self.clock.now + e[4]
            ledger.take(e[1], f"{e[1]}-entry", assign(e[1], [RIDS.index(e[1]) % 3 + 1] * e[2], max_tokens=16, priority=e[3],
                                                       deadline_s=deadline))
        elif kind == "round":
            self.round(e[1])
        elif kind == "run":  # the worker's requests get their device blocks
            held = self.running[e[1]]
            for rid in held:
                held[rid] = held[rid] or e[2]
        elif kind in ("finish", "drop") and e[1] in ledger.workers:
            w, held = ledger.workers[e[1]], self.running[e[1]]
            # A drop (without a finish) the reports show: of a request a report named held, with
            # or without device blocks (one never named there is still on its way as far as the
            # reports tell; see "fenced" for the drop of that one), or of an orphan.
            rids = [rid for rid in held if kind == "finish" and rid in w.placed
                    or kind == "drop" and (rid not in w.placed or w.placed[rid].listed)]
            if rids:
                rid = rids[e[2] % len(rids)]
                del held[rid]
                if kind == "finish":
                    self.finished[e[1]].append(rid)
                    self.done_by_worker.add(rid)
        elif kind == "report":
            self.report(e[1], e[2])
        elif kind == "fenced" and e[1] in ledger.workers:
            # Its steps stream was fenced: it drops everything it holds, reported or not, before
            # any report shows it, and writes on in a new stream, which discovery finds in its
            # row: the old incarnation is dead, the new one joins.
            self.running[e[1]].clear()
            self.handed_back(ledger.worker_dead(ledger.workers[e[1]]))
            ledger.check_integrity()
            self.revive(e[1])
        elif kind == "durable":  # the worker's final write landed: only a request it finished
            if e[1] in self.done_by_worker and e[1] in ledger.known:
                self.end(e[1])
        elif kind == "cancel" and e[1] in ledger.known:
            self.end(e[1])
        elif kind == "resume" and self.in_hand:
            p = self.in_hand.pop(e[1] % len(self.in_hand))
            if p.request_id in ledger.known and not ledger.resume(p, [1] * min(e[1] * 5, 16)):
                self.end(p.request_id)
        elif kind == "die" and e[1] in ledger.workers:
            self.handed_back(ledger.worker_dead(ledger.workers[e[1]]))
        elif kind == "revive":
            self.revive(e[1])
        elif kind == "prefilled":  # a prefill worker computed a request's prompt and its first token
            held = self.running[e[1]]
            rids = [rid for rid in held if ledger.where.get(rid) == e[1]]
            if rids:
                rid = rids[e[2] % len(rids)]
                held[rid] = held[rid] or 3
                self.moving(ledger.prefilled(rid))
        elif kind == "moves":
            self.moving(ledger.decide_moves())
        elif kind == "handover":
            self.handover(e[1])
        elif kind == "refuse" and ledger.transfers:  # the target has not the room after all
            assert ledger.transfer_refused(sorted(ledger.transfers)[e[1] % len(ledger.transfers)])
        elif kind == "tick":
            self.clock.now += e[1]
            self.expire_transfers()
            waited, running = ledger.expired()
            for p in waited:
                self.end(p.request_id)
            for rid in running:
                if rid in ledger.known:
                    self.end(rid)

    def expire_transfers(self) -> None:
        """Transfers past their lease: both sides drop the request; it resumes from its tokens."""
        for t in self.ledger.expired_transfers():
            self.running[t.source.worker_id].pop(t.request_id, None)
            self.running[t.target.worker_id].pop(t.request_id, None)
            self.handed_back([t.pending])
        self.ledger.called_off()  # the targets here never list what they receive: nothing to drop

    def drain(self) -> None:
        """Every request to its end: workers back, everything resumed, placed and finished."""
        for wid in WIDS:
            if wid in self.draining and wid in self.ledger.workers:  # drained: it leaves, a new one comes
                self.handed_back(self.ledger.worker_dead(self.ledger.workers[wid]))
            self.revive(wid)
        for _ in range(200):
            if not self.ledger.known:
                return
            while self.in_hand:
                p = self.in_hand.pop()
                if p.request_id in self.ledger.known and not self.ledger.resume(p, []):
                    self.end(p.request_id)
            for wid in WIDS:  # finish everything running, then report, then make it durable
                done = list(self.running[wid])
                self.running[wid].clear()
                self.finished[wid] += done
                self.done_by_worker.update(done)
                self.report(wid, whole=True)
            for rid in sorted(self.done_by_worker & set(self.ledger.known)):
                self.end(rid)
            self.round(True)
            self.clock.now += 0.5
            self.expire_transfers()
            waited, running = self.ledger.expired()
            for p in waited:
                self.end(p.request_id)
            for rid in running:
                if rid in self.ledger.known:
                    self.end(rid)
            self.ledger.check_integrity()
        raise AssertionError(f"not drained: {sorted(self.ledger.known)}")


@settings(max_examples=300, deadline=None)
@given(st.lists(arrive, min_size=1, max_size=4), st.lists(event, min_size=10, max_size=80))
def test_random_events_keep_the_invariants_and_end_every_request_exactly_once(arrivals, events):
    world = World()
    for e in [*arrivals, ("round", True), *events]:
        world.step(e)
        world.ledger.check_integrity()
    world.drain()
    assert world.ended == {rid: 1 for rid in world.taken}
    assert not world.ledger.where and not world.ledger.queue.ordered()


# Smaller requests than above (more fit at once, so moves find room), run more often.
small_arrive = st.tuples(st.just("arrive"), st.sampled_from(RIDS), st.integers(1, 200), st.integers(0, 1),
                         st.sampled_from([None, None, None, 3.0]))
move_event = st.one_of(
    *EVENTS[2:], small_arrive, small_arrive,
    st.tuples(st.just("run"), st.sampled_from(WIDS), st.integers(1, 6)),
    st.tuples(st.just("prefilled"), st.sampled_from(WIDS), st.integers(0, 3)),
    st.tuples(st.just("prefilled"), st.sampled_from(WIDS), st.integers(0, 3)),
    st.tuples(st.just("moves")),
    st.tuples(st.just("handover"), st.integers(0, 3)),
    st.tuples(st.just("refuse"), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.floats(0.0, 1.5)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(small_arrive, min_size=1, max_size=4), st.lists(move_event, min_size=30, max_size=100),
       st.sampled_from([{"a": "prefill", "b": "decode"}, {"a": "prefill"}, {}]), st.booleans())
def test_random_events_with_moves_keep_one_owner_and_end_every_request_exactly_once(arrivals, events, roles,
                                                                                     balance):
    """Disaggregation, balance and preemption moves, with handovers, expiries, drops and deaths."""
    moves = MoveConfig(short_prompt_tokens=64, migrate_above=0.5 if balance else None, migrate_below=0.4,
                       migrate_victims=True, timeout_s=0.5)
    world = World(roles, moves, pool=64)
    for e in [*arrivals, ("round", True), *events]:
        world.step(e)
        world.ledger.check_integrity()
    world.drain()
    assert world.ended == {rid: 1 for rid in world.taken}
    assert not world.ledger.where and not world.ledger.queue.ordered() and not world.ledger.transfers


def test_finished_requests_are_remembered_for_a_time_and_a_count():
    clock = Clock()
    ledger = ledger_with("a", clock=clock, done_memory=3, done_memory_s=10.0)
    for i in range(4):
        ledger.forget(f"r{i}")
        clock.now += 1.0
    assert [ledger.finished_recently(f"r{i}") for i in range(4)] == [False, True, True, True]  # the count
    clock.now += 8.5  # r1 finished 11.5 s ago, r2 10.5 s, r3 9.5 s
    ledger.forget("r4")
    assert [ledger.finished_recently(f"r{i}") for i in range(1, 5)] == [False, False, True, True]  # the time
    assert not ledger.is_new("r3") and ledger.is_new("r1")
    ledger.check_integrity()


# -- found by review (2026-11-28): each failed before its fix -------------------------------------
def test_a_prefilled_request_waiting_for_a_decoding_worker_is_not_moved_by_a_drain():
    """A drain by migration picked a request that waits for a decoding worker: two transfers
    started for it, and the first target's reservation was never released."""
    clock = Clock()
    ledger = roled({"p": "prefill", "d": "decode", "e": "decode"}, clock=clock, free={"d": 40, "e": 0})
    ledger.take("r1", "e1", assign("r1", [1] * 900))  # does not fit d: blocks the handovers' queue
    ledger.take("r2", "e2", assign("r2", [2] * 300))
    place_all(ledger)
    holding(ledger, "p", {"r1": 57, "r2": 19})
    ledger.prefilled("r1")
    ledger.prefilled("r2")
    r = report("p", free=256 - 76, request_ids=["r1", "r2"], blocks_per_request={"r1": 57, "r2": 19}, draining=True)
    r.drain_by_migration = True
    ledger.on_report(ledger.workers["p"], r)
    assert ledger.decide_moves() == []  # r2 waits behind r1 for a decoding worker: not the drain's
    ledger.check_integrity()
    ledger.forget("r1")
    ledger.on_report(ledger.workers["e"], report("e", free=256))
    ledger.on_report(ledger.workers["d"], report("d", free=0))
    (t,) = ledger.decide_moves()
    assert (t.request_id, t.target.worker_id, t.reason) == ("r2", "e", "disaggregation")
    assert list(ledger.workers["d"].placed) == [] and ledger.workers["d"].num_owed_blocks_total == 0
    ledger.check_integrity()


def test_a_finish_not_confirmed_takes_a_request_out_of_its_wait_and_its_transfer():
    """It stayed awaiting a decoding worker (or in transfer): the invariants broke and the next
    ``decide_moves`` (or ``expired_transfers``) raised KeyError, ending the scheduler."""
    clock = Clock()
    ledger, _ = prefilled_on_p(clock=clock, free={"d": 0})  # waits on p: d has no room
    ledger.on_report(ledger.workers["p"], report("p", free=256, finished_request_ids=["r"]))
    assert ledger.finish_unconfirmed("r").request_id == "r"
    ledger.check_integrity()
    ledger.on_report(ledger.workers["d"], report("d", free=256))
    assert ledger.decide_moves() == []
    clock = Clock()
    ledger, moves = prefilled_on_p(clock=clock)  # in transfer to d
    assert moves
    ledger.on_report(ledger.workers["p"], report("p", free=256, request_ids=["r"], blocks_per_request={"r": 19},
                                                 finished_request_ids=["r"]))
    assert ledger.finish_unconfirmed("r").request_id == "r"
    assert not ledger.transfers and [t.request_id for t in ledger.called_off()] == ["r"]
    ledger.check_integrity()
    clock.now += 10
    assert ledger.expired_transfers() == []


def test_a_request_adopted_at_a_takeover_has_its_deadline_watched():
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock, adopting=True)
    w = WorkerEntry("a", "a-addr")
    ledger.add_worker(w)
    ledger.on_report(w, report("a", free=200, request_ids=["r"], blocks_per_request={"r": 2}))
    assert ledger.take_over("r", "e", assign("r", [1] * 20, deadline_s=clock.now + 5), ledger.holders()["r"]) is None
    ledger.adopted()
    clock.now += 10
    assert ledger.expired() == ([], ["r"])


def test_a_head_no_worker_could_ever_take_is_refused_and_the_queue_goes_on():
    """Longer than every worker's context (the gateway checks its own, which may be longer): it
    ended every round, and nothing behind it was ever placed."""
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock)
    for wid in ("a", "b"):
        w = WorkerEntry(wid, wid)
        ledger.add_worker(w)
        r = report(wid, free=256, num_blocks=256)
        r.max_model_len = 512
        ledger.on_report(w, r)
    ledger.take("too-long", "e0", assign("too-long", [1] * 600, max_tokens=16))
    for i in range(3):
        ledger.take(f"s{i}", f"e{i + 1}", assign(f"s{i}", [2] * 20, max_tokens=16))
    d = ledger.decide_round()
    assert [p.request_id for p, _ in d.claims] == ["s0", "s1", "s2"]
    ((p, why),) = d.refused
    assert p.request_id == "too-long" and "616 tokens" in why and "512" in why
    ledger.check_integrity()  # in hand: the caller finishes it with the error
    ledger.forget("too-long")
    ledger.check_integrity()


def test_preemption_never_places_a_request_past_the_workers_context():
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, policy="priority"), clock=clock, wall_clock=clock)
    w = WorkerEntry("a", "a")
    ledger.add_worker(w)
    r = report("a", free=40, num_blocks=40)
    r.max_model_len = 512
    ledger.on_report(w, r)
    for i in range(2):
        ledger.take(f"low{i}", f"l{i}", assign(f"low{i}", [1] * 200, max_tokens=100))
    place_all(ledger)
    clock.now += 10
    ledger.take("long", "h", assign("long", [3] * 1000, max_tokens=16, priority=1))
    d = ledger.decide_round()
    assert d.victims == [] and [p.request_id for p, _ in d.claims] == []
    assert [p.request_id for p, _ in d.refused] == ["long"]


def test_a_late_answer_of_a_dead_entry_leaves_the_new_entrys_placement_alone():
    """A refusal from the old entry of worker "a", after the request was placed again on a new
    entry of "a" (same id), unplaced it from the ledger while the new entry kept it."""
    clock = Clock()
    ledger = ledger_with("a", clock=clock)
    ledger.take("r", "e", assign("r", [1] * 20))
    ((p, pl),) = ledger.decide_round().claims
    old = pl.worker
    for q in ledger.worker_dead(old):
        ledger.resume(q, [])
    new = WorkerEntry("a", "a-addr")
    ledger.add_worker(new)
    ledger.on_report(new, report("a"))
    ((q, _),) = ledger.decide_round().claims
    ledger.settled(q, new, True)
    ledger.settled(p, old, False)  # the old entry's late answer
    assert ledger.where == {"r": "a"} and list(new.placed) == ["r"]
    ledger.check_integrity()


def _serve_with_far_deadlines(ledger: Ledger, n: int, prefix: str) -> None:
    """``n`` requests with a deadline a day away, each placed, accepted and finished in turn."""
    for i in range(n):
        rid = f"{prefix}{i}"
        ledger.take(rid, "e", assign(rid, [2] * 20, deadline_s=ledger.clock() + 86400))
        for p, pl in ledger.decide_round().claims:
            ledger.settled(p, pl.worker, True)
        ledger.forget(rid)


def test_deadlines_of_finished_requests_do_not_pile_up():
    ledger = ledger_with("a", clock=Clock())
    _serve_with_far_deadlines(ledger, 2000, "r")
    assert len(ledger._deadlines) <= 2 * ledger.num_known + 64


def test_a_request_only_a_worker_now_away_could_take_waits_and_roles_count_the_decoders():
    """The refusal counts the largest limits any decoding worker reported, up or not (one
    declared dead comes back; its running request must not be refused meanwhile), and only the
    workers a request can finish on (a prefill worker's longer context does not count)."""
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock)
    for wid, mml, blocks in (("small", 512, 256), ("big", 4096, 1024)):
        w = WorkerEntry(wid, wid)
        ledger.add_worker(w)
        r = report(wid, free=blocks, num_blocks=blocks)
        r.max_model_len = mml
        ledger.on_report(w, r)
    ledger.take("long", "e", assign("long", [1] * 1000, max_tokens=100))
    ((p, pl),) = ledger.decide_round().claims
    ledger.settled(p, pl.worker, True)
    for q in ledger.worker_dead(ledger.workers["big"]):
        ledger.resume(q, list(range(30)))
    d = ledger.decide_round()
    assert d.refused == [] and d.claims == [] and ledger.num_waiting == 1  # it waits for "big"
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, moves=MoveConfig()), clock=clock, wall_clock=clock)
    for wid, role, mml in (("p", "prefill", 8192), ("d", "decode", 2048)):
        w = WorkerEntry(wid, wid, role=role)
        ledger.add_worker(w)
        r = report(wid, free=1024, num_blocks=1024)
        r.max_model_len = mml
        ledger.on_report(w, r)
    ledger.take("short-long", "e0", assign("short-long", [1] * 10, max_tokens=4000))  # only p's context holds it
    ledger.take("s0", "e1", assign("s0", [2] * 20, max_tokens=16))
    d = ledger.decide_round()
    assert [p.request_id for p, _ in d.refused] == ["short-long"] and [p.request_id for p, _ in d.claims] == ["s0"]


def test_a_request_handed_over_as_its_source_died_keeps_its_deadline_once():
    """In hand while its source's death is settled, then found on its target: a rebuild of the
    deadline heap meanwhile (requests coming and going) dropped its deadline, kept only for the
    requests placed; it is named once when it passes."""
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock)
    for wid in ("a", "b"):
        w = WorkerEntry(wid, wid)
        ledger.add_worker(w)
        ledger.on_report(w, report(wid, free=4000, num_blocks=4000))
    ledger.take("r", "e", assign("r", [1] * 20, deadline_s=clock.now + 5))
    ((p, pl),) = ledger.decide_round().claims
    ledger.settled(p, pl.worker, True)
    src = pl.worker
    dst = ledger.workers["b" if src.worker_id == "a" else "a"]
    assert [q.request_id for q in ledger.worker_dead(src)] == ["r"]
    _serve_with_far_deadlines(ledger, 70, "x")  # enough for the heap to be rebuilt meanwhile
    assert ledger.handover_found(p, dst)
    ledger.check_integrity()
    clock.now += 10
    assert ledger.expired() == ([], ["r"])


def test_a_finished_requests_blocks_are_shared_with_no_later_request():
    """Its worker reported it finished (its final write not read yet): a same-prefix request
    placed then was charged only the blocks past the prefix, as if a running sequence shared
    them, and the worker's pool was committed past its size."""
    clock = Clock()
    ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM), clock=clock, wall_clock=clock)
    w = WorkerEntry("a", "a")
    ledger.add_worker(w)
    ledger.on_report(w, report("a", free=64, num_blocks=64))
    prefix = list(range(1, 16 * BS + 1))  # 16 whole blocks
    ledger.take("r1", "e1", assign("r1", [*prefix, 7], max_tokens=16))
    place_all(ledger)
    keys = ledger.known["r1"].assign.block_hashes
    ledger.on_report(w, report("a", free=64, num_blocks=64, finished_request_ids=["r1"], stored_block_hashes=keys))
    ledger.take("r2", "e2", assign("r2", [*prefix, 8], max_tokens=16))
    ((p, pl),) = ledger.decide_round().claims
    assert pl.num_shared_blocks == 0
    ledger.take("r3", "e3", assign("r3", [9] * (64 - w.blocks_needed(p, HEADROOM)) * BS, max_tokens=1))
    assert ledger.decide_round().claims == []  # no room past the pool's size
    ledger.check_integrity()


def _layouts(ledger: Ledger, layouts: dict[str, str], held: dict[str, dict[str, int]] | None = None) -> None:
    """Each worker reports the KV layout its transport has (and the requests it holds)."""
    for wid, layout in layouts.items():
        blocks = (held or {}).get(wid, {})
        ledger.on_report(ledger.workers[wid], report(wid, free=256 - sum(blocks.values()), request_ids=list(blocks),
                                                     blocks_per_request=blocks, kv_layout=layout))


def test_kv_moves_only_between_workers_whose_blocks_mean_the_same():
    """A review paired a worker of 16-token blocks with one of 32: every drain, balance and
    handover was tried, refused by the target (FAILED_PRECONDITION) and tried again each second
    for the life of each request. Workers report their KV layout; moves go only between equals."""
    a16, b32, c16 = "tiny/float32/16/2/2/32/L", "tiny/float32/32/2/2/32/L", "tiny/float32/16/2/2/32/L"
    ledger = roled({"a": "both", "b": "both", "c": "both"})
    for i in range(4):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [i + 1] * 100, max_tokens=8))
    placed = dict(place_all(ledger))
    on_a = {rid: 7 for rid, wid in placed.items() if wid == "a"}
    _layouts(ledger, {"b": b32, "c": c16})
    ledger.on_report(ledger.workers["a"], report("a", free=256 - 7 * len(on_a), request_ids=list(on_a),
                                                 blocks_per_request=on_a, draining=True, drain_by_migration=True,
                                                 kv_layout=a16))
    moves = ledger.decide_moves()
    assert moves and {t.target.worker_id for t in moves} == {"c"}, "b's blocks are another size"
    ledger.check_integrity()


def test_a_prompt_no_decoding_worker_can_take_decodes_where_it_was_prefilled():
    _, moves = prefilled_on_p()  # no layouts reported (workers without one): handed over
    assert [t.target.worker_id for t in moves] == ["d"]
    ledger2 = roled({"p": "prefill", "d": "decode"})
    _layouts(ledger2, {"p": "m/bf16/16/2/2/64/L", "d": "m/bf16/32/2/2/64/L"})
    ledger2.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger2) == [("r", "p")]
    ledger2.on_report(ledger2.workers["p"], report("p", free=256 - 19, request_ids=["r"], blocks_per_request={"r": 19},
                                                   kv_layout="m/bf16/16/2/2/64/L"))
    assert ledger2.prefilled("r") == [] and ledger2.decide_moves() == []
    ledger2.check_integrity()


def test_a_move_whose_source_died_is_dropped_at_its_target_before_the_request_resumes():
    """The source of a move died; the request resumes from its tokens and may be placed on the
    move's own target. The drop of what the target received went in the background, landed
    after that new assignment and cancelled it (a review's runs: resumed requests stalled 3-6 s,
    until their finish went unconfirmed). It is awaited before the resume; and counted."""
    from types import SimpleNamespace

    from pagefleet.common.redis import Keys, RedisServer, connect
    from pagefleet.scheduler.moves import Transfer
    from pagefleet.scheduler.transfers import TransferRunner

    events: list[str] = []
    counted: list[tuple[str, str]] = []

    async def cancel_now(w, rid):
        await asyncio.sleep(0.05)  # the worker answers between two of its steps
        events.append(f"dropped {rid} at {w.worker_id}")

    with RedisServer() as server:
        async def go():
            r = connect(server.url)
            ledger = roled({"p": "prefill", "d": "decode"})
            ledger.take("r", "e", assign("r", [1] * 300))
            place_all(ledger)
            t = Transfer(ledger.known["r"], ledger.workers["p"], ledger.workers["d"], "disaggregation", 1e9, 19)
            metrics = SimpleNamespace(transfers=SimpleNamespace(labels=lambda **kw: SimpleNamespace(
                inc=lambda: counted.append((kw["reason"], kw["outcome"])))))
            runner = TransferRunner(ledger, metrics, r, Keys("t"), resume=None, worker_dead=None,
                                    cancel=lambda w, rid: events.append("in the background"), wake=lambda: None,
                                    cancel_now=cancel_now)
            ledger.where.pop("r", None)  # the source's death took it off: it resumes next
            assert await runner.handed_over(t.pending, {"r": t}) is False  # Redis names no new owner
            events.append("resumed")
            assert events == ["dropped r at d", "resumed"] and counted == [("disaggregation", "source_died")]
            await r.aclose()

        asyncio.run(go())


def test_migrate_above_alone_takes_a_migrate_below_no_higher():
    """``--migrate-above 0.5`` alone was refused: ``--migrate-below`` defaulted to 0.7, above it."""
    from pagefleet.scheduler.server import build_parser, move_config

    parse = build_parser().parse_args
    assert move_config(parse(["--migrate-above", "0.5"])).migrate_below == 0.5
    assert move_config(parse(["--migrate-above", "0.9"])).migrate_below == 0.7
    with pytest.raises(ValueError, match="migrate_below <= migrate_above"):
        move_config(parse(["--migrate-above", "0.5", "--migrate-below", "0.7"]))  # both given: as asked


def test_a_prefilled_prompt_waits_for_a_decoding_worker_that_is_not_up_yet():
    """With no decoding worker up (its only one restarting), a prefilled prompt waits for one, as
    before the KV layouts were compared (the first form let it decode where it was, for good)."""
    ledger = roled({"p": "prefill", "d": "decode"})
    ledger.take("r", "e", assign("r", [1] * 300))
    assert place_all(ledger) == [("r", "p")]
    ledger.worker_dead(ledger.workers["d"])
    holding(ledger, "p", {"r": 19})
    assert ledger.prefilled("r") == []
    ledger.add_worker(WorkerEntry("d2", "d2-addr", role="decode"))
    ledger.on_report(ledger.workers["d2"], report("d2"))
    holding(ledger, "p", {"r": 19})
    assert [(t.request_id, t.target.worker_id) for t in ledger.decide_moves()] == [("r", "d2")]
    ledger.check_integrity()


def test_a_prompt_of_one_kv_layout_that_fits_nowhere_holds_back_only_its_own_layouts():
    a, b = "m/bf16/16/2/2/64/L", "m/fp8/16/2/2/64/L"
    ledger = roled({"p1": "prefill", "p2": "prefill", "dA": "decode", "dB": "decode"})
    _layouts(ledger, {"dB": b, "p1": a, "p2": b})
    ledger.on_report(ledger.workers["dA"], report("dA", free=5, kv_layout=a))  # no room for a prompt's KV
    for rid, tokens in (("r1", 1), ("r2", 2)):
        ledger.take(rid, f"e-{rid}", assign(rid, [tokens] * 300))
    where = dict(place_all(ledger))
    for w, layout in (("p1", a), ("p2", b)):
        _layouts(ledger, {w: layout}, {w: {r: 19 for r, x in where.items() if x == w}})
    on_a = next(r for r, w in where.items() if w == "p1")
    on_b = next(r for r, w in where.items() if w == "p2")
    assert ledger.prefilled(on_a) == []  # dA is full: it waits
    moved = ledger.prefilled(on_b)  # behind it, but of the other layout: dB takes it
    assert [(t.request_id, t.target.worker_id) for t in moved] == [(on_b, "dB")]
    ledger.check_integrity()
