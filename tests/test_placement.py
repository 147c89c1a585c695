"""The prefix index and the placement policies: from hand-built reports, through the scheduler
with fake workers, and on a real cluster of two workers."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.blocks import block_hashes
from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.placement import PlacementConfig, Placer
from pagefleet.scheduler.prefix_index import Match, PrefixIndex
from pagefleet.scheduler.queue import Pending
from pagefleet.scheduler.workers import WorkerEntry

BS = 16
HEADROOM = 64
SYSTEM = list(range(1, 16 * BS + 1))  # a 16-block shared prefix


def pending(rid: str, prompt: list[int], max_tokens: int = 64, block_size: int = BS) -> Pending:
    msg = cluster_pb2.AssignRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens),
        block_hashes=block_hashes(prompt, block_size), hash_block_size=block_size,
    )
    return Pending(rid, f"{rid}-entry", msg, 0)


def report(wid: str, free: int = 64, num_blocks: int = 64, **kw) -> cluster_pb2.OccupancyReport:
    return cluster_pb2.OccupancyReport(worker_id=wid, num_blocks=num_blocks, num_free_blocks=free, block_size=BS,
                                       max_num_seqs=256, max_model_len=4096, **kw)


def worker(wid: str, **kw) -> WorkerEntry:
    return WorkerEntry(wid, f"{wid}-addr", report=report(wid, **kw))


def least_loaded(ws: list[WorkerEntry], p: Pending) -> WorkerEntry:
    """The placement before prefixes counted: the best score among the workers that fit."""
    return max((w for w in ws if w.fits(p, HEADROOM)), key=lambda w: w.score(p, HEADROOM))


def keys(n: int, salt: int = 0) -> list[bytes]:
    return block_hashes([salt * 100_000 + t for t in range(1, n * BS + 1)], BS)


# -- the index ------------------------------------------------------------------------------------
def test_a_run_stops_at_the_first_missing_key():
    idx = PrefixIndex()
    k = keys(6)
    idx.store("a", k[:4])
    idx.store("b", k[:2] + k[3:])  # b lost block 2: blocks 3.. are useless to it
    assert idx.match(k) == {"a": Match(4, 0), "b": Match(2, 0)}
    assert idx.match(keys(6, salt=1)) == {}
    assert idx.match([]) == {}
    idx.check_integrity()


def test_evicted_keys_go_and_a_reset_replaces_everything():
    idx = PrefixIndex()
    k = keys(5)
    idx.store("a", k)
    idx.store("b", k[:3])
    idx.evict("a", k[2:])
    assert idx.match(k) == {"a": Match(2, 0), "b": Match(3, 0)}
    idx.apply_events("b", stored=k[:1], evicted=(), reset=True)  # a new stream: b holds only block 0
    assert idx.match(k) == {"a": Match(2, 0), "b": Match(1, 0)}
    idx.apply_events("a", stored=k[2:4], evicted=k[:1], reset=False)
    assert idx.match(k) == {"b": Match(1, 0)}, "a lost block 0: nothing of the chain is usable there"
    idx.check_integrity()


def test_a_dead_workers_entries_go_and_its_slot_is_reused():
    idx = PrefixIndex()
    k = keys(3)
    idx.store("a", k)
    idx.hold("a", "r1", k)
    idx.store("b", k[:1])
    idx.remove_worker("a")
    assert idx.match(k) == {"b": Match(1, 0)}
    assert idx.num_worker_keys("a") == 0
    idx.release("r1")  # its request's notice comes after: nothing to do
    idx.store("c", k[:2])  # takes a's slot: none of a's bits may come back with it
    assert idx.match(k) == {"b": Match(1, 0), "c": Match(2, 0)}
    idx.check_integrity()


def test_the_bound_drops_the_least_recently_stored_keys_tail_first():
    idx = PrefixIndex(max_keys=8)
    old, new = keys(6, salt=1), keys(4, salt=2)
    idx.store("a", old)
    idx.store("b", new)
    assert idx.num_keys == 8
    assert idx.match(new) == {"b": Match(4, 0)}
    # The two dropped are old's last blocks, so its first four still make a run.
    assert idx.match(old) == {"a": Match(4, 0)}
    idx.store("a", old[:1])  # stored again: the most recent now
    idx.store("c", keys(3, salt=3))
    assert idx.match(old) == {"a": Match(1, 0)}
    # Placing a request refreshes the keys it uses: workers report storing, not reusing.
    idx.hold("b", "r", new[:2])
    idx.release("r")
    idx.store("c", keys(4, salt=4))  # 4 go: without the refresh, all of new
    assert idx.match(new) == {"b": Match(2, 0)}
    idx.check_integrity()


def test_in_flight_keys_last_until_their_request_leaves_unless_a_report_confirms_them():
    idx = PrefixIndex()
    k = keys(4)
    idx.hold("a", "r1", k)
    idx.hold("a", "r2", k[:2])
    assert idx.match(k) == {"a": Match(4, 4)}
    idx.release("r1")
    assert idx.match(k) == {"a": Match(2, 2)}
    idx.store("a", k[:1])  # the worker reports block 0 cached
    idx.release("r2")
    assert idx.match(k) == {"a": Match(1, 0)}
    idx.release("r2")  # twice is harmless
    idx.check_integrity()
    assert idx.num_keys == 1, "in-flight keys are not counted against the bound"


def test_a_run_can_continue_past_the_in_flight_part_on_cached_keys():
    idx = PrefixIndex()
    k = keys(5)
    idx.store("a", k)
    idx.hold("a", "r1", k[:2])
    assert idx.match(k) == {"a": Match(5, 2)}


# -- admission with a prefix (the arithmetic itself: tests/test_admission.py) -------------------------
def test_admission_holds_a_worker_without_room_for_the_uncached_part_is_skipped():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(), idx)
    first = pending("first", SYSTEM + [5] * BS)
    a, b = worker("a", free=64), worker("b", free=64)
    idx.hold("a", "first", first.assign.block_hashes)
    a.place(first, HEADROOM)
    second = pending("second", SYSTEM + [6] * (20 * BS))  # 36 prompt blocks + 4 of headroom
    got = placer.choose([a, b], second, HEADROOM)
    assert got.worker is a and got.decision == "cache"
    assert (got.num_matched_blocks, got.num_shared_blocks) == (16, 16)
    assert a.num_available_blocks == 64 - 21
    # a's room shrinks to 27 free, 4 of them owed to first (21 - 17): 23 left for the 24
    # second would take there (40 - 16 shared). b gets it though a holds its prefix.
    a.apply_report(report("a", free=27, blocks_per_request={"first": 17}, request_ids=["first"]))
    assert a.num_available_blocks == 23
    got = placer.choose([a, b], second, HEADROOM)
    assert got.worker is b and got.decision == "load" and got.num_matched_blocks == 0


# -- the policies ---------------------------------------------------------------------------------
def cluster(n: int = 3, **kw) -> list[WorkerEntry]:
    return [worker(f"w{i}", **kw) for i in range(n)]


def test_prefix_beats_load_while_the_workers_are_in_balance():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(balance_abs_threshold=4, balance_rel_threshold=1.5), idx)
    ws = cluster(free=256, num_blocks=256)
    idx.store("w2", pending("x", SYSTEM).assign.block_hashes)
    for i in range(3):  # w2 is the busiest, by memory and by count
        ws[2].place(pending(f"busy{i}", [9] * 64), HEADROOM)
    p = pending("p", SYSTEM + [4] * 40)
    assert least_loaded(ws, p) is not ws[2]
    got = placer.choose(ws, p, HEADROOM)
    assert got.worker is ws[2] and got.decision == "cache" and got.num_matched_blocks == 16


def test_load_wins_past_the_balance_thresholds():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(balance_abs_threshold=4, balance_rel_threshold=1.5), idx)
    ws = cluster(free=256, num_blocks=256)
    idx.store("w2", pending("x", SYSTEM).assign.block_hashes)
    for i in range(5):
        ws[2].place(pending(f"busy{i}", [9] * 16), HEADROOM)
    for w in ws[:2]:
        w.place(pending(f"one-{w.worker_id}", [9] * 16), HEADROOM)
    p = pending("p", SYSTEM)
    got = placer.choose(ws, p, HEADROOM)  # 5 - 1 > 4 is false: still cache
    assert got.worker is ws[2] and got.decision == "cache"
    ws[2].place(pending("busy5", [9] * 16), HEADROOM)  # 6 - 1 > 4 and 6 > 1.5 * 1
    got = placer.choose(ws, p, HEADROOM)
    assert got.worker is not ws[2] and got.decision == "balance" and got.num_matched_blocks == 0


def test_a_prefix_below_the_cache_threshold_goes_to_the_least_loaded():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(cache_threshold=0.5), idx)
    ws = cluster(free=256, num_blocks=256)
    ws[2].place(pending("busy", [9] * 64), HEADROOM)
    idx.store("w2", pending("x", SYSTEM).assign.block_hashes)
    long = pending("long", SYSTEM + [3] * (20 * BS))  # 16 of 36 blocks cached: 0.44 < 0.5
    got = placer.choose(ws, long, HEADROOM)
    assert got.worker is least_loaded(ws, long) and got.decision == "load"
    assert placer.choose(ws, pending("short", SYSTEM + [3] * BS), HEADROOM).worker is ws[2]


def test_keys_of_another_block_size_match_nothing():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(), idx)
    ws = cluster(free=256, num_blocks=256)
    ws[2].place(pending("busy", [9] * 64), HEADROOM)
    p = pending("p", SYSTEM, block_size=8)
    idx.store("w2", p.assign.block_hashes)
    assert placer.choose(ws, p, HEADROOM).decision == "load"


def test_a_burst_follows_the_first_placement_before_any_report():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(), idx)
    ws = cluster(free=256, num_blocks=256)
    chosen = []
    for i in range(6):
        p = pending(f"r{i}", SYSTEM + [100 + i] * 8)
        got = placer.choose(ws, p, HEADROOM)
        got.worker.place(p, HEADROOM, got.num_shared_blocks)
        idx.hold(got.worker.worker_id, p.request_id, p.assign.block_hashes)
        chosen.append(got.worker.worker_id)
    assert len(set(chosen)) == 1
    # 21 blocks each (264 tokens + 64 of headroom); each after the first shares the 16 full
    # prompt blocks and takes 5: its partial block and its headroom.
    w = ws[int(chosen[0][1:])]
    assert w.num_available_blocks == 256 - 21 - 5 * 5


def test_round_robin_cycles_among_the_workers_that_fit():
    placer = Placer(PlacementConfig(policy="round-robin"), PrefixIndex())
    ws = cluster(n=3, free=256, num_blocks=256)
    p = pending("p", [1] * 32)
    assert [placer.choose(ws, p, HEADROOM).worker.worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    ws[1].apply_report(report("w1", free=2))
    assert [placer.choose(ws, p, HEADROOM).worker.worker_id for _ in range(3)] == ["w2", "w0", "w2"]
    assert {placer.choose(ws, p, HEADROOM).decision} == {"round-robin"}


def test_least_loaded_is_the_admission_score():
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(policy="least-loaded"), idx)
    ws = [worker("a", free=40), worker("b", free=200, num_blocks=256), worker("c", free=30)]
    p = pending("p", SYSTEM)
    idx.store("c", p.assign.block_hashes)
    got = placer.choose(ws, p, HEADROOM)
    assert got.worker is least_loaded(ws, p) is ws[1]
    assert got.decision == "load"


def test_nothing_fits_nowhere():
    placer = Placer(PlacementConfig(), PrefixIndex())
    assert placer.choose(cluster(free=4), pending("p", SYSTEM), HEADROOM) is None


def test_the_report_interval_is_an_eighth_of_dead_after_at_most_half_a_second():
    from pagefleet.scheduler.core import report_interval

    assert report_interval(1.0) == 0.125 and report_interval(2.0) == 0.25 and report_interval(10.0) == 0.5
    assert report_interval(10.0, 0.05) == 0.05


@pytest.mark.parametrize("argv, names", [
    (["--report-interval", "0"], "--report-interval"),
    (["--report-interval", "2.5"], "--report-interval"),  # past --dead-after (2)
    (["--dead-after", "2", "--report-interval", "1.5"], "--report-interval"),  # one report a death: past half
    (["--report-interval", "nan"], "--report-interval"),
    (["--dead-after", "0"], "--dead-after"),
    (["--dead-after", "nan"], "--dead-after"),
])
def test_the_scheduler_refuses_a_report_interval_past_its_dead_after(argv, names, capsys):
    from pagefleet.scheduler.server import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and names in capsys.readouterr().err


@pytest.mark.parametrize("kw", [dict(policy="random"), dict(cache_threshold=1.5), dict(balance_rel_threshold=0.5)])
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        PlacementConfig(**kw)


# -- the scheduler's wiring, with fake workers ------------------------------------------------------
class FakeWorkerStub:
    """Accepts every Assign; the test feeds the occupancy stream (None ends it)."""

    def __init__(self) -> None:
        self.assigned: list[str] = []
        self.cancelled: list[str] = []
        self.epochs: dict[str, int] = {}
        self.reports: asyncio.Queue = asyncio.Queue()
        self.report_intervals: list[float] = []  # what each StreamOccupancy call asked for

    async def Cancel(self, request, timeout=None, metadata=None):
        self.cancelled.append(request.request_id)
        return cluster_pb2.WorkerCancelResponse()

    async def Assign(self, request, timeout=None, metadata=None):
        self.assigned.append(request.request_id)
        self.epochs[request.request_id] = request.epoch
        return cluster_pb2.AssignResponse(accepted=True)

    async def AssignBatch(self, request, timeout=None, metadata=None):
        return cluster_pb2.AssignBatchResponse(responses=[await self.Assign(r) for r in request.requests])

    async def StreamOccupancy(self, request):
        self.report_intervals.append(request.interval_s)
        while (r := await self.reports.get()) is not None:
            yield r


async def settle() -> None:
    """Let the scheduler's tasks run (they make real Redis round trips)."""
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_the_scheduler_learns_from_reports_holds_placements_and_forgets_the_dead():
    from pagefleet.common.fencing import Write
    from pagefleet.common.redis import Keys, OutEntry, RedisServer, connect
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig

    async def run(url: str) -> None:
        redis = connect(url)
        await redis.set(Keys("t").scheduler_epoch, 1)
        core = ClusterScheduler(redis, Keys("t"), SchedulerConfig(headroom_tokens=HEADROOM), epoch=1)
        core.ledger.adopting = False
        stubs = {wid: FakeWorkerStub() for wid in ("a", "b")}
        for wid, stub in stubs.items():
            core.ledger.add_worker(WorkerEntry(wid, f"{wid}-addr", stub=stub))
        tasks = [asyncio.create_task(core._watch(w)) for w in core.ledger.workers.values()]
        tasks.append(asyncio.create_task(core._dispatch()))
        tasks.append(asyncio.create_task(core._finishes()))
        cached = pending("x", SYSTEM).assign.block_hashes
        stubs["b"].reports.put_nowait(report("b", free=256, num_blocks=256, block_hashes_reset=True,
                                             stored_block_hashes=cached, prefix_cache_queries_total=40,
                                             prefix_cache_hits_total=10))
        stubs["a"].reports.put_nowait(report("a", free=256, num_blocks=256, block_hashes_reset=True))
        await settle()
        assert core.ledger.index.num_worker_keys("b") == 16
        # Idle, a worker reports every eighth of --dead-after (2 s): its heartbeat.
        assert stubs["a"].report_intervals == stubs["b"].report_intervals == [0.25]

        for i in range(3):
            p = pending(f"r{i}", SYSTEM + [50 + i] * 8)
            core.ledger.take(p.request_id, "", p.assign)
        core._wake.set()
        await settle()
        assert stubs["b"].assigned == ["r0", "r1", "r2"] and stubs["a"].assigned == []
        sample = core.metrics.registry.get_sample_value
        assert sample("pagefleet:scheduler_prefix_matched_blocks_total") == 48
        assert sample("pagefleet:scheduler_placements_total", {"decision": "cache"}) == 3
        assert sample("pagefleet:scheduler_worker_prefix_cache_hit_rate", {"worker": "b"}) == 0.25
        assert core.state().num_prefix_index_keys == 16 and core.state().placement == "prefix"

        # b evicts the prefix; the requests finish (their final writes land in Redis): nothing
        # of it is believed held any more.
        stubs["b"].reports.put_nowait(report("b", free=256, num_blocks=256, evicted_block_hashes=cached,
                                             finished_request_ids=["r0", "r1", "r2"]))
        await settle()
        assert set(core.ledger.where) == {"r0", "r1", "r2"}  # reported finished, not durable yet
        await core.fencing.write([Write(rid, stubs["b"].epochs[rid], OutEntry(0, [1], finish_reason="stop"))
                                  for rid in ("r0", "r1", "r2")])
        for _ in range(20):
            await settle()
            if not core.ledger.where:
                break
        assert core.ledger.index.match(cached) == {} and not core.ledger.where
        core.ledger.index.check_integrity()
        # A report older than those final writes (a gRPC stream and the done stream keep no
        # common order) still lists r0: no orphan. A request never placed there is one.
        stubs["b"].reports.put_nowait(report("b", free=250, num_blocks=256, request_ids=["r0", "zz"],
                                             blocks_per_request={"r0": 3, "zz": 3}))
        await settle()
        assert stubs["b"].cancelled == ["zz"]

        # a placed request's keys are held on its worker until that worker dies.
        p = pending("r3", SYSTEM)
        core.ledger.take(p.request_id, "", p.assign)
        core._wake.set()
        await settle()
        (wid,) = core.ledger.index.match(cached)
        stubs[wid].reports.put_nowait(None)  # its stream ends: dead, r3 is placed on the other
        await settle()
        (other,) = set(stubs) - {wid}
        assert core.ledger.where == {"r3": other} and core.ledger.index.match(cached) == {other: Match(16, 16)}
        core.ledger.index.check_integrity()
        assert not [t.exception() for t in tasks if t.done() and t.exception()]
        for t in tasks:
            t.cancel()
        await redis.aclose()

    with RedisServer() as server:
        asyncio.run(run(server.url))


