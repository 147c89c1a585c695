"""The gateway's relays against a real Redis: one read of the workers' steps streams feeds
every relay; a relay whose client does not read is bounded and goes on from Redis."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pagefleet.common.fencing import Fencing, Write
from pagefleet.common.redis import GROUP, Keys, OutEntry, RedisServer, connect
from pagefleet.gateway import relay as relay_mod
from pagefleet.gateway.relay import StepReader, relay_steps
from pagefleet.protos import generation_pb2 as pb


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


async def _cluster(url: str, ns: str):
    r = connect(url)
    keys = Keys(ns)
    await r.set(keys.scheduler_epoch, 1)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    return r, keys


async def _writer(r, keys, wid: str, registered: bool = True) -> Fencing:
    """A worker's writer, its stream published; ``registered``: in the workers hash (gateways see it)."""
    f = Fencing(r, keys, wid)
    await f.publish_stream()
    if registered:
        await r.hset(keys.workers, wid, json.dumps({"address": "", "steps": f.steps_key}))
    return f


async def _one_request(url: str, ns: str):
    """A steps reader, worker w1's writer and the relay of request "a", assigned to w1:
    ``(redis, keys, reader, writer, relay, epoch)``."""
    r, keys = await _cluster(url, ns)
    reader = StepReader(r, keys)
    f = await _writer(r, keys, "w1")
    rel = reader.open("a")
    await asyncio.sleep(0.05)
    return r, keys, reader, f, rel, await f.assign("a", 1, "w1")


async def _write_all(f: Fencing, rid: str, epoch: int, n: int, per_write: int = 1, delay_s: float = 0.0):
    i = 0
    while i < n:
        k = min(per_write, n - i)
        finish = "length" if i + k == n else ""
        await f.write([Write(rid, epoch, OutEntry(i, list(range(i, i + k)), "x" * k, finish))])
        i += k
        if delay_s:
            await asyncio.sleep(delay_s)


def _check_whole(msgs: list[pb.GenerateResponse], n: int) -> None:
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == list(range(n))
    index = 0
    for m in msgs:
        assert m.index == index
        index += len(m.token_ids)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == n


def test_one_read_feeds_the_relays_of_requests_on_several_workers(redis_url):
    async def go():
        r, keys = await _cluster(redis_url, "r1")
        reader = StepReader(r, keys)
        writers = {w: await _writer(r, keys, w) for w in ("w1", "w2")}
        relays = {rid: reader.open(rid) for rid in ("a", "b", "c")}
        await asyncio.sleep(0.05)
        epochs = {rid: await writers["w1"].assign(rid, 1, w) for rid, w in (("a", "w1"), ("b", "w2"), ("c", "w1"))}

        async def collect(rid):
            return [m async for m in relay_steps(r, keys, relays[rid], 3)]

        tasks = [asyncio.ensure_future(collect(rid)) for rid in relays]
        await asyncio.gather(_write_all(writers["w1"], "a", epochs["a"], 20),
                             _write_all(writers["w2"], "b", epochs["b"], 30, per_write=3),
                             _write_all(writers["w1"], "c", epochs["c"], 5))
        got = dict(zip(relays, await asyncio.wait_for(asyncio.gather(*tasks), 30), strict=True))
        _check_whole(got["a"], 20)
        _check_whole(got["b"], 30)
        _check_whole(got["c"], 5)
        before = reader.num_reads
        assert before < 60  # one read for many messages of many requests, not a read per message each
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


async def _until(done, timeout_s: float = 10.0) -> None:
    """Wait (polling) until ``done()``: the reader task catches up at its own pace on a loaded machine."""
    t0 = time.monotonic()
    while not done() and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.02)


def test_a_relay_whose_client_does_not_read_is_bounded_and_loses_nothing(redis_url, monkeypatch):
    monkeypatch.setattr(relay_mod, "MAX_BUFFERED", 8)

    async def go():
        r, keys, reader, f, rel, epoch = await _one_request(redis_url, "r2")
        await _write_all(f, "a", epoch, 100)  # the client reads nothing meanwhile
        await _until(lambda: rel.detached)
        assert rel.detached and rel.num_buffered == 0 and rel.num_tokens == 0  # the backlog stays in Redis
        msgs = [m async for m in relay_steps(r, keys, rel, 3)]
        _check_whole(msgs, 100)
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


def test_a_client_that_falls_behind_gets_coalesced_messages_and_stream_interval_holds_tokens(redis_url):
    async def go():
        r, keys = await _cluster(redis_url, "r3")
        reader = StepReader(r, keys)
        f = await _writer(r, keys, "w1")
        slow, spaced = reader.open("a"), reader.open("b")
        await asyncio.sleep(0.05)
        ea, eb = await f.assign("a", 1, "w1"), await f.assign("b", 1, "w1")
        await _write_all(f, "a", ea, 40)
        await asyncio.sleep(0.2)
        msgs = [m async for m in relay_steps(r, keys, slow, 3)]
        _check_whole(msgs, 40)
        assert len(msgs) < 40  # what waited came in one message
        writes = asyncio.ensure_future(_write_all(f, "b", eb, 10, delay_s=0.01))
        msgs = [m async for m in relay_steps(r, keys, spaced, 3, stream_interval=4)]
        await writes
        _check_whole(msgs, 10)
        assert all(len(m.token_ids) >= 4 for m in msgs[:-1])
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


