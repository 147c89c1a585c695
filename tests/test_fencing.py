"""Fenced ownership in a real Redis: a step is one write for all its requests, a fenced worker
cannot write again, a finish is one atomic step, and a resume reads exactly what was written.
Every worker here writes through the client and, again, through a blocking connection of its
own (``redis_lane.BlockingLane``, from a thread, as workers do)."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.fencing import DONE_TTL_S, Fenced, Fencing, Write, read_record, take_over
from pagefleet.common.redis import GROUP, Keys, OutEntry, RedisServer, connect
from pagefleet.common.redis_lane import blocking_lane_for
from pagefleet.common.step_write import messages
from pagefleet.protos import cluster_pb2

WRITE_PATH = {"lane": False}


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture(autouse=True, params=["client", "lane"])
def write_path(request, monkeypatch):
    """Workers write through the client, or through a connection of their own."""
    monkeypatch.setitem(WRITE_PATH, "lane", request.param == "lane")
    return request.param


def run(coro):
    return asyncio.run(coro)


async def _setup(url: str, ns: str):
    r = connect(url)
    keys = Keys(f"{ns}-lane" if WRITE_PATH["lane"] else ns)
    await r.set(keys.scheduler_epoch, 7)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    return r, keys


async def _worker(r, keys, wid: str) -> Fencing:
    f = Fencing(r, keys, wid)
    if WRITE_PATH["lane"]:  # as a worker's output writer: its writes on a thread, on its own connection
        lane = blocking_lane_for(r)
        assert lane is not None

        def write_step(step, live=None):
            return asyncio.to_thread(f.write_step_blocking, step, lane, live)

        f.write_step = write_step
    await f.publish_stream()
    return f


def test_a_step_is_one_entry_in_the_workers_stream_whatever_its_requests(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t1")
        f = await _worker(r, keys, "w1")
        ea, eb = await f.assign("a", 7, "w1"), await f.assign("b", 7, "w1")
        await r.config_resetstat()
        ok = await f.write([Write("a", ea, OutEntry(0, [5, 6], "xy")), Write("b", eb, OutEntry(0, [9], "z"))])
        assert ok == [True, True]
        stats = await r.info("commandstats")
        assert stats["cmdstat_xadd"]["calls"] == 1 and "cmdstat_evalsha" not in stats
        entries = await r.xrange(f.steps_key)
        outs = messages(cluster_pb2.StepOutputs.FromString(entries[0][1][b"o"]))  # rows of its columns
        assert [(o.request_id, o.index, list(o.token_ids), o.text) for o in outs] == [
            ("a", 0, [5, 6], "xy"), ("b", 0, [9], "z")]
        await r.aclose()

    run(go())


def test_each_gateways_messages_go_to_its_own_field_of_the_one_entry(redis_url):
    """A step of requests relayed by two gateway processes (and one by none) is still one
    entry; each gateway's messages are in its field, so a gateway decodes only its own. A
    finishing step (the finish script) keeps them apart the same way, finals included."""
    from pagefleet.common.fencing import outputs_of, steps_field

    async def go():
        r, keys = await _setup(redis_url, "fields")
        f = await _worker(r, keys, "w1")
        e = {rid: await f.assign(rid, 7, "w1") for rid in "abcd"}
        g1, g2 = steps_field("g1"), steps_field("g2")
        assert (g1, steps_field("")) == ("o:g1", "o")
        assert await f.write([Write("a", e["a"], OutEntry(0, [1], "x"), field=g1),
                              Write("b", e["b"], OutEntry(0, [2], "y"), field=g2),
                              Write("c", e["c"], OutEntry(0, [3], "z"))]) == [True] * 3
        ok = await f.write([Write("a", e["a"], OutEntry(1, [4], "u"), field=g1),
                            Write("b", e["b"], OutEntry(1, [5], "v", "stop"), field=g2),
                            Write("d", e["d"], OutEntry(0, [6], "w", "length"), field=g2)])
        assert ok == [True, True, True]
        entries = await r.xrange(f.steps_key)
        assert len(entries) == 2

        def seen(fields, field):
            return [(o.request_id, list(o.token_ids), o.finish_reason) for o in outputs_of(fields, [field.encode()])]

        (_, first), (_, second) = entries
        assert seen(first, g1) == [("a", [1], "")] and seen(first, g2) == [("b", [2], "")]
        assert seen(first, "o") == [("c", [3], "")]
        assert seen(second, g1) == [("a", [4], "")]
        assert seen(second, g2) == [("b", [5], "stop"), ("d", [6], "length")]
        assert sorted(o.request_id for o in outputs_of(second)) == ["a", "b", "d"]
        await r.aclose()

    run(go())


def test_a_stale_scheduler_cannot_assign(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t2")
        f = Fencing(r, keys)
        assert await f.assign("a", 6, "w1") == -1  # epoch 6 was superseded by 7
        first = await f.assign("a", 7, "w1")
        (now_s, now_us) = await r.time()
        # An epoch is at least Redis's clock in microseconds (a rollback cannot hand it out again).
        assert now_s * 1_000_000 + now_us - 5_000_000 < first <= now_s * 1_000_000 + now_us
        assert await f.assign("a", 7, "w2") > first
        await r.aclose()

    run(go())


def test_finish_is_durable_and_atomic_and_only_the_owner_finishes(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t3")
        f = await _worker(r, keys, "w1")
        entry_id = await r.xadd(keys.requests, {"kind": "generate", "rid": "a"})
        await r.xreadgroup(GROUP, "s", {keys.requests: ">"})
        await r.set(keys.idempotency("a"), 1, ex=3600)
        e = await f.assign("a", 7, "w1")
        record = OutEntry(0, [1, 2, 3], "abc", "length")
        assert await f.write([Write("a", e, OutEntry(0, [1, 2], "ab")),
                              Write("a", e, OutEntry(2, [3], "c", finish_reason="length"), entry_id.decode(),
                                    record=record)]) == [True, True]
        assert await r.xlen(keys.requests) == 0  # acknowledged and deleted in the same step
        done = await r.xrange(keys.done)
        assert [(d[b"rid"], d[b"epoch"], d[b"f"]) for _, d in done] == [(b"a", str(e).encode(), b"length")]
        assert 0 < await r.ttl(keys.owner("a")) <= DONE_TTL_S
        assert 0 < await r.ttl(keys.idempotency("a")) <= DONE_TTL_S  # one lifetime for both
        assert await read_record(r, keys, "a") == [record]  # what a retry replays
        # After the finish nobody finishes again, not even the owner, and it is never re-assigned.
        assert await f.write([Write("a", e, OutEntry(3, [], "", "stop"))]) == [False]
        assert await f.assign("a", 7, "w2") == 0
        # A stale epoch's finish is refused, and its final message is not in the stream.
        eb = await f.assign("b", 7, "w1")
        await f.assign("b", 7, "w2")
        assert await f.write([Write("b", eb, OutEntry(0, [4], "", "stop"))]) == [False]
        last = await r.xrevrange(f.steps_key, count=1)
        assert not messages(cluster_pb2.StepOutputs.FromString(last[0][1][b"o"]))
        await r.aclose()

    run(go())


def test_take_over_fences_the_last_worker_and_reads_exactly_what_it_wrote(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t4")
        w1 = await _worker(r, keys, "w1")
        e = await w1.assign("a", 7, "w1")
        await w1.write([Write("a", e, OutEntry(0, [1, 2], "ab")), Write("x", 1, OutEntry(0, [9]))])
        await w1.write([Write("a", e, OutEntry(2, [3], "c"))])
        await w1.assign("a", 7, "")  # the scheduler's fence: a new epoch, the last worker kept
        tokens, finish = await take_over(r, keys, "a")
        assert (tokens, finish) == ([1, 2, 3], "")
        with pytest.raises(Fenced):  # the old worker can add nothing behind that read
            await w1.write([Write("a", e, OutEntry(3, [4]))])
        # Resumed on w2 after those three tokens; w2 dies in turn: the record and w2's stream.
        w2 = await _worker(r, keys, "w2")
        e2 = await w2.assign("a", 7, "w2")
        await w2.write([Write("a", e2, OutEntry(3, [4, 5], "de"))])
        await w2.assign("a", 7, "")
        assert await take_over(r, keys, "a") == ([1, 2, 3, 4, 5], "")
        merged_text = "".join(m.text for m in await read_record(r, keys, "a") if m.index == 0)
        assert merged_text.startswith("abc")
        # A fenced worker goes on in a new stream, where it is found again.
        w1.new_incarnation()
        await w1.publish_stream()
        assert await w1.write([Write("y", 1, OutEntry(0, [7]))]) == [True]
        await r.aclose()

    run(go())


def test_fencing_a_stream_never_written_makes_one_that_expires(redis_url):
    """A worker declared dead before its first write: the fence makes its steps stream, which no
    one writes again (the worker goes on in a new one). It expires as a written one does; it was
    made with no TTL and stayed for ever."""
    from pagefleet.common.fencing import STEPS_TTL_S, fence_stream

    async def go():
        r, keys = await _setup(redis_url, "t8")
        key = keys.steps("never-wrote")
        await fence_stream(r, key)
        await fence_stream(r, key)  # idempotent
        ttl = await r.ttl(key)
        await r.aclose()
        return ttl

    assert 0 < run(go()) <= STEPS_TTL_S


def test_a_steps_stream_is_trimmed_by_age_but_never_past_a_running_requests_first_entry(redis_url, monkeypatch):
    from pagefleet.common import fencing

    monkeypatch.setattr(fencing, "STEPS_KEEP_MS", 0)  # everything is old at once
    monkeypatch.setattr(fencing, "STEPS_TRIM_EVERY_MS", 0)  # every write trims

    async def go():
        r, keys = await _setup(redis_url, "t5")
        f = await _worker(r, keys, "w1")
        e = await f.assign("a", 7, "w1")
        await f.write([Write("a", e, OutEntry(0, [1], "x"))], live={"a"})
        for i in range(600):  # a busy stream: other requests, while "a" waits (swapped, say)
            await f.write([Write(f"b{i}", 1, OutEntry(0, [2]))], live={"a", f"b{i}"})
        first = await r.xrange(f.steps_key, count=1)
        assert messages(cluster_pb2.StepOutputs.FromString(first[0][1][b"o"]))[0].request_id == "a"
        assert (await take_over(r, keys, "a", fence=True))[0] == [1]  # what a resume reads back
        g = await _worker(r, keys, "w2")
        for i in range(600):  # "a" is not held here: the stream is trimmed
            await g.write([Write(f"c{i}", 1, OutEntry(0, [2]))], live={f"c{i}"})
        assert await r.xlen(g.steps_key) < 300
        await r.aclose()

    run(go())


def test_a_steps_stream_is_trimmed_by_one_write_in_each_trim_period(redis_url, monkeypatch):
    from pagefleet.common import fencing

    monkeypatch.setattr(fencing, "STEPS_KEEP_MS", 0)
    monkeypatch.setattr(fencing, "STEPS_TRIM_EVERY_MS", 3_600_000)

    async def go():
        r, keys = await _setup(redis_url, "t5b")
        f = await _worker(r, keys, "w1")
        e = await f.assign("a", 7, "w1")
        await f.write([Write("a", e, OutEntry(0, [1]))], live=set())
        for i in range(400):  # the first write trimmed; none of these is due to
            await f.write([Write(f"b{i}", 1, OutEntry(0, [2]))], live={f"b{i}"})
        assert await r.xlen(f.steps_key) == 401
        await f.write([Write("c", 1, OutEntry(0, [3], finish_reason="stop"), entry_id="")], live=set())
        assert await r.xlen(f.steps_key) == 402  # nor is a finish
        monkeypatch.setattr(fencing, "STEPS_TRIM_EVERY_MS", 0)
        await f.write([Write("d", 1, OutEntry(0, [4]))], live={"d"})
        assert await r.xlen(f.steps_key) < 300  # due: trimmed (by whole nodes, MINID ~)
        monkeypatch.setattr(fencing, "STEPS_TRIM_EVERY_MS", 3_600_000)
        for i in range(400):
            await f.write([Write(f"e{i}", 1, OutEntry(0, [5]))], live={f"e{i}"})
        n = await r.xlen(f.steps_key)
        monkeypatch.setattr(fencing, "STEPS_TRIM_EVERY_MS", 0)
        await f.write([Write("g", 1, OutEntry(0, [6], finish_reason="stop"), entry_id="")], live=set())
        assert await r.xlen(f.steps_key) < n - 100  # a finish that is due trims too (FINISH's MINID)
        await r.aclose()

    run(go())


def test_a_round_of_assignments_is_one_script_and_a_stale_scheduler_writes_none(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t6")
        f = Fencing(r, keys, stream_of=lambda wid: f"steps-{wid}")
        done = await f.assign("c", 7, "w1")
        await r.hset(keys.owner("c"), "done", "1")
        await r.config_resetstat()
        epochs = await f.assign_many([("a", "w1"), ("b", "w2"), ("c", "w1")], 7)
        stats = await r.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1 and stats["cmdstat_time"]["calls"] == 1
        assert epochs[0] > 0 and epochs[1] > 0 and epochs[2] == 0
        for rid, wid, e in (("a", "w1", epochs[0]), ("b", "w2", epochs[1])):
            assert await r.hmget(keys.owner(rid), "epoch", "worker", "steps") == [
                str(e).encode(), wid.encode(), f"steps-{wid}".encode()]
            assert 0 < await r.ttl(keys.owner(rid)) <= 3600
        assert await r.hget(keys.owner("c"), "epoch") == str(done).encode()  # a done request keeps its epoch
        # A new epoch only (the last worker kept), always above the last one.
        (again,) = await f.assign_many([("a", "")], 7)
        assert again > epochs[0] and await r.hget(keys.owner("a"), "worker") == b"w1"
        # A stale scheduler: every answer -1, nothing written.
        assert await f.assign_many([("a", "w2"), ("d", "w2")], 6) == [-1, -1]
        assert await r.hget(keys.owner("a"), "worker") == b"w1" and not await r.exists(keys.owner("d"))
        await r.aclose()

    run(go())


def test_a_write_that_finishes_several_requests_acks_them_together_and_names_them_in_one_done_entry(redis_url):
    async def go():
        r, keys = await _setup(redis_url, "t7")
        f = await _worker(r, keys, "w1")
        entry_ids = {rid: (await r.xadd(keys.requests, {"kind": "generate", "rid": rid})).decode() for rid in "abc"}
        await r.xreadgroup(GROUP, "s", {keys.requests: ">"})
        epochs = dict(zip("abc", await f.assign_many([(rid, "w1") for rid in "abc"], 7), strict=True))
        stale = epochs["c"] - 1  # a write under an older epoch is refused and leaves "c" as it was
        ok = await f.write([Write("a", epochs["a"], OutEntry(0, [1], "x", "stop"), entry_ids["a"]),
                            Write("b", epochs["b"], OutEntry(0, [2], "y", "length"), entry_ids["b"]),
                            Write("c", stale, OutEntry(0, [3], "z", "stop"), entry_ids["c"])])
        assert ok == [True, True, False]
        assert await r.xlen(keys.requests) == 1  # "a" and "b" acknowledged and deleted
        pending = await r.xpending_range(keys.requests, GROUP, "-", "+", 10)
        assert [p["message_id"].decode() for p in pending] == [entry_ids["c"]]
        (_, fields), = await r.xrange(keys.done)
        assert fields == {b"rid": b"a b", b"epoch": f"{epochs['a']} {epochs['b']}".encode(), b"f": b"stop length"}
        assert [m.token_ids for m in await read_record(r, keys, "b")] == [[2]]
        assert await read_record(r, keys, "c") == [] and await r.hget(keys.owner("c"), "done") is None
        await r.aclose()

    run(go())