def test_a_prompt_of_whole_blocks_matches_all_but_its_last_block():
    """The worker computes the last prompt token again for its logits: that block is not reused."""
    idx = PrefixIndex()
    placer = Placer(PlacementConfig(), idx)
    ws = cluster(free=256, num_blocks=256)
    p = pending("p", SYSTEM)
    idx.store("w1", p.assign.block_hashes)
    got = placer.choose(ws, p, HEADROOM)
    assert got.worker is ws[1] and got.num_matched_blocks == 15


# -- a real cluster: 2 workers, the tiny model ------------------------------------------------------
CONTEXT = "You are a careful assistant. Answer briefly and cite the manual. " * 8  # 528 bytes: 33 blocks


def _placements(log_dir, request_ids: set[str]) -> list[dict]:
    """The scheduler's ``request.placed`` log lines of ``request_ids``, in order."""
    from cluster_fixtures import log_events

    return [e for e in log_events(log_dir, "scheduler")
            if e.get("event") == "request.placed" and e.get("request_id") in request_ids]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", ["prefix", "round-robin"])
def test_a_cluster_places_shared_prefixes_by_policy(tmp_path, placement):
    from cluster_fixtures import generate_all, start_cluster, wait_for

    from pagefleet.client import Client

    cluster = start_cluster(tmp_path, num_workers=2, worker_args=["--num-blocks", "256"],
                            scheduler_args=["--placement", placement])
    try:
        assert cluster.scheduler_state().placement == placement
        ids = []
        with Client(cluster.gateway_target) as c:  # one at a time: each sees the reports before it
            for i in range(6):
                out = c.generate(f"{CONTEXT}Question {i}: what now?", max_tokens=4, temperature=0,
                                 ignore_eos=True, timeout=60)
                assert out.finish_reason == "length"
                ids.append(out.request_id)
        lines = wait_for(lambda: (p := _placements(tmp_path, set(ids))) and len(p) == 6 and p, 10,
                         "the scheduler's placement log lines")
        placed = [e["worker_id"] for e in lines]
        state = cluster.scheduler_state()
        reports = {w.worker_id: w.report for w in state.workers}
        if placement == "round-robin":
            assert placed[::2] == [placed[0]] * 3 and placed[1::2] == [placed[1]] * 3
            assert placed[0] != placed[1]
            return
        assert set(placed) == {placed[0]}, placed
        # After the first, each found the context's 32-33 blocks (per the byte tokenizer's BOS)
        # on that worker, and the worker found them in its cache.
        assert [e["decision"] for e in lines] == ["load"] + ["cache"] * 5, lines
        assert all(e["num_matched_blocks"] >= 32 for e in lines[1:]), lines
        assert reports[placed[0]].prefix_cache_hits_total >= 5 * 32 * 16, reports[placed[0]]
        assert state.num_prefix_index_keys >= 32
        # A burst of a new shared prefix, all at once: it stays together (held in flight),
        # where least-loaded would spread it.
        burst = [f"{CONTEXT.upper()}Item {i}" for i in range(6)]
        outs = generate_all(cluster.gateway_target, burst, max_tokens=4)
        lines = wait_for(lambda: (p := _placements(tmp_path, {o.request_id for o in outs})) and len(p) == 6 and p,
                         10, "the burst's placements")
        assert len({e["worker_id"] for e in lines}) == 1, lines
    finally:
        cluster.stop()


