"""Fenced ownership in a real Redis: stale epochs cannot write, a finish is one atomic step."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.fencing import DONE_TTL_S, Fencing, Write
from pagefleet.common.redis import GROUP, Keys, OutEntry, RedisServer, connect, read_emitted


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def run(coro):
    return asyncio.run(coro)


async def _setup(url: str, ns: str):
    r = connect(url)
    keys = Keys(ns)
    await r.set(keys.scheduler_epoch, 7)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    return r, keys, Fencing(r, keys)


def test_only_the_current_epoch_writes(redis_url):
    async def go():
        r, keys, f = await _setup(redis_url, "t1")
        e1 = await f.assign("a", 7, "w1")
        e2 = await f.assign("a", 7, "w2")  # re-assigned: w1 is fenced off
        assert (e1, e2) == (1, 2)
        ok = await f.write([Write("a", e1, OutEntry(0, [5, 6])), Write("a", e2, OutEntry(0, [9]))])
        assert ok == [False, True]
        assert await f.owns("a", e2) and not await f.owns("a", e1)
        tokens, _ = await read_emitted(r, keys, "a")
        assert tokens == [9]
        await r.aclose()

    run(go())


def test_a_stale_scheduler_cannot_assign(redis_url):
    async def go():
        r, keys, f = await _setup(redis_url, "t2")
        assert await f.assign("a", 6, "w1") == -1  # epoch 6 was superseded by 7
        assert await f.assign("a", 7, "w1") == 1
        await r.aclose()

    run(go())


def test_finish_is_durable_and_atomic(redis_url):
    async def go():
        r, keys, f = await _setup(redis_url, "t3")
        entry_id = await r.xadd(keys.requests, {"kind": "generate", "rid": "a"})
        await r.xreadgroup(GROUP, "s", {keys.requests: ">"})
        await r.set(keys.idempotency("a"), 1, ex=3600)
        e = await f.assign("a", 7, "w1")
        assert await f.write([Write("a", e, OutEntry(0, [1, 2])),
                              Write("a", e, OutEntry(2, [3], finish_reason="length"), entry_id.decode())]) == [True, True]
        assert await r.xlen(keys.requests) == 0  # acknowledged and deleted in the same step
        done = await r.xrange(keys.done)
        assert [(d[b"rid"], d[b"epoch"], d[b"f"]) for _, d in done] == [(b"a", b"1", b"length")]
        assert 0 < await r.ttl(keys.out("a")) <= DONE_TTL_S
        assert 0 < await r.ttl(keys.idempotency("a")) <= DONE_TTL_S  # one lifetime for both
        # After the finish nobody writes again, not even the owner, and it is never re-assigned.
        assert await f.write([Write("a", e, OutEntry(3, [4]))]) == [False]
        assert await f.assign("a", 7, "w2") == 0
        tokens, finish = await read_emitted(r, keys, "a")
        assert (tokens, finish) == ([1, 2, 3], "length")
        await r.aclose()

    run(go())


def test_scripts_survive_a_flushed_script_cache(redis_url):
    async def go():
        r, keys, f = await _setup(redis_url, "t4")
        e = await f.assign("a", 7, "w1")
        await r.script_flush()
        assert await f.write([Write("a", e, OutEntry(0, [1]))]) == [True]
        await r.script_flush()
        assert await f.assign("b", 7, "w1") == 1
        await r.aclose()

    run(go())


def test_a_write_puts_its_accepted_messages_in_the_writers_steps_stream(redis_url):
    from pagefleet.protos import cluster_pb2

    async def go():
        r, keys, _ = await _setup(redis_url, "t14")
        f = Fencing(r, keys, "w1")
        ea = await f.assign("a", 7, "w1")
        eb = await f.assign("b", 7, "w1")
        await f.assign("b", 7, "w2")  # b moved: w1's message for it is refused
        ok = await f.write([Write("a", ea, OutEntry(0, [5, 6], "xy")), Write("b", eb, OutEntry(0, [9]))])
        assert ok == [True, False]
        entries = await r.xrange(keys.steps("w1"))
        assert len(entries) == 1  # one entry per write, whatever the number of requests
        outs = cluster_pb2.StepOutputs.FromString(entries[0][1][b"o"]).outputs
        assert [(o.request_id, o.index, list(o.token_ids), o.text) for o in outs] == [("a", 0, [5, 6], "xy")]
        # A write whose messages are all refused adds no entry.
        assert await f.write([Write("b", eb, OutEntry(1, [3]))]) == [False]
        assert await r.xlen(keys.steps("w1")) == 1
        await r.aclose()

    run(go())


def test_ttls_are_set_where_asked_not_by_every_write(redis_url):
    async def go():
        r, keys, _ = await _setup(redis_url, "t15")
        f = Fencing(r, keys, "w1")
        e = await f.assign("a", 7, "w1")
        await f.write([Write("a", e, OutEntry(0, [1]), refresh_ttl=True)])
        assert await r.ttl(keys.out("a")) > 0
        await r.persist(keys.out("a"))
        await f.write([Write("a", e, OutEntry(1, [2]), refresh_ttl=False)])
        assert await r.ttl(keys.out("a")) == -1  # untouched
        await f.write([Write("a", e, OutEntry(2, [3]), refresh_ttl=True)])
        assert await r.ttl(keys.out("a")) > 0
        await r.aclose()

    run(go())
