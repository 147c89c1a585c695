"""Delta reports (``OccupancyRequest.deltas``): a worker table fed the changes agrees with one
fed whole reports, whatever the worker holds, places, finishes and drops between reports."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.queue import Pending
from pagefleet.scheduler.workers import WorkerEntry
from pagefleet.worker.report import Holdings

HEADROOM = 64
IDS = ["r0", "r1", "r2"]


def pending(rid: str) -> Pending:
    msg = cluster_pb2.AssignRequest(request_id=rid, prompt_token_ids=[1] * 40,
                                    sampling=generation_pb2.SamplingParams(max_tokens=100))
    return Pending(rid, f"{rid}-entry", msg, 0)


def report(stats, finished: list[str], holdings: Holdings | None) -> cluster_pb2.OccupancyReport:
    held = holdings.take(stats) if holdings else {"request_ids": stats.request_ids,
                                                  "blocks_per_request": stats.blocks_per_request}
    return cluster_pb2.OccupancyReport(worker_id="w", num_blocks=512, num_free_blocks=400, block_size=16,
                                       max_num_seqs=64, max_model_len=4096, finished_request_ids=finished, **held)


# One step: place a request, or the worker takes / grows / drops one / finishes one, or a report.
step = st.one_of(
    st.tuples(st.just("place"), st.sampled_from(IDS)),
    st.tuples(st.just("hold"), st.sampled_from(IDS), st.integers(0, 9)),
    st.tuples(st.just("drop"), st.sampled_from(IDS)),
    st.tuples(st.just("finish"), st.sampled_from(IDS)),
    st.tuples(st.just("forget"), st.sampled_from(IDS)),
    st.just(("report",)),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(step, max_size=60), st.integers(1, 5))
def test_deltas_give_the_table_whole_reports_give(steps, full_every):
    whole, delta = WorkerEntry("w", "a"), WorkerEntry("w", "a")
    holdings = Holdings(full_every=full_every)
    worker: dict[str, int] = {}  # what the worker holds: request id -> device blocks
    finished: list[str] = []
    for s in [("report",), *steps, ("report",)]:
        kind = s[0]
        if kind == "place":
            for w in (whole, delta):
                w.place(pending(s[1]), HEADROOM)
        elif kind == "forget":
            for w in (whole, delta):
                w.unplace(s[1])
        elif kind == "hold":
            worker[s[1]] = s[2]
        elif kind == "drop":
            worker.pop(s[1], None)
        elif kind == "finish" and s[1] in worker:
            del worker[s[1]]
            finished.append(s[1])
        elif kind == "report":
            stats = SimpleNamespace(request_ids=list(worker),
                                    blocks_per_request={r: n for r, n in worker.items() if n})
            before = set(delta.held)
            got_whole = whole.apply_report(report(stats, finished, None))
            r = report(stats, finished, holdings)
            got_delta = delta.apply_report(r)
            finished = []
            assert sorted(got_delta[0]) == sorted(got_whole[0])  # vanished
            if r.holdings_delta:  # orphans: the newly held among the whole report's
                assert got_delta[1] == [rid for rid in got_whole[1] if rid not in before]
            else:
                assert got_delta[1] == got_whole[1]
            for rid in got_whole[0]:  # the caller resumes what vanished elsewhere
                whole.unplace(rid)
                delta.unplace(rid)
            assert delta.held == whole.held == worker
            assert delta.num_owed_blocks_total == whole.num_owed_blocks_total
            assert delta.num_available_blocks == whole.num_available_blocks
            assert {rid: (pl.reflected, pl.listed, pl.finished) for rid, pl in delta.placed.items()} == \
                   {rid: (pl.reflected, pl.listed, pl.finished) for rid, pl in whole.placed.items()}
            assert sorted(delta.full_report().request_ids) == sorted(whole.report.request_ids)
            assert dict(delta.full_report().blocks_per_request) == dict(whole.report.blocks_per_request)


def test_a_delta_names_only_what_changed():
    h = Holdings(full_every=100)
    first = h.take(SimpleNamespace(request_ids=["a", "b"], blocks_per_request={"a": 3}))
    assert first == {"request_ids": ["a", "b"], "blocks_per_request": {"a": 3}}
    second = h.take(SimpleNamespace(request_ids=["a", "c"], blocks_per_request={"a": 3, "c": 1}))
    assert second == {"holdings_delta": True, "request_ids": ["c"], "blocks_per_request": {"c": 1},
                      "released_request_ids": ["b"]}
    third = h.take(SimpleNamespace(request_ids=["a", "c"], blocks_per_request={"c": 2}))
    assert third == {"holdings_delta": True, "request_ids": [], "blocks_per_request": {"a": 0, "c": 2},
                     "released_request_ids": []}


def test_a_request_dropped_after_it_was_seen_vanishes_once():
    w, h = WorkerEntry("w", "a"), Holdings()
    w.apply_report(report(SimpleNamespace(request_ids=[], blocks_per_request={}), [], h))
    w.place(pending("a"), HEADROOM)
    w.place(pending("b"), HEADROOM)
    owed = w.num_owed_blocks_total
    r = report(SimpleNamespace(request_ids=["a", "b"], blocks_per_request={"a": 2, "b": 3}), [], h)
    assert r.holdings_delta and w.apply_report(r) == ([], [])
    assert w.num_owed_blocks_total == owed - 5
    r = report(SimpleNamespace(request_ids=["b", "x"], blocks_per_request={"b": 3}), [], h)
    assert list(r.released_request_ids) == ["a"]
    assert w.apply_report(r) == (["a"], ["x"])  # `a` dropped unfinished; `x` was never placed here
    w.unplace("a")
    r = report(SimpleNamespace(request_ids=["b", "x"], blocks_per_request={"b": 3}), [], h)
    assert w.apply_report(r) == ([], [])  # nothing changed: nothing named


def test_a_change_during_one_streams_report_still_wakes_every_stream():
    """Each occupancy stream waits on its own event, cleared before it builds a report: a change
    while one stream sends wakes it again, and one stream's report does not clear another's."""
    import asyncio

    from pagefleet.worker.service import Changes

    async def run() -> None:
        changes = Changes()
        with changes.watch() as a, changes.watch() as b:
            changes.set()
            a.clear()  # a builds and sends its report ...
            changes.set()  # ... and the engine changes meanwhile
            assert a.is_set() and b.is_set()
            a.clear()
            assert b.is_set()
        assert not changes._events  # a stream that ends stops watching

    asyncio.run(run())


def test_an_idle_worker_reports_at_its_heartbeat_a_busy_one_every_tenth_of_a_second(monkeypatch):
    """The scheduler's ``interval_s`` is an idle worker's heartbeat; while its snapshot moves (a
    step rebuilds it), a worker reports at least every 0.1 s, as before."""
    import asyncio
    from types import SimpleNamespace

    from pagefleet.worker.service import Changes, WorkerService

    waits: list[float] = []

    async def no_wait(aw, timeout):  # records how long the stream would wait, then times out
        waits.append(timeout)
        aw.close()
        raise TimeoutError

    async def run(busy: bool) -> list[float]:
        waits.clear()
        subscriptions = SimpleNamespace(subscribe=lambda: None, unsubscribe=lambda s: None)
        loop = SimpleNamespace(snapshot=object(), kv_events=subscriptions, **vars(subscriptions))
        stopped = asyncio.Event()
        reports = []

        def report(*args):
            reports.append(1)
            if len(reports) == 5:
                stopped.set()
            if busy:
                loop.snapshot = object()  # a step rebuilt it
            return cluster_pb2.OccupancyReport()

        w = SimpleNamespace(loop=loop, changed=Changes(), stopped=stopped, report=report)
        async for _ in WorkerService(w).StreamOccupancy(cluster_pb2.OccupancyRequest(interval_s=0.25), None):
            pass
        return list(waits)

    monkeypatch.setattr(asyncio, "wait_for", no_wait)
    assert asyncio.run(run(busy=False)) == [0.1, 0.25, 0.25, 0.25, 0.25]  # the first report: fresh
    assert asyncio.run(run(busy=True)) == [0.1] * 5