# -- a round of decisions against the plain scan -----------------------------------------------------
def _scan(placer: Placer, workers: list[WorkerEntry], p: Pending, headroom: int):
    """The placement rule as a plain scan of every worker (what ``Round`` must agree with)."""
    matches = placer.matches(workers, p)

    def m(w):
        return matches.get(w.worker_id, Match(0, 0))

    fitting = [w for w in workers if w.fits(p, headroom, m(w).num_shared_blocks)]
    if not fitting:
        return None
    if placer.cfg.policy == "round-robin":
        last = placer._last_worker_id
        after = [w for w in fitting if last is not None and w.worker_id > last]
        return min(after or fitting, key=lambda w: w.worker_id).worker_id, "round-robin"
    score = {w.worker_id: w.score(p, headroom, m(w).num_shared_blocks) for w in fitting}
    least = max(fitting, key=lambda w: score[w.worker_id])
    if placer.cfg.policy == "least-loaded":
        return least.worker_id, "load"
    if placer.out_of_balance(workers):
        return least.worker_id, "balance"
    best = max(fitting, key=lambda w: (m(w).num_matched_blocks, score[w.worker_id]))
    if m(best).num_matched_blocks and m(best).num_matched_blocks >= placer.cfg.cache_threshold * len(
            p.assign.block_hashes):
        return best.worker_id, "cache"
    return least.worker_id, "load"