def test_a_relay_that_missed_steps_reads_its_requests_own_stream(redis_url, monkeypatch):
    monkeypatch.setattr(relay_mod, "SILENCE_S", 0.3)

    async def go():
        r, keys = await _cluster(redis_url, "r4")
        reader = StepReader(r, keys)
        f = await _writer(r, keys, "w9", registered=False)  # the reader knows no such worker
        rel = reader.open("a")
        epoch = await f.assign("a", 1, "w9")
        await _write_all(f, "a", epoch, 12)
        msgs = await asyncio.wait_for(_collect(relay_steps(r, keys, rel, 3)), 10)
        _check_whole(msgs, 12)
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


async def _collect(gen):
    return [m async for m in gen]


def test_logprobs_reach_the_responses_cut_with_their_tokens(redis_url):
    from pagefleet.common.logprobs import TokenLogprobs

    def lp(i: int) -> TokenLogprobs:
        return TokenLogprobs(-0.5 * i, [i, i + 1], [-0.5 * i, -0.5 * i - 0.25])

    async def go():
        r, keys, reader, f, rel, e = await _one_request(redis_url, "r5")
        await f.write([Write("a", e, OutEntry(0, [10, 11], "ab", logprobs=[lp(10), lp(11)]))])
        await f.write([Write("a", e, OutEntry(1, [11, 12], "bc", logprobs=[lp(11), lp(12)]))])  # a repeat
        await f.write([Write("a", e, OutEntry(3, [], "", "stop"))])
        msgs = await asyncio.wait_for(_collect(relay_steps(r, keys, rel, 3)), 10)
        assert [t for m in msgs for t in m.token_ids] == [10, 11, 12]
        got = [(x.logprob, [t.token_id for t in x.top_logprobs]) for m in msgs for x in m.logprobs]
        assert got == [(lp(i).logprob, lp(i).top_token_ids) for i in (10, 11, 12)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


def test_a_step_relay_gathers_messages_in_order_and_a_detach_goes_back_to_what_was_taken(monkeypatch):
    from pagefleet.gateway.relay import StepRelay

    monkeypatch.setattr(relay_mod, "MAX_BUFFERED", 4)

    async def go():
        r = StepRelay("a", asyncio.get_running_loop())
        r.feed(OutEntry(0, [0, 1], "ab"))
        r.feed(OutEntry(3, [3], "d"))  # past a gap: held
        r.feed(OutEntry(1, [1], "b"))  # a repeat: dropped
        assert r.num_tokens == 2 and r.order.has_gap
        r.feed(OutEntry(2, [2], "c"))  # fills the gap
        msg = r.take()
        assert (msg.index, list(msg.token_ids), msg.text) == (0, [0, 1, 2, 3], "abcd")
        assert r.take() is None
        r.feed(OutEntry(4, [4], "e"))
        r.feed(OutEntry(5, [5], "f"))
        for i in range(6, 9):  # past the bound, not taken: detached
            r.feed(OutEntry(i, [i], "x"))
        assert r.detached and r.num_tokens == 0 and r.order.next_index == 4  # goes on after what was taken
        r.feed(OutEntry(9, [9], "y", "length"))
        assert r.take() is None and not r.finished

    asyncio.run(go())


def test_a_step_relay_holding_logprobs_is_bounded_by_them_too():
    """Top-20 logprobs make a token 21 protobuf entries: a relay whose client does not read
    detaches after ``MAX_BUFFERED_LOGPROBS`` of them, long before ``MAX_BUFFERED`` messages;
    one whose client takes each message never does."""
    from pagefleet.gateway.relay import MAX_BUFFERED, MAX_BUFFERED_LOGPROBS, StepRelay

    def lp(k):
        return [pb.TokenLogprobs(logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=t, logprob=-1.0)
                                                              for t in range(k)])]

    async def go():
        unread, read = StepRelay("a", asyncio.get_running_loop()), StepRelay("b", asyncio.get_running_loop())
        fed = 0
        while not unread.detached:
            unread.feed(OutEntry(fed, [fed], "x", logprobs=lp(20)))
            read.feed(OutEntry(fed, [fed], "x", logprobs=lp(20)))
            assert read.take() is not None
            fed += 1
        assert fed == MAX_BUFFERED_LOGPROBS // 21 + 1 < MAX_BUFFERED
        assert unread.num_tokens == 0 and unread.order.next_index == 0  # goes on from Redis, from the start
        assert not read.detached and read.num_logprobs == 0
        plain = StepRelay("c", asyncio.get_running_loop())
        for i in range(MAX_BUFFERED):  # no logprobs: only the message bound holds
            plain.feed(OutEntry(i, [i], "x"))
        assert not plain.detached

    asyncio.run(go())


