"""A worker's output writer against a real redis-server: steps encoded on the engine's side
go out as one entry each (coalesced when they wait), a fenced stream is found by a write or,
with nothing to write, by a probe, and either way the worker goes on in a new stream."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions as rx

from pagefleet.common.fencing import entry_of, fence_stream, outputs_of
from pagefleet.common.redis import Keys, RedisServer, connect
from pagefleet.common.step_write import StepEncoder
from pagefleet.worker.redis_io import OutputWriter


@pytest.fixture(scope="module", params=["tcp", "unix"])
def redis_url(request):
    """Every test over TCP and over the unix socket (``up``'s processes use its Redis's)."""
    with RedisServer(unix_socket=True) as server:
        yield server.url if request.param == "tcp" else server.socket_url


def _step(rid: str, index: int, token: int):
    enc = StepEncoder()
    enc.add("o", rid, index, [token], chr(token))
    if index == 0:
        enc.first.append(rid)
    return enc.build()


async def _writer(url: str, ns: str):
    r = connect(url)
    fenced: list[bool] = []

    async def on_fenced(discard) -> None:
        fenced.append(True)
        discard()

    w = OutputWriter(r, Keys(ns), writer_id="w1", on_fenced=on_fenced)
    await w.fencing.publish_stream()
    return r, w, fenced, asyncio.create_task(w.run())


def test_steps_that_wait_are_coalesced_into_one_entry(redis_url):
    async def go():
        r, w, _, task = await _writer(redis_url, "ow1")
        assert w.lane is not None
        for i in range(3):  # queued before the writer runs: one write
            w.put(_step("a", i, 65 + i))
        await w.flush()
        entries = await r.xrange(w.fencing.steps_key)
        assert len(entries) == 1 and w.num_round_trips == 1
        assert [(e.index, e.token_ids, e.text) for e in map(entry_of, outputs_of(entries[0][1]))] == [
            (0, [65], "A"), (1, [66], "B"), (2, [67], "C")]
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_probe_finds_a_fenced_stream_when_there_is_nothing_to_write(redis_url):
    async def go():
        r, w, fenced, task = await _writer(redis_url, "ow2")
        w.put(_step("a", 0, 65))
        await w.flush()
        first = w.fencing.steps_key
        w.probe()  # not fenced: nothing happens
        await w.flush()
        assert (fenced, w.fencing.steps_key, w.num_round_trips) == ([], first, 1)
        await fence_stream(r, first)  # declared dead while idle
        w.probe()
        await w.flush()
        assert fenced == [True] and w.num_fenced == 1 and w.fencing.steps_key != first
        assert await r.get(Keys("ow2").steps_of("w1")) == w.fencing.steps_key.encode()
        w.put(_step("b", 0, 66))  # and it writes on in the new stream
        await w.flush()
        assert len(await r.xrange(w.fencing.steps_key)) == 1
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_fenced_writer_drops_what_was_made_before_the_drop_and_writes_what_came_after(redis_url):
    """The engine drops what it holds on the engine thread and discards the writer's waiting
    steps there and then: a step made before the drop is never written, one made after it
    (a request assigned since) goes to the new stream."""
    async def go():
        r = connect(redis_url)
        w = OutputWriter(r, Keys("ow3"), writer_id="w1")

        async def on_fenced(discard) -> None:  # as the worker's: on the engine thread, between steps
            w.put(_step("b", 1, 67))  # made before the drop: in the queue when it happens
            discard()
            w.put(_step("c", 0, 68))  # made after it

        w.on_fenced = on_fenced
        await w.fencing.publish_stream()
        task = asyncio.create_task(w.run())
        first = w.fencing.steps_key
        await fence_stream(r, first)
        w.put(_step("b", 0, 66))  # refused: the stream is fenced
        await w.flush()
        assert w.num_fenced == 1 and w.fencing.steps_key != first
        entries = await r.xrange(w.fencing.steps_key)
        written = [(o.request_id, o.index) for _, f in entries for o in outputs_of(f)]
        assert written == [("c", 0)] and w.backlog == 0
        task.cancel()
        await r.aclose()

    asyncio.run(go())


# -- steps the engine thread sends itself ----------------------------------------------------
async def _open_writer(url: str, ns: str, **kwargs):
    """A running writer whose lane is open (its first write went by its thread), so later
    ``put``s send on the calling thread; ``refused`` collects ``on_refused``."""
    r = connect(url)
    refused: list[str] = []
    w = OutputWriter(r, Keys(ns), writer_id="w1", on_refused=lambda rid, epoch: refused.append(rid), **kwargs)
    await w.fencing.publish_stream()
    task = asyncio.create_task(w.run())
    w.put(_step("warm", 0, 64))
    await w.flush()
    assert w.num_direct == 0 and w.lane.direct
    return r, w, refused, task


async def _assigned(r, w, ns: str, rid: str):
    """``rid`` assigned to ``w`` (the requests stream and its group made): its keys and epoch."""
    from pagefleet.common.redis import GROUP

    keys = Keys(ns)
    await r.set(keys.scheduler_epoch, 3)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    return keys, await w.fencing.assign(rid, 3, "w1")


def _written(entries) -> list[tuple[str, int]]:
    return [(o.request_id, o.index) for _, f in entries for o in outputs_of(f)]


def test_steps_are_sent_by_the_putting_thread_and_their_replies_read_at_its_next_put(redis_url):
    async def go():
        r, w, _, task = await _open_writer(redis_url, "ow-direct")
        for i in range(5):
            w.put(_step("a", i, 65 + i))
            await asyncio.sleep(0.05)  # Redis answers meanwhile (well under the writer's 0.5 s): the next put reads it
        assert w.num_direct == 5 and w.num_round_trips >= 1 + 4  # the first four settled by the puts after them
        await w.flush()
        assert w.num_round_trips == 6 and w.backlog == 0 and not w._in_flight
        entries = await r.xrange(w.fencing.steps_key)
        assert _written(entries) == [("warm", 0), *(("a", i) for i in range(5))]  # one entry a step, in order
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_replies_owed_when_the_engine_goes_idle_are_read_by_the_writers_thread(redis_url):
    async def go():
        r, w, _, task = await _open_writer(redis_url, "ow-idle")
        w.put(_step("a", 0, 65))
        assert w.num_direct == 1 and len(w._in_flight) == 1
        w.idle()  # the engine has nothing to step: the writer's thread reads the reply, soon
        for _ in range(200):
            if not w._in_flight:
                break
            await asyncio.sleep(0.005)
        assert not w._in_flight and w.backlog == 0 and w.num_round_trips == 2
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_refused_final_sent_directly_is_handed_back(redis_url):
    from pagefleet.common.fencing import Write, encode
    from pagefleet.common.redis import OutEntry
    from pagefleet.common.scripts import FINISH

    async def go():
        r, w, refused, task = await _open_writer(redis_url, "ow-refused")
        keys, epoch = await _assigned(r, w, "ow-refused", "a")
        await r.script_load(FINISH)  # as after the worker's first finish
        w.put(encode([Write("a", epoch, OutEntry(0, [1], "x", "stop"))]))
        w.put(encode([Write("a", epoch, OutEntry(0, [1], "x", "stop"))]))  # again: done already
        await w.flush()
        assert w.num_direct == 2 and refused == ["a"]
        assert await r.hget(keys.owner("a"), "done") == b"1"
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_step_sent_directly_to_a_fenced_stream_is_dropped_and_the_writer_goes_on(redis_url):
    async def go():
        r, w, _, task = await _open_writer(redis_url, "ow-dfence")
        fenced: list[bool] = []

        async def on_fenced(discard) -> None:
            fenced.append(True)
            discard()

        w.on_fenced = on_fenced
        first = w.fencing.steps_key
        await fence_stream(r, first)
        w.put(_step("b", 0, 66))  # sent directly; its reply is the fence's error
        await w.flush()
        assert w.num_direct == 1 and fenced == [True] and w.fencing.steps_key != first
        assert _written(await r.xrange(first)) == [("warm", 0)]
        w.put(_step("c", 0, 67))
        await w.flush()
        assert _written(await r.xrange(w.fencing.steps_key)) == [("c", 0)] and w.backlog == 0
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_steps_in_flight_when_the_connection_breaks_are_written_again(redis_url):
    import redis

    async def go():
        r, w, _, task = await _open_writer(redis_url, "ow-broken")
        client_id = w.lane.call([("CLIENT", "ID")])[0]
        w.put(_step("a", 0, 65))
        redis.Redis.from_url(redis_url).execute_command("CLIENT", "KILL", "ID", client_id)
        for i in range(1, 4):
            w.put(_step("a", i, 65 + i))
            await asyncio.sleep(0.005)
        await w.flush()
        written = _written(await r.xrange(w.fencing.steps_key))
        assert sorted(set(written)) == [("a", i) for i in range(4)] + [("warm", 0)]  # nothing lost (twice is harmless)
        assert w.backlog == 0
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_finish_sent_directly_where_redis_lost_the_script_is_written_by_the_writers_thread(redis_url):
    from pagefleet.common.fencing import Write, encode
    from pagefleet.common.redis import OutEntry

    async def go():
        r, w, refused, task = await _open_writer(redis_url, "ow-noscript")
        keys, epoch = await _assigned(r, w, "ow-noscript", "a")
        await r.script_flush()
        w.put(encode([Write("a", epoch, OutEntry(0, [1], "x", "stop"))]))
        await w.flush()
        assert w.num_direct == 1 and refused == []
        assert await r.hget(keys.owner("a"), "done") == b"1"
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_step_the_socket_cannot_take_at_once_is_finished_by_the_writers_thread(redis_url):
    async def go():
        r, w, _, task = await _open_writer(redis_url, "ow-big")
        enc = StepEncoder()
        text = "y" * 8_000_000  # more than a socket's buffers hold
        enc.add("o", "big", 0, [65], text)
        w.put(enc.build())
        w.put(_step("a", 0, 66))  # behind it: queued, written after
        await w.flush()
        assert w.num_direct == 1 and w.backlog == 0
        entries = await r.xrange(w.fencing.steps_key)
        assert _written(entries) == [("warm", 0), ("big", 0), ("a", 0)]
        assert next(o for _, f in entries for o in outputs_of(f) if o.request_id == "big").text == text
        task.cancel()
        await r.aclose()

    asyncio.run(go())


def test_a_send_that_breaks_after_part_of_the_replies_were_read_leaves_none_behind(redis_url):
    """The engine read one of a step's two replies, then its next send found the connection
    broken: every step in flight goes again on a new connection, and no reply of the old one
    is matched to a step sent on the new one (the replies read so far are forgotten)."""
    from pagefleet.common.fencing import Write, encode
    from pagefleet.common.redis import OutEntry
    from pagefleet.common.scripts import FINISH

    async def go():
        r, w, refused, task = await _open_writer(redis_url, "ow-partial")
        keys, epoch = await _assigned(r, w, "ow-partial", "b")
        await r.script_load(FINISH)
        lane = w.lane
        enc = StepEncoder()
        enc.add("o", "a", 0, [65], "A")
        enc.refresh.append("a")  # its owner record's EXPIRE, then the XADD: two replies
        w.put(enc.build())
        await asyncio.sleep(0.05)  # both replies have come
        real_reply, real_send = lane.reply_nowait, lane.send_nowait
        given = []

        def one_reply():  # only the EXPIRE's reply has come
            if given:
                return False
            given.append(real_reply())
            return given[0]

        def broken(data):
            lane.close()
            raise rx.ConnectionError("reset")

        lane.reply_nowait, lane.send_nowait = one_reply, broken
        w.put(_step("a", 1, 66))
        lane.reply_nowait, lane.send_nowait = real_reply, real_send
        assert given and w._replies == [] and not w._in_flight  # both steps go again, nothing read kept
        await w.flush()
        w.put(_step("x", 0, 88))  # sent directly on the new connection
        await asyncio.sleep(0.05)
        w.put(encode([Write("b", epoch, OutEntry(0, [1], "z", "stop"))]))
        await w.flush()
        assert refused == [] and await r.hget(keys.owner("b"), "done") == b"1" and w.backlog == 0
        written = _written(await r.xrange(w.fencing.steps_key))
        assert {("a", 0), ("a", 1), ("x", 0), ("b", 0)} <= set(written)
        task.cancel()
        await r.aclose()

    asyncio.run(go())
