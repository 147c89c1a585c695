"""A worker's output writer against a real redis-server: steps encoded on the engine's side
go out as one entry each (coalesced when they wait), a fenced stream is found by a write or,
with nothing to write, by a probe, and either way the worker goes on in a new stream."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.fencing import entry_of, fence_stream, outputs_of
from pagefleet.common.redis import Keys, RedisServer, connect
from pagefleet.common.step_write import StepEncoder
from pagefleet.worker.redis_io import OutputWriter


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


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