def test_a_relay_detached_by_its_last_message_still_relays_every_token(redis_url):
    """The request's last message is the one that takes the logprobs its client has not read past
    the bound: the relay detaches then, and the finish is read again from Redis with the tokens
    before it (it was kept: the client got the finish and no token, a short stream said whole)."""
    from pagefleet.common.logprobs import TokenLogprobs
    from pagefleet.gateway.relay import MAX_BUFFERED_LOGPROBS

    async def go():
        r, keys, reader, f, rel, epoch = await _one_request(redis_url, "r10")
        n = MAX_BUFFERED_LOGPROBS // 21 + 1  # top-20: 21 a token; the n-th, the last, crosses the bound
        for i in range(n):
            lp = [TokenLogprobs(-0.5, list(range(20)), [-1.0] * 20)]
            await f.write([Write("a", epoch, OutEntry(i, [i], "x", "length" if i == n - 1 else "", logprobs=lp))])
        await _until(lambda: rel.detached)  # the client has read nothing yet
        assert rel.detached and not rel.finished
        msgs = await asyncio.wait_for(_collect(relay_steps(r, keys, rel, 3)), 10)
        _check_whole(msgs, n)
        assert "".join(m.text for m in msgs) == "x" * n
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


def test_a_steps_entry_the_reader_cannot_decode_is_skipped_and_what_follows_is_relayed(redis_url):
    async def go():
        r, keys, reader, f, relay, epoch = await _one_request(redis_url, "r9")
        collect = asyncio.ensure_future(_collect(relay_steps(r, keys, relay, 3)))
        await asyncio.sleep(0.1)
        await r.xadd(f.steps_key, {"o": b"\xff\xff\xff"})  # not a StepOutputs: logged and skipped
        await _write_all(f, "a", epoch, 6)
        _check_whole(await asyncio.wait_for(collect, 10), 6)
        await reader.stop()
        await r.aclose()

    asyncio.run(go())


def test_a_step_output_fed_out_of_order_is_placed_not_raised():
    """The reader feeds StepOutput protobufs: one that starts before what was relayed (the
    scheduler's final of a cancel or a deadline, at the index it knew) is cut as a message is.
    It raised (a protobuf has no ``cut``), and the reader read and raised again, stalling every
    relay of its gateway."""
    from pagefleet.gateway.relay import StepRelay
    from pagefleet.protos import cluster_pb2

    async def go():
        r = StepRelay("a", asyncio.get_running_loop())
        r.feed_row(0, [5, 6], "ab")
        assert r.take().token_ids == [5, 6]
        r.feed(cluster_pb2.StepOutput(request_id="a", index=1, token_ids=[6, 7], text="bc"))  # a repeat, then 7
        r.feed(cluster_pb2.StepOutput(request_id="a", index=0, finish_reason="error", error="deadline"))
        msg = r.take()
        assert (list(msg.token_ids), msg.finish_reason, msg.error) == ([7], pb.FINISH_REASON_ERROR, "deadline")

    asyncio.run(go())


def test_a_relay_from_redis_hears_a_final_the_scheduler_writes_at_once(redis_url):
    """A retry's relay (from Redis) blocks on its worker's stream; a final the scheduler writes
    (a Cancel, a deadline) goes to the scheduler's own stream, and the retry heard it only at its
    next look, ``BLOCK_MS`` (5 s) later, where the first caller's relay heard it at once."""
    async def go():
        r, keys = await _cluster(redis_url, "scheduler-final")
        worker = await _writer(r, keys, "w1")
        epoch = await worker.assign("a", 1, "w1")
        await worker.write([Write("a", epoch, OutEntry(0, [1, 2], "xx", ""))])
        got: list[tuple[float, pb.GenerateResponse]] = []

        async def read():
            async for msg in relay_mod.relay(r, keys, "a", 3):
                got.append((time.monotonic(), msg))

        task = asyncio.ensure_future(read())
        await _until(lambda: got)  # its tokens so far; then it waits on w1's stream
        await asyncio.sleep(0.3)
        scheduler = Fencing(r, keys)  # the scheduler's writer: its own stream
        ended = time.monotonic()
        fenced = await scheduler.assign("a", 1, "")
        assert (await scheduler.write([Write("a", fenced, OutEntry(2, [], "", "abort"))]))[0]
        await asyncio.wait_for(task, 10)
        assert [list(m.token_ids) for _, m in got] == [[1, 2], []] and got[-1][1].finish_reason == pb.FINISH_REASON_ABORT
        assert got[-1][0] - ended < 2.0, f"the final came {got[-1][0] - ended:.2f} s after it was written"
        await r.aclose()

    asyncio.run(go())
