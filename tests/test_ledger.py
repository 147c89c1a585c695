"""The scheduler's ledger, driven directly: no Redis, no gRPC, no sleeps; a clock of our own.

Hand-written sequences check each operation's answer; a property test runs random event
sequences (arrive, place, answer, report, finish, drop, die, cancel, deadline, preempt) and
checks the invariants after every step and that every request ends exactly once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.common.blocks import block_hashes
from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.ledger import ROUND, Decision, Ledger, LedgerConfig, Migration
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


def test_deadlines_take_waiting_requests_out_and_name_running_ones():
    clock = Clock()
    ledger = ledger_with("a", clock=clock)
    ledger.take("run", "e1", assign("run", [1] * 40, deadline_s=clock.now + 5))
    place_all(ledger)
    ledger.take("big", "e2", assign("big", [1] * 5000, deadline_s=clock.now + 1))  # fits nowhere
    assert place_all(ledger) == []
    assert ledger.expired() == ([], [])
    clock.now += 2
    waited, running = ledger.expired()
    assert [p.request_id for p in waited] == ["big"] and running == []
    ledger.check_integrity()  # "big" is in hand until it is finished
    ledger.forget("big")
    clock.now += 5
    assert ledger.expired() == ([], ["run"]) and "run" in ledger.where


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


def _loaded(ledger: Ledger, wid: str, held: dict[str, int], free: int) -> None:
    """``wid`` reports holding ``held`` (request -> device blocks) with ``free`` blocks free."""
    ledger.on_report(ledger.workers[wid], report(wid, free=free, request_ids=list(held), blocks_per_request=held))


def test_load_balance_moves_the_cheapest_request_from_a_full_worker_to_one_with_room():
    ledger = ledger_with("a", "b", "c")
    for i, n in enumerate((40, 10, 25)):
        ledger.take(f"r{i}", f"e{i}", assign(f"r{i}", [7] * (n * BS - 8)))
    ledger.workers["b"].accepting = ledger.workers["c"].accepting = False  # everything lands on a
    place_all(ledger)
    ledger.workers["b"].accepting = ledger.workers["c"].accepting = True
    assert set(ledger.where.values()) == {"a"}
    _loaded(ledger, "a", {"r0": 40, "r1": 10, "r2": 25}, free=10)  # 96 % used
    _loaded(ledger, "b", {}, free=60)  # 77 % used: past `low`
    _loaded(ledger, "c", {}, free=60)
    assert ledger.plan_migrations(high=0.9, low=0.5) == []
    _loaded(ledger, "c", {}, free=256)
    (m,) = ledger.plan_migrations(high=0.9, low=0.5)
    assert m == Migration("r1", "a", "c", 10)
    assert ledger.where["r1"] == "a", "planning changes nothing"
    ledger.migrated(m, ok=False)
    assert ledger.where["r1"] == "a"
    ledger.migrated(m, ok=True)
    assert ledger.where["r1"] == "c" and "r1" in ledger.workers["c"].placed and "r1" not in ledger.workers["a"].placed
    ledger.check_integrity()
    ledger.migrated(m, ok=True)  # told twice: nothing more happens
    ledger.check_integrity()


def test_a_preemption_victim_moves_where_it_fits_and_nowhere_when_none_has_room():
    ledger = ledger_with("a", "b")
    ledger.take("v", "e", assign("v", [3] * (20 * BS)))
    ledger.workers["b"].accepting = False
    place_all(ledger)
    ledger.workers["b"].accepting = True
    _loaded(ledger, "b", {}, free=256)
    assert ledger.migration_target("v", 21, exclude="a").worker_id == "b"
    _loaded(ledger, "b", {}, free=10)
    assert ledger.migration_target("v", 21, exclude="a") is None
    assert ledger.migration_target("unknown", 1, exclude="a") is None
    with __import__("pytest").raises(ValueError):
        ledger.plan_migrations(high=0.5, low=0.9)


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


# -- random event sequences ------------------------------------------------------------------------
RIDS = [f"r{i}" for i in range(10)]
WIDS = ["a", "b"]
POOL = 32  # blocks a worker: a few requests fill it, so heads wait and preemption is tried

arrive = st.tuples(st.just("arrive"), st.sampled_from(RIDS), st.integers(1, 450), st.integers(0, 1),
                   st.sampled_from([None, None, 0.5, 3.0]))
event = st.one_of(
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
    st.tuples(st.just("revive"), st.sampled_from(WIDS)),
    st.tuples(st.just("tick"), st.floats(0.0, 1.5)),
)


class World:
    """The workers and Redis as the ledger's caller sees them, as plain data; every answer
    the ledger gives is checked against what has ended."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.ledger = Ledger(LedgerConfig(headroom_tokens=HEADROOM, policy="priority"), clock=self.clock,
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
        self.ledger.add_worker(WorkerEntry(wid, f"{wid}-addr"))
        self.running.setdefault(wid, {})  # a worker back after being declared dead still runs its requests
        self.finished[wid] = []
        self.draining.discard(wid)
        self.report(wid, whole=True)

    def report(self, wid: str, whole: bool) -> None:
        w = self.ledger.workers.get(wid)
        if w is None:
            return
        held = self.running[wid]
        r = report(wid, free=max(0, POOL - sum(held.values())), num_blocks=POOL, request_ids=list(held),
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
            # A worker drops (without a finish) only what a report showed it holding: one never
            # seen there is still on its way as far as the ledger knows.
            rids = [rid for rid in held if rid in w.placed and (kind == "finish" or w.placed[rid].reflected)]
            if rids:
                rid = rids[e[2] % len(rids)]
                del held[rid]
                if kind == "finish":
                    self.finished[e[1]].append(rid)
                    self.done_by_worker.add(rid)
        elif kind == "report":
            self.report(e[1], e[2])
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
        elif kind == "tick":
            self.clock.now += e[1]
            waited, running = ledger.expired()
            for p in waited:
                self.end(p.request_id)
            for rid in running:
                if rid in ledger.known:
                    self.end(rid)

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