@pytest.mark.parametrize("policy", ["prefix", "least-loaded", "round-robin"])
@pytest.mark.parametrize("seed", range(6))
def test_a_round_decides_as_a_scan_of_every_worker_would(policy, seed):
    """Random workers, prefixes and requests; every decision of a round, claimed before the
    next, is the one the plain scan makes on the same state."""
    import random

    rng = random.Random(seed)
    idx = PrefixIndex()
    cfg = PlacementConfig(policy, balance_abs_threshold=rng.choice([2, 32]))
    placer, twin = Placer(cfg, idx), Placer(cfg, idx)
    workers = [worker(f"w{i:02d}", free=rng.randint(0, 64), num_blocks=64, num_running=rng.randint(0, 9))
               for i in range(rng.randint(1, 12))]
    systems = [[rng.randrange(1, 50) for _ in range(4 * BS)] for _ in range(3)]
    for i, w in enumerate(workers):
        if rng.random() < 0.5:
            idx.store(w.worker_id, block_hashes(systems[i % 3], BS)[: rng.randint(1, 4)])
    rnd = placer.round(workers)
    for j in range(40):
        prompt = (systems[rng.randrange(3)] if rng.random() < 0.6 else []) + [rng.randrange(50, 99)
                                                                            for _ in range(rng.randint(1, 40))]
        p = pending(f"r{j}", prompt, max_tokens=rng.randint(1, 80))
        want = _scan(twin, workers, p, HEADROOM)
        got = rnd.choose(p, HEADROOM)
        assert (None if got is None else (got.worker.worker_id, got.decision)) == want, j
        if got is not None:
            twin._last_worker_id = placer._last_worker_id
            got.worker.place(p, HEADROOM, got.num_shared_blocks)
            idx.hold(got.worker.worker_id, p.request_id, p.assign.block_hashes)


