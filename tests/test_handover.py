"""A request's ownership moving with its KV, in a real Redis (``MOVE_OWNER``): exactly once,
the source's writes refused afterwards, what it wrote recorded for every later reader."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.fencing import Fencing, Write, read_record, step_piece, take_over
from pagefleet.common.handover import move_owner, owner_of
from pagefleet.common.redis import GROUP, Keys, OutEntry, RedisServer, connect


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


async def _placed(url: str, ns: str, rid: str = "r"):
    """A request assigned to worker ``a`` (its epoch), with ``a`` and ``b`` publishing streams."""
    r = connect(url)
    keys = Keys(ns)
    await r.set(keys.scheduler_epoch, 7)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    a, b = Fencing(r, keys, "a"), Fencing(r, keys, "b")
    for f in (a, b):
        await f.publish_stream()
        await r.hset(keys.workers, f.writer_id, "{}")
    sched = Fencing(r, keys, stream_of={"a": a.steps_key, "b": b.steps_key}.get)
    epoch = await sched.assign(rid, 7, "a")
    return r, keys, a, b, epoch


def test_the_owner_moves_once_with_a_new_epoch_and_the_sources_finish_is_refused(redis_url):
    async def go():
        r, keys, a, b, epoch = await _placed(redis_url, "mv1")
        await a.write([Write("r", epoch, OutEntry(0, [5, 6], "ab"))])
        new = await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key, step_piece("r", OutEntry(0, [5, 6], "ab")))
        assert new > epoch
        assert await owner_of(r, keys, "r") == ("b", new)
        # Once: a second handover of the same (epoch, source) finds the record changed.
        assert await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key, b"") == 0
        assert await move_owner(r, keys, "r", epoch, "a", "a", a.steps_key, b"") == 0  # nor can a take it back
        # a's finish under its old epoch is refused; b's is taken.
        assert await a.write([Write("r", epoch, OutEntry(2, [], "", "length"))]) == [False]
        await b.write([Write("r", new, OutEntry(2, [7], "c"))])
        assert await b.write([Write("r", new, OutEntry(3, [], "", "length"), record=OutEntry(2, [7], "c", "length"))]) \
            == [True]
        tokens = [t for e in await read_record(r, keys, "r") for t in e.token_ids]
        assert tokens == [5, 6, 7], "the record holds a's tokens, then b's"

    asyncio.run(go())


def test_the_source_takes_back_first_and_the_targets_late_handover_is_refused(redis_url):
    async def go():
        r, keys, a, b, epoch = await _placed(redis_url, "mv2")
        await a.write([Write("r", epoch, OutEntry(0, [5], "a"))])
        back = await move_owner(r, keys, "r", epoch, "a", "a", a.steps_key, step_piece("r", OutEntry(0, [5], "a")))
        assert back > epoch and await owner_of(r, keys, "r") == ("a", back)
        assert await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key, b"") == 0
        # A resume reads every token: what a wrote before taking it back from the record, the rest
        # from its stream.
        await a.write([Write("r", back, OutEntry(1, [6], "b"))])
        tokens, finish = await take_over(r, keys, "r", fence=False)
        assert tokens == [5, 6] and finish == ""

    asyncio.run(go())


def test_a_finished_or_reassigned_request_does_not_move(redis_url):
    async def go():
        r, keys, a, b, epoch = await _placed(redis_url, "mv3")
        sched = Fencing(r, keys)
        newer = await sched.assign("r", 7, "")  # the scheduler fenced it (a cancel, a resume)
        assert await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key, b"") == 0
        await a.write([Write("r", newer, OutEntry(0, [], "", "abort"))])  # finished under the newer epoch
        assert await move_owner(r, keys, "r", newer, "a", "b", b.steps_key, b"") == 0

    asyncio.run(go())


def test_a_move_whose_reply_was_lost_answers_its_epoch_when_sent_again(redis_url):
    """The move landed and its reply was lost: the retry found the record naming the target, not
    the source, and answered 0 ("not moved"), so the target dropped the request Redis says it
    owns. The move is named in the record: the retry answers the epoch it took."""
    import redis.exceptions as rx

    async def go():
        r, keys, a, b, epoch = await _placed(redis_url, "lost-reply")
        send, lost = r.execute_command, []

        async def lossy(*args, **kw):
            reply = await send(*args, **kw)  # applied in Redis...
            if args[0] in ("EVALSHA", "EVAL") and not lost:
                lost.append(True)
                raise rx.ConnectionError("Connection reset by peer")  # ... its reply lost
            return reply

        r.execute_command = lossy
        new = await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key)
        r.execute_command = send
        owner = await owner_of(r, keys, "r")
        late = await move_owner(r, keys, "r", epoch, "a", "a", a.steps_key)  # the source's take-back: too late
        await r.aclose()
        return lost, new, owner, late

    lost, new, owner, late = asyncio.run(go())
    assert lost and new > 0 and owner == ("b", new) and late == 0


def test_a_moves_retry_after_a_fence_is_refused(redis_url):
    """The move landed, its reply was lost, and the scheduler fenced the request (a new epoch, the
    worker kept) before the retry: the retry is refused, not handed the fence's epoch (the
    target would have written under the scheduler's own)."""
    import redis.exceptions as rx

    async def go():
        r, keys, a, b, epoch = await _placed(redis_url, "fenced-between")
        send, lost = r.execute_command, []

        async def lossy(*args, **kw):
            reply = await send(*args, **kw)
            if args[0] in ("EVALSHA", "EVAL") and not lost:
                lost.append(True)
                sched = Fencing(r, keys, stream_of={"a": a.steps_key, "b": b.steps_key}.get)
                await sched.assign("r", 7, "")  # the scheduler's fence, between the move and its retry
                raise rx.ConnectionError("Connection reset by peer")
            return reply

        r.execute_command = lossy
        got = await move_owner(r, keys, "r", epoch, "a", "b", b.steps_key)
        r.execute_command = send
        await r.aclose()
        return lost, got

    lost, got = asyncio.run(go())
    assert lost and got == 0