def test_a_round_sent_in_the_background_still_stops_a_stale_scheduler():
    """Rounds are fenced and sent in the background; a fence refused for a newer scheduler's
    epoch must still end the dispatcher (and with it the scheduler) with StaleScheduler."""
    from pagefleet.common.redis import Keys, RedisServer, connect
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig, StaleScheduler

    async def run(url: str) -> None:
        redis = connect(url)
        await redis.set(Keys("t").scheduler_epoch, 2)  # a newer scheduler took over
        core = ClusterScheduler(redis, Keys("t"), SchedulerConfig(headroom_tokens=HEADROOM), epoch=1)
        core.ledger.adopting = False
        stub = FakeWorkerStub()
        core.ledger.add_worker(WorkerEntry("a", "a-addr", stub=stub))
        watch = asyncio.create_task(core._watch(core.ledger.workers["a"]))
        stub.reports.put_nowait(report("a", free=256, num_blocks=256))
        await settle()
        p = pending("r0", SYSTEM)
        core.ledger.take(p.request_id, "", p.assign)
        dispatch = asyncio.create_task(core._dispatch())
        core._wake.set()
        with pytest.raises(StaleScheduler):
            await asyncio.wait_for(dispatch, 5)
        assert stub.assigned == []
        watch.cancel()
        await redis.aclose()

    with RedisServer() as server:
        asyncio.run(run(server.url))


def test_a_round_too_large_for_one_message_goes_to_its_worker_in_several(monkeypatch):
    """Hundreds of long prompts sharing one cached document fit a worker's pool in one round,
    but not in one gRPC message (a worker takes 64 MiB: past it the call failed and the worker
    was declared dead). A worker's share of a round goes in messages under
    ``ASSIGN_MESSAGE_BYTES``, in order, every request once."""
    from pagefleet.common.redis import Keys, RedisServer, connect
    from pagefleet.scheduler import core as core_module
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig

    limit = 4096
    monkeypatch.setattr(core_module, "ASSIGN_MESSAGE_BYTES", limit)

    class Recording(FakeWorkerStub):
        def __init__(self) -> None:
            super().__init__()
            self.batch_bytes: list[int] = []

        async def AssignBatch(self, request, timeout=None, metadata=None):
            self.batch_bytes.append(request.ByteSize())
            return await super().AssignBatch(request, timeout, metadata)

    async def run(url: str) -> Recording:
        redis = connect(url)
        await redis.set(Keys("t").scheduler_epoch, 1)
        core = ClusterScheduler(redis, Keys("t"), SchedulerConfig(headroom_tokens=HEADROOM), epoch=1)
        core.ledger.adopting = False
        stub = Recording()
        core.ledger.add_worker(WorkerEntry("a", "a-addr", stub=stub))
        tasks = [asyncio.create_task(core._watch(core.ledger.workers["a"])), asyncio.create_task(core._dispatch())]
        stub.reports.put_nowait(report("a", free=4096, num_blocks=4096))
        await settle()
        for i in range(12):  # about 1 KB each
            p = pending(f"r{i}", SYSTEM + [100 + i] * 8)
            core.ledger.take(p.request_id, "", p.assign)
        core._wake.set()
        for _ in range(20):
            await settle()
            if len(stub.assigned) == 12:
                break
        assert core.ledger.workers["a"].alive
        for t in tasks:
            t.cancel()
        await redis.aclose()
        return stub

    with RedisServer() as server:
        stub = asyncio.run(run(server.url))
    assert stub.assigned == [f"r{i}" for i in range(12)]
    assert len(stub.batch_bytes) > 1 and max(stub.batch_bytes) <= limit, stub.batch_bytes


def test_a_worker_of_another_model_on_a_shard_is_flagged():
    """A worker started for another model on this shard (a wrong --shard) would answer this
    model's requests with that model's tokens: nothing said so. The scheduler of a named model
    now logs each such worker (a worker of the shard's own model, and rows of workers that say
    no model, pass quietly)."""
    import json

    from structlog.testing import capture_logs

    from pagefleet.common.redis import Keys, RedisServer, connect
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig

    async def run(url: str) -> list[dict]:
        redis = connect(url)
        keys = Keys("t")
        for wid, model in (("w-llama", "llama"), ("w-tiny", "tiny"), ("w-old", None)):
            row = {"address": "127.0.0.1:1", "beat": 1, "steps": ""} | ({"model": model} if model else {})
            await redis.hset(keys.workers, wid, json.dumps(row))
        core = ClusterScheduler(redis, keys, SchedulerConfig(model="llama"), epoch=1)
        with capture_logs() as logs:
            task = asyncio.create_task(core._discover())
            await asyncio.sleep(0.3)
            task.cancel()
        for t in core._tasks:
            t.cancel()
        await redis.aclose()
        return logs

    with RedisServer() as server:
        logs = asyncio.run(run(server.url))
    flagged = [e for e in logs if e["event"] == "worker.model_mismatch"]
    assert [(e["worker_id"], e["worker_model"], e["shard_model"]) for e in flagged] == [("w-tiny", "tiny", "llama")]
