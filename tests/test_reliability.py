"""The reliability suite's short form (``pagefleet bench reliability --short``), one test per
scenario, real processes on loopback; and regression tests for what the suite found.

Every scenario row must show 0 lost, 0 duplicated, 0 missing and 0 differing tokens and meet
its own goals. The overload scenario's latency goals (p99 against the unloaded p99, refusals
within 10 ms) are speed, which is measured, not asserted: the short form asserts what is
certain (refusals carry RetryInfo, admitted requests are exact, nothing leaks); the full
form's figures are in docs/RELIABILITY.md (``pagefleet bench reliability``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import redis as sync_redis

from pagefleet.benchmarks.reliability import SCENARIOS
from pagefleet.benchmarks.reliability.cluster import Row, Settings
from pagefleet.common.model_config import load_model_spec
from pagefleet.common.redis import Keys, RedisServer, connect
from pagefleet.common.scripts import TAKE_EPOCH
from pagefleet.protos import generation_pb2 as pb

pytestmark = pytest.mark.timeout(600)


def _exact(row: Row) -> None:
    assert (row.lost, row.duplicated, row.missing, row.differing) == (0, 0, 0, 0), row
    assert row.completed == row.sent > 0, row


@pytest.mark.parametrize("name", ["worker-kill", "scheduler-kill", "gateway-kill", "redis-restart", "worker-freeze",
                                  "scheduler-partition"])
def test_faults_under_load_lose_duplicate_and_change_nothing(name, tmp_path):
    row = SCENARIOS[name](Settings(short=True, log_dir=tmp_path))
    _exact(row)
    assert all(row.goals.values()), row


def test_fuzz_only_refuses_and_then_serves(tmp_path):
    row = SCENARIOS["fuzz"](Settings(short=True, log_dir=tmp_path))
    _exact(row)
    assert all(row.goals.values()), row
    assert set(row.figures["answers"]) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "OK"}


def test_cancels_at_random_moments_leak_no_blocks(tmp_path):
    row = SCENARIOS["cancels"](Settings(short=True, log_dir=tmp_path))
    _exact(row)
    assert all(row.goals.values()), row
    assert row.figures["held at the end"] == "nothing"


def test_overload_refuses_with_retry_info_and_serves_the_admitted_exactly(tmp_path):
    row = SCENARIOS["overload"](Settings(short=True, log_dir=tmp_path))
    _exact(row)
    assert row.figures["refused"] > 0 and row.figures["admitted"] > 0, row
    for goal in ("every refusal carries RetryInfo", "nothing held at the end"):
        assert row.goals[goal], row
    assert "other errors" not in row.figures, row


def test_soak_keeps_memory_fds_and_redis_bounded(tmp_path):
    row = SCENARIOS["soak"](Settings(short=True, log_dir=tmp_path))
    _exact(row)
    assert all(row.goals.values()), (row.goals, {k: v for k, v in row.figures.items() if k.startswith(("fds", "memory"))})
    # every process was sampled, Redis's keys the load left all expire or are capped streams
    assert {"gateway", "scheduler", "worker-0", "redis-server"} <= set(row.figures["fds: max in the first half of the load -> once idle"])
    assert "keys with neither TTL nor cap" not in row.figures, row
    assert any(k.endswith(":done") for k in row.figures["streams kept by design (length, bound, bytes)"]), row


def test_soak_flatness_finds_growth():
    from pagefleet.benchmarks.reliability.soak import flatness

    def samples(mib, fds):
        return [{"t": float(i), "procs": {"p": (m, f)}} for i, (m, f) in enumerate(zip(mib, fds, strict=True))]

    flat = flatness(samples([100.0] * 10, [20] * 10), warm_until=2)
    assert flat == ({"p": (100.0, 100.0, 0.0)}, {"p": (20, 20)})
    memory, fds = flatness(samples([100.0 + 10 * i for i in range(10)], [20 + i for i in range(10)]), warm_until=2)
    assert memory["p"][2] > 0.3 and fds["p"][1] > fds["p"][0]
    assert flatness(samples([1.0] * 3, [1] * 3), warm_until=0) == ({}, {})  # too few samples: nothing judged


def test_a_bad_sim_time_scale_is_refused_by_name(capsys):
    from pagefleet.benchmarks.reliability import main

    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit) as e:
            main(["--scenario", "overload", "--sim-time-scale", bad])
        assert e.value.code == 2 and "--sim-time-scale must be positive" in capsys.readouterr().err
    for flag, bad, message in (("--soak-load", "1.5", "--soak-load must be a fraction"),
                               ("--soak-seconds", "-3", "--soak-seconds must be"),
                               ("--soak-idle", "nan", "--soak-idle must be")):
        with pytest.raises(SystemExit) as e:
            main(["--scenario", "soak", flag, bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


# -- regressions the suite found ---------------------------------------------------------------
@pytest.fixture
def redis_server():
    with RedisServer() as r:
        yield r


def _gateway(redis, max_stream_len: int = 10):
    from pagefleet.gateway.core import GatewayCore

    args = Namespace(max_model_len=None, max_queue=1024, max_stream_len=max_stream_len, block_size=16,
                     retry_after=1.0)
    return GatewayCore(redis, Keys("t"), load_model_spec("tiny"), args)


def _request(rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=pb.TokenIds(ids=list(range(3, 200))))


async def _scheduler_on(r, namespace: str, **config):
    """``(keys, scheduler)``: a scheduler of epoch 7 for namespace ``namespace`` on ``r``, with
    its consumer group made (not run: a test drives its parts)."""
    from pagefleet.common.redis import GROUP
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig

    keys = Keys(namespace)
    await r.set(keys.scheduler_epoch, 7)
    await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
    return keys, ClusterScheduler(r, keys, SchedulerConfig(**config), epoch=7)


def test_admission_is_exact_under_concurrency_and_never_trims(redis_server):
    """40 concurrent enqueues against a bound of 10 (two gateways racing, half with client
    ids): exactly 10 are queued and 30 refused, none trimmed. The bound was checked before
    the add, so concurrent calls went past it; and ``XADD MAXLEN ~`` had dropped whole stream
    nodes of requests nobody had read yet (the overload scenario lost two admitted requests
    so): entries leave only when their requests finish. A retry of a queued id is relayed
    even when the queue is full."""
    from pagefleet.gateway.core import Shed

    async def go():
        r = connect(redis_server.url)
        cores = [_gateway(r, max_stream_len=10), _gateway(r, max_stream_len=10)]

        async def one(i):
            # Each gateway gets both kinds, a client id first: its admissions of one event-loop
            # turn go to Redis in order, and either gateway's may all land before the other's.
            client_id = i % 4 < 2
            req = _request(f"id-{i}" if client_id else f"gw-{i}")
            try:
                q = await cores[i % 2]._enqueue_one(req, list(req.prompt_token_ids.ids), "", client_id=client_id)
                return q.request_id
            except Shed:
                return None

        got = await asyncio.gather(*(one(i) for i in range(40)))
        queued = [rid for rid in got if rid]
        n = await r.xlen(cores[0].keys.requests)
        again = next(q for q in queued if q.startswith("id-"))
        retry = _request(again)  # the same request again (another under its id is refused: IdInUse)
        retried = (await cores[1]._enqueue_one(retry, list(retry.prompt_token_ids.ids), "", client_id=True)).fresh
        await r.aclose()
        return len(queued), n, retried

    num_queued, n, retried = asyncio.run(go())
    assert (num_queued, n) == (10, 10)
    assert retried is False


def test_a_first_callers_cancel_waits_for_a_retry_sent_right_after(redis_server):
    """A client gave up on a stalled stream of its own id and retried it at once through the
    other gateway; the first gateway's cancel (sent as its caller left) reached Redis before the
    retry's admission (both had waited for a frozen Redis), found no retry counted, and ended the
    request: the retry relayed an abort. The first caller's cancel now looks the claim up
    ``RETRY_GRACE_S`` later; a retry sent within it is counted first."""
    from pagefleet.gateway import core as gateway_core

    async def go():
        r = connect(redis_server.url)
        first, other = _gateway(r), _gateway(r)
        req = _request("mine-1")
        q = await first._enqueue_one(req, list(req.prompt_token_ids.ids), "", client_id=True)
        first.leave(q)  # its caller gave up ...
        await asyncio.sleep(0.05)
        retry = await other._enqueue_one(req, list(req.prompt_token_ids.ids), "", client_id=True)  # ... and retried
        await asyncio.sleep(gateway_core.RETRY_GRACE_S + 0.5)
        kinds = [f[b"kind"] for _, f in await r.xrange(first.keys.requests)]
        lone = _request("mine-2")  # no retry: cancelled after the grace
        q2 = await first._enqueue_one(lone, list(lone.prompt_token_ids.ids), "", client_id=True)
        first.leave(q2)
        await asyncio.sleep(gateway_core.RETRY_GRACE_S + 0.5)
        cancels = [f[b"rid"] for _, f in await r.xrange(first.keys.requests) if f[b"kind"] == b"cancel"]
        await first.stop()
        await other.stop()
        await r.aclose()
        return q.fresh, retry.fresh, kinds, cancels

    assert asyncio.run(go()) == (True, False, [b"generate"], [b"mine-2"])


@pytest.mark.parametrize("busy", [True, False])
def test_a_first_callers_cancel_waits_for_a_retry_behind_a_frozen_redis(redis_server, busy):
    """The same, Redis frozen meanwhile (SIGSTOP): the other gateway's connections all wait, so
    its retry goes out on a new one whose handshake waits for Redis too, after the first
    gateway's claim lookup. The grace counts from a prompt answer now: a lookup Redis answered
    late is made again one grace later. ``busy``: another call of the other gateway waits too."""
    import os
    import signal

    from pagefleet.gateway import core as gateway_core

    async def go():
        r1, r2 = connect(redis_server.url), connect(redis_server.url)
        first, other = _gateway(r1), _gateway(r2)
        await r2.ping()
        req = _request("mine-1")
        q = await first._enqueue_one(req, list(req.prompt_token_ids.ids), "", client_id=True)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            holder = asyncio.create_task(r2.get("anything")) if busy else None
            await asyncio.sleep(0.05)
            first.leave(q)  # its caller gave up on the stalled stream ...
            await asyncio.sleep(0.05)
            retry = asyncio.create_task(other._enqueue_one(req, list(req.prompt_token_ids.ids), "", client_id=True))
            await asyncio.sleep(gateway_core.RETRY_GRACE_S + 1.0)  # ... the grace ends while Redis is frozen
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        retried = await retry
        if holder is not None:
            await holder
        await asyncio.sleep(gateway_core.RETRY_GRACE_S + 0.5)
        kinds = [f[b"kind"] for _, f in await r1.xrange(first.keys.requests)]
        await first.stop()
        await other.stop()
        await r1.aclose()
        await r2.aclose()
        return retried.fresh, kinds

    assert asyncio.run(go()) == (False, [b"generate"])


def test_a_client_id_is_claimed_only_with_its_entry(redis_server):
    """Claim and entry are one atomic step: Redis gone after the gateway's first command left a
    claim without an entry (every retry of that id then waited for output that never came).
    A retry after a lost reply finds the request queued, once."""
    import redis.exceptions as rx

    async def go():
        r = connect(redis_server.url)
        core = _gateway(r)
        keys = core.keys
        mux = core._admit_and_queue.mux  # the admissions' own connection (a standalone Redis)
        real, sent = mux._send, []

        async def first_then_away(commands):
            sent.extend(commands)  # the first: the script, refused (not loaded yet); then Redis is gone
            if len(sent) > 1:
                raise rx.ConnectionError("Redis went away")
            return await real(commands)

        mux._send = first_then_away
        with pytest.raises(rx.ConnectionError):
            await core._enqueue_one(_request("a"), [5, 6], "", client_id=True)
        mux._send = real
        assert sent[0][0] == "EVALSHA" and len(sent) > 1
        state = (await r.exists(keys.idempotency("a")), await r.exists(keys.requests))
        first = await core._enqueue_one(_request("b"), [5, 6], "", client_id=True)
        again = await core._enqueue_one(_request("b"), [5, 6], "", client_id=True)
        n = await r.xlen(keys.requests)
        await r.aclose()
        return state, first.fresh, again.fresh, n

    (claimed, queued), first, again, n = asyncio.run(go())
    assert claimed == queued  # both or neither
    assert (first, again, n) == (True, False, 1)


def test_an_id_the_gateway_chose_whose_queueing_reply_was_lost_is_still_this_calls(redis_server):
    """Every id is claimed now, the gateway's own too: the retry of a queueing script whose reply
    was lost found the call's own claim and answered "queued before", and the call took its own
    request for another's (relayed from its stream, never cancelled: it ran to max_tokens for no
    one when its caller left). It is this call's, fresh: relayed from the steps, cancelled on
    leaving. A client sending that id is refused, naming why."""
    import redis.exceptions as rx

    from pagefleet.gateway.core import IdInUse

    async def go():
        r = connect(redis_server.url)
        core = _gateway(r)
        keys = core.keys
        await core.enqueue([(_request("warm"), list(range(3, 200)))], "", client_ids=False)  # the script loaded
        mux = core._admit_and_queue.mux
        real, lost = mux._send, []

        async def lose_first_reply(commands):
            reply = await real(commands)  # the script ran in Redis
            if not lost:
                lost.append(1)
                raise rx.ConnectionError("Connection closed by server.")
            return reply

        mux._send = lose_first_reply
        q = await core._enqueue_one(_request("gw-1"), list(range(3, 200)), "", client_id=False)
        mux._send = real
        relayed_from_steps = "gw-1" in core.reader.relays
        queued = await r.xlen(keys.requests)
        core.leave(q)  # the caller hangs up
        for _ in range(50):
            if await r.xlen(keys.requests) > queued:
                break
            await asyncio.sleep(0.1)
        cancels = [f for _, f in await r.xrange(keys.requests) if f.get(b"kind") == b"cancel"]
        try:
            await core.enqueue([(_request("gw-1"), list(range(3, 200)))], "", client_ids=True)
            refused = ""
        except IdInUse as e:
            refused = str(e)
        await r.aclose()
        return q.fresh, relayed_from_steps, len(cancels), refused

    fresh, relayed_from_steps, cancels, refused = asyncio.run(go())
    assert (fresh, relayed_from_steps, cancels) == (True, True, 1)
    assert "the gateway chose" in refused


def test_a_caller_gone_while_its_request_was_being_queued_cancels_it(redis_server):
    """The caller is cancelled (its client went away) after the queueing script ran but before its
    reply came: the request is queued, and nothing would relay or cancel it (it ran to max_tokens
    for no one). A cancel entry follows it."""

    async def go():
        r = connect(redis_server.url)
        core = _gateway(r)
        mux = core._admit_and_queue.mux
        real = mux._send

        async def slow_reply(commands):
            reply = await real(commands)  # the script ran in Redis
            await asyncio.sleep(1.0)  # its reply is late
            return reply

        await core.enqueue([(_request("warm"), list(range(3, 200)))], "", client_ids=False)  # the script loaded
        mux._send = slow_reply
        call = asyncio.ensure_future(core.enqueue([(_request("gone"), list(range(3, 200)))], "", client_ids=False))
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        mux._send = real
        for _ in range(100):
            entries = [(f[b"kind"], f[b"rid"]) for _, f in await r.xrange(core.keys.requests)]
            if (b"cancel", b"gone") in entries:
                break
            await asyncio.sleep(0.05)
        await r.aclose()
        return entries

    assert asyncio.run(go()) == [(b"generate", b"warm"), (b"generate", b"gone"), (b"cancel", b"gone")]


def test_a_cancel_whose_finish_reply_was_lost_still_tells_the_worker(redis_server):
    """The scheduler's final write of a cancel landed in Redis and its reply was lost: the retry
    found the request done, and the cancel ended there, never sent to the worker (which ran it to
    max_tokens holding its blocks). The worker is told either way."""
    import redis.exceptions as rx

    from pagefleet.common.redis import GROUP
    from pagefleet.protos import cluster_pb2
    from pagefleet.scheduler.core import ClusterScheduler, SchedulerConfig
    from pagefleet.scheduler.workers import WorkerEntry

    async def go(lose_reply: bool):
        r = connect(redis_server.url)
        keys = Keys(f"lost{int(lose_reply)}")
        await r.set(keys.scheduler_epoch, 7)
        await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
        s = ClusterScheduler(r, keys, SchedulerConfig(), epoch=7)
        entry = await r.xadd(keys.requests, {"kind": "generate", "rid": "req-1"})
        await r.xreadgroup(GROUP, "scheduler", {keys.requests: ">"})
        msg = cluster_pb2.AssignRequest(request_id="req-1", prompt_token_ids=[1, 2, 3])
        msg.sampling.max_tokens = 100
        p = s.ledger.take("req-1", entry.decode(), msg)  # placed on w1, as a round places it
        w = WorkerEntry("w1", "127.0.0.1:1")
        s.ledger.add_worker(w)
        s.ledger.queue.remove("req-1")
        w.place(p, 64, now=0.0)
        s.ledger.where["req-1"] = "w1"
        await s.fencing.assign("req-1", 7, "w1")
        told = []
        s._tell_cancel_soon = lambda w, rid: told.append((w.worker_id, rid))
        if lose_reply:
            send, lost = s.fencing._send, []

            async def lossy(commands):
                replies = await send(commands)  # applied in Redis...
                if commands[-1][0] == "EVALSHA" and not lost:
                    lost.append(True)
                    raise rx.ConnectionError("Connection closed by server.")  # ... its reply lost
                return replies

            s.fencing._send = lossy
        await s._cancel("req-1")
        done = await r.hget(keys.owner("req-1"), "done")
        await s.close()
        await r.aclose()
        return done, told

    for lose_reply in (False, True):
        assert asyncio.run(go(lose_reply)) == (b"1", [("w1", "req-1")]), lose_reply


def test_a_request_cancelled_before_its_entry_was_read_leaves_no_entry(redis_server):
    """A cancel read before its request's entry (two gateways: the caller's Cancel went through
    the other one first) finishes the request with no entry to acknowledge; its entry, read
    after, is taken in and waits in the queue. A second finish of it there (another cancel, its
    deadline, a refusal) found it finished (fence 0) and forgot it without acknowledging its
    entry, which then stayed in the requests stream for ever."""
    from pagefleet.common.redis import GROUP
    from pagefleet.protos import cluster_pb2

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "early")
        await s._cancel("req-1")  # its cancel entry, read first
        msg = cluster_pb2.AssignRequest(request_id="req-1", prompt_token_ids=[1, 2, 3])
        msg.sampling.max_tokens = 100
        entry = await r.xadd(keys.requests, {"kind": "generate", "rid": "req-1", "payload": msg.SerializeToString()})
        ((_, ((entry_id, fields),)),) = await r.xreadgroup(GROUP, "scheduler", {keys.requests: ">"})
        assert entry_id == entry
        await s._on_entry(entry_id, fields, None)
        assert "req-1" in s.ledger.known  # queued: its assignment would find it finished
        await s._cancel("req-1")  # a second cancel (or its deadline) before it is placed
        left = await r.xlen(keys.requests)
        known = "req-1" in s.ledger.known
        await s.close()
        await r.aclose()
        return left, known

    assert asyncio.run(go()) == (0, False)


def test_an_entry_taken_in_while_its_cancels_final_is_written_is_acknowledged(redis_server):
    """The same race in another order (the `cancels` row left `generate:cancels-63` in the
    stream so in CI: its cancel finished it 3 ms after its entry was queued): the cancel's final
    write goes out with no entry (none was known), the intake takes the entry in while that
    write is on its way, and the finish then forgot the request, its entry unacknowledged."""
    from pagefleet.common.redis import GROUP
    from pagefleet.protos import cluster_pb2

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "during")
        msg = cluster_pb2.AssignRequest(request_id="req-1", prompt_token_ids=[1, 2, 3])
        msg.sampling.max_tokens = 100
        real_write = s.fencing.write

        async def write(writes, live=None):
            out = await real_write(writes, live)
            # The intake task runs while the round trip is in flight: the entry is taken in.
            await r.xadd(keys.requests, {"kind": "generate", "rid": "req-1", "payload": msg.SerializeToString()})
            ((_, ((entry_id, fields),)),) = await r.xreadgroup(GROUP, "scheduler", {keys.requests: ">"})
            await s._on_entry(entry_id, fields, None)
            return out

        s.fencing.write = write
        await s._cancel("req-1")  # its cancel entry, read first
        left = await r.xlen(keys.requests)
        pending = (await r.xpending(keys.requests, GROUP))["pending"]
        known = "req-1" in s.ledger.known
        await s.close()
        await r.aclose()
        return left, pending, known

    assert asyncio.run(go()) == (0, 0, False)


def test_the_requests_of_a_gone_gateway_process_are_cancelled_unless_a_client_named_them(redis_server, monkeypatch):
    """A gateway process killed with -9 left every request it had queued under an id of its
    own choosing running to the end for no one: only it relayed them, and no client knew to
    retry or cancel them. Each gateway process keeps a liveness key while it reads; once a key
    the scheduler has seen stays missing, the requests of gateway-chosen ids it relayed are
    cancelled. A client's own id is left (its retry may come through another process), and a
    process whose key was never seen (an older gateway, one just started) is never judged, and
    one whose key was missing a moment is not gone."""
    import pagefleet.scheduler.core as core
    from pagefleet.common.redis import GROUP
    from pagefleet.protos import cluster_pb2

    monkeypatch.setattr(core, "GATEWAY_CHECK_S", 0.05)
    monkeypatch.setattr(core, "GATEWAY_GONE_S", 0.3)

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "gw")
        for rid, gateway, chosen in (("mine-1", "a", True), ("mine-2", "a", True), ("client-1", "a", False),
                                     ("other-1", "b", True), ("unseen-1", "c", True)):
            msg = cluster_pb2.AssignRequest(request_id=rid, prompt_token_ids=[1, 2, 3], reply_to=gateway,
                                            gateway_chosen_id=chosen)
            msg.sampling.max_tokens = 100
            entry = await r.xadd(keys.requests, {"kind": "generate", "rid": rid})
            s.ledger.take(rid, entry.decode(), msg)
        await r.xreadgroup(GROUP, "scheduler", {keys.requests: ">"})
        await r.set(keys.gateway("a"), 1, ex=10)
        await r.set(keys.gateway("b"), 1, ex=10)
        task = asyncio.create_task(s._gone_gateways())
        await asyncio.sleep(0.3)  # every key looked up: a and b seen alive, c never
        await r.delete(keys.gateway("a"))  # process a is gone
        await r.delete(keys.gateway("b"))  # b's key lost a moment (a Redis restarted past its TTL) ...
        await asyncio.sleep(0.15)
        await r.set(keys.gateway("b"), 1, ex=10)  # ... and set again by the live process
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "mine-1" not in s.ledger.known and "mine-2" not in s.ledger.known:
                break
        await asyncio.sleep(0.5)  # c's requests had every chance to be judged too
        task.cancel()
        done = {rid: await r.hget(keys.owner(rid), "done") for rid in ("mine-1", "mine-2", "client-1", "other-1",
                                                                       "unseen-1")}
        left = set(s.ledger.known)
        n = await r.xlen(keys.requests)
        await s.close()
        await r.aclose()
        return done, left, n

    done, left, n = asyncio.run(go())
    assert done == {"mine-1": b"1", "mine-2": b"1", "client-1": None, "other-1": None, "unseen-1": None}
    assert left == {"client-1", "other-1", "unseen-1"}
    assert n == 3  # the cancelled ones' entries acknowledged with their finals


def test_a_live_gateway_whose_steps_read_hangs_keeps_its_requests(redis_server, monkeypatch):
    """The liveness key was renewed behind the gateway's blocking read of the steps: a read
    that hangs (a half-open connection, until its 30 s watchdog) let it expire, and the
    scheduler cancelled every request of gateway-chosen ids of a live process. It is kept by a
    task of its own now. (Times scaled down: the key's TTL 1 s, gone after 1 s, a read hung 3 s.)"""
    import pagefleet.gateway.relay as relay
    import pagefleet.scheduler.core as core
    from pagefleet.common.redis import GROUP
    from pagefleet.gateway.relay import StepReader
    from pagefleet.protos import cluster_pb2

    monkeypatch.setattr(relay, "GATEWAY_TTL_S", 1)
    monkeypatch.setattr(relay, "REFRESH_S", 0.1)
    monkeypatch.setattr(core, "GATEWAY_GONE_S", 1.0)
    monkeypatch.setattr(core, "GATEWAY_CHECK_S", 0.1)

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "hung")
        reader = StepReader(r, keys)
        real_read, calls = reader._read, [0]

        async def read(cursors, count, block_ms):
            calls[0] += 1
            if calls[0] == 5:  # one read hangs
                await asyncio.sleep(3.0)
                raise ConnectionError("no reply from Redis for 3 s")
            return await real_read(cursors, count, min(block_ms, 100))

        reader._read = read
        reader.start()
        msg = cluster_pb2.AssignRequest(request_id="g-1", prompt_token_ids=[1, 2, 3], reply_to=reader.reply_to,
                                        gateway_chosen_id=True)
        msg.sampling.max_tokens = 100
        entry = await r.xadd(keys.requests, {"kind": "generate", "rid": "g-1"})
        await r.xreadgroup(GROUP, "scheduler", {keys.requests: ">"})
        s.ledger.take("g-1", entry.decode(), msg)
        task = asyncio.create_task(s._gone_gateways())
        await asyncio.sleep(5.0)
        task.cancel()
        done = await r.hget(keys.owner("g-1"), "done")
        alive = await r.exists(keys.gateway(reader.reply_to))
        reader._read = real_read
        await reader.stop()
        await s.close()
        await r.aclose()
        return done, alive, calls[0]

    done, alive, reads = asyncio.run(go())
    assert reads > 5  # the hung read ended, and reading went on
    assert alive and done is None, "a live gateway's request of a gateway-chosen id was cancelled"


def test_a_scheduler_that_stalled_does_not_count_its_stall_as_its_workers_silence(redis_server):
    """A scheduler frozen (or starved of CPU) past --dead-after, though within its lease,
    declared every worker dead on waking, before reading the reports that had waited for it,
    and fenced and recomputed every request in flight. A late tick now judges no worker's
    silence for a moment, so the reports that waited are read first."""
    import time as clock

    from pagefleet.scheduler.workers import WorkerEntry

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "stall", dead_after_s=0.5)
        w = WorkerEntry("w1", "127.0.0.1:1")
        s.ledger.add_worker(w)
        w.last_report_at = clock.monotonic()
        tick = asyncio.create_task(s._tick())
        await asyncio.sleep(0.1)
        clock.sleep(1.0)  # the whole process stalls; the worker's reports wait in the socket
        await asyncio.sleep(0.02)  # the tick runs first ...
        w.last_report_at = clock.monotonic()  # ... then the report that waited is read
        await asyncio.sleep(0.2)
        alive = w.alive
        await asyncio.sleep(0.7)  # and a worker that goes silent for real is still found
        dead = not w.alive
        tick.cancel()
        await s.close()
        await r.aclose()
        return alive, dead

    assert asyncio.run(go()) == (True, True)


def test_a_scheduler_slow_all_the_time_still_finds_a_silent_worker(redis_server):
    """The first form of the stall fix shifted every worker's last report by each late tick's
    lateness: a scheduler whose loop was busy 0.7 s at a time, over and over, found a worker
    silent for good only after ~dead_after / 0.05 ticks (14 s at --dead-after 1). Silence is
    never shifted now; a stall defers the judging once."""
    import time as clock

    from pagefleet.scheduler.workers import WorkerEntry

    async def go():
        r = connect(redis_server.url)
        keys, s = await _scheduler_on(r, "slow", dead_after_s=1.0)
        w = WorkerEntry("w1", "127.0.0.1:1")
        s.ledger.add_worker(w)
        w.last_report_at = silent_since = clock.monotonic()  # it never reports again
        tick = asyncio.create_task(s._tick())
        while w.alive and clock.monotonic() - silent_since < 20:
            clock.sleep(0.7)  # the loop busy, again and again
            await asyncio.sleep(0.02)
        found = clock.monotonic() - silent_since
        tick.cancel()
        await s.close()
        await r.aclose()
        return w.alive, found

    alive, found = asyncio.run(go())
    assert not alive and found < 4.0, found


def test_a_gateway_killed_leaves_no_request_of_its_own_ids_running(tmp_path):
    """A gateway killed with -9 (real processes, simulated workers stepping slowly): the
    requests it queued under ids of its own choosing are cancelled once its liveness key has
    expired and stayed missing, and the worker frees them; a request a client named is kept
    (a retry of its id may come through another gateway)."""
    import signal

    from pagefleet.benchmarks.reliability.cluster import ReliabilityCluster, wait_for
    from pagefleet.client import Client

    slow = ["--engine", "sim", "--time-scale", "0.05"]  # an H100's step, 20 times slower: minutes a request
    with ReliabilityCluster(Settings(short=True, log_dir=tmp_path), "gateway-gone", num_workers=1, standby=False,
                            worker_args=slow) as c:
        client = Client(c.gateway_targets[0])
        params = dict(max_tokens=1000, ignore_eos=True)
        streams = [client.generate_stream([5, 6, 7, 8], **params) for _ in range(3)]
        streams.append(client.generate_stream([5, 6, 7, 8], request_id="client-named", **params))
        for s in streams:
            next(s)  # each is running
        def held(n):
            ids = {r for rep in c.reports().values() for r in rep.request_ids}
            return ids if len(ids) == n else None

        running = wait_for(lambda: held(4), 30, "4 requests on the worker")
        c.c.kill(c.c.gateway_name(0), signal.SIGKILL)
        client.close()
        killed = time.monotonic()
        left = wait_for(lambda: held(1), 90, "the gone gateway's requests cancelled")
        took = time.monotonic() - killed
        print(f"cancelled {took:.1f} s after the kill")
        done = sync_redis.Redis(port=c.redis.port)

        def finished_all():  # the worker lets a request go before the scheduler's final write lands
            got = {rid: done.hget(c.keys.owner(rid), "done") for rid in running}
            return got if all(v == b"1" for rid, v in got.items() if rid != "client-named") else None

        finished = wait_for(finished_all, 15, "the cancelled requests' finals written")
        done.close()
    assert left == {"client-named"}
    assert finished == {rid: (None if rid == "client-named" else b"1") for rid in running}
    assert took < 60, took  # its key's TTL, then GATEWAY_GONE_S missing


def test_a_claim_is_one_set_nx_written_only_with_its_entry(redis_server):
    """``ADMIT_AND_QUEUE`` claims a client id with one ``SET NX`` once the bound is met: a full
    queue writes nothing (yet a request queued before is found), and an entry that cannot be
    added leaves no claim."""
    import redis.exceptions as rx

    from pagefleet.common.scripts import ADMIT_AND_QUEUE

    r = sync_redis.Redis.from_url(redis_server.url)
    try:
        keys = Keys("claim1")
        admit = r.register_script(ADMIT_AND_QUEUE)

        def call(rid, *fields, max_len=2, fp="fp1"):
            return admit(keys=[keys.requests, keys.num_waiting, keys.idempotency(rid)],
                         args=[max_len, 100, 3600, fp, *fields])

        r.config_resetstat()
        assert call("a", "rid", "a")[0] == 1
        stats = r.info("commandstats")
        assert "cmdstat_exists" not in stats and stats["cmdstat_get"]["calls"] == 1 and stats["cmdstat_set"]["calls"] == 1
        assert r.get(keys.idempotency("a")) == b"fp1"  # the request's fingerprint
        assert call("a", "rid", "a") == [0] and r.xlen(keys.requests) == 1  # a retry: queued before
        assert r.get(keys.idempotency("a")) == b"fp1+"  # counted: its first caller's cancel waits for it
        assert call("a", "rid", "a", fp="fp2") == [-2]  # the id of another request: refused, nothing written
        assert r.get(keys.idempotency("a")) == b"fp1+" and r.xlen(keys.requests) == 1
        assert call("b", "rid", "b")[0] == 1
        assert call("c", "rid", "c") == [-1, 2, 2] and not r.exists(keys.idempotency("c"))  # full
        assert call("a", "rid", "a") == [0]  # queued before, relayed even when full
        assert call("a", "rid", "a", fp="fp2") == [-2]  # and another request's refused even then
        for _ in range(20):
            call("a", "rid", "a")
        assert r.get(keys.idempotency("a")) == b"fp1" + b"+" * 8  # the count is bounded
        r.set(keys.idempotency("old"), 1)  # a claim of a gateway from before fingerprints: a count
        assert call("old", "rid", "old") == [0] and r.get(keys.idempotency("old")) == b"2"
        with pytest.raises(rx.ResponseError):
            call("d", "odd", max_len=10)  # the XADD fails: no claim stays without its entry
        assert not r.exists(keys.idempotency("d")) and r.xlen(keys.requests) == 2
    finally:
        r.close()


def test_a_lease_taken_after_retries_is_valid_from_the_attempt_that_took_it():
    """A standby that took the lease after retrying through a Redis outage timed its lease from
    before the outage, found it expired at once and exited (no scheduler at all)."""
    import redis.exceptions as rx

    from pagefleet.scheduler.server import Lease

    class Flaky:
        def __init__(self):
            self.calls = 0

        async def set(self, *a, **kw):
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.4)  # longer than 2/3 of the 0.3 s lease
                raise rx.ConnectionError("Redis away")
            return True

        async def incr(self, key):
            return 7

        async def eval(self, script, *a):
            return 7 if script == TAKE_EPOCH else 1

    async def go():
        lease = Lease(Flaky(), Keys("t"), "me", lease_ms=300)
        acquired = asyncio.Event()
        task = asyncio.create_task(lease.hold(acquired))
        await asyncio.wait_for(acquired.wait(), 5)
        valid = lease.valid()
        task.cancel()
        return valid, lease.epoch

    assert asyncio.run(go()) == (True, 7)


def _lease_with_renewals(renew):
    """A ``Lease`` of 1.2 s (renewed every 0.2 s) over a fake Redis whose renewals ``renew(elapsed_s)`` answers
    (a result, or an exception raised after a wait); returns (valid over time, whether
    ``hold`` returned, when)."""
    from pagefleet.scheduler.server import Lease

    class Fake:
        async def set(self, *a, **kw):
            return True

        async def eval(self, script, *a):
            if script == TAKE_EPOCH:
                return 1
            return await renew(time.monotonic() - t0)

    async def go():
        nonlocal t0
        t0 = time.monotonic()  # from the loop's start (starting one may take a while on a loaded machine)
        lease = Lease(Fake(), Keys("t"), "me", lease_ms=1200)
        acquired = asyncio.Event()
        task = asyncio.create_task(lease.hold(acquired))
        await acquired.wait()
        seen = []
        while time.monotonic() - t0 < 2.4 and not task.done():
            seen.append((time.monotonic() - t0, lease.valid()))
            await asyncio.sleep(0.02)
        done = task.done()
        task.cancel()
        return seen, done

    t0 = time.monotonic()
    return asyncio.run(go())


def test_a_lease_not_renewed_for_a_while_pauses_placing_and_a_renewal_resumes_it():
    """A stall (renewals time out for longer than 2/3 of the lease, less than all of it) makes
    the lease unsure, then valid again once a renewal gets through: the scheduler goes on."""
    async def renew(elapsed):
        if 0.3 < elapsed < 1.1:
            await asyncio.sleep(1.0)  # longer than the renewal's timeout
        return 1

    seen, done = _lease_with_renewals(renew)
    assert not done
    assert any(not valid for _, valid in seen), "never unsure"
    assert all(valid for t, valid in seen if t > 1.8), "not valid again after the renewals came back"


def test_a_lease_not_renewed_for_a_whole_lease_is_given_up():
    async def renew(elapsed):
        if elapsed > 0.3:
            raise ConnectionError("cut off")
        return 1

    seen, done = _lease_with_renewals(renew)
    assert done and not seen[-1][1]
    assert seen[-1][0] < 2.0  # a whole lease (1.2 s) past the last renewal, and a renewal's period


def test_a_lease_lost_says_whether_another_holds_it():
    """Redis answering that the lease is not ours any more: taken by another or lapsed with
    nobody holding it (the process stood still); either way the process stands by again."""
    from pagefleet.scheduler.server import Lease

    class Fake:
        def __init__(self, holder):
            self.holder = holder

        async def set(self, *a, **kw):
            return True

        async def get(self, key):
            return self.holder

        async def eval(self, script, *a):
            return 1 if script == TAKE_EPOCH else 0

    async def go(holder):
        return await asyncio.wait_for(Lease(Fake(holder), Keys("t"), "me", lease_ms=300).hold(asyncio.Event()), 5)

    assert asyncio.run(go(None)) == "free"
    assert asyncio.run(go(b"other")) == "taken"


def test_a_scheduler_whose_lease_lapsed_or_was_taken_stands_by_and_takes_it_again(tmp_path):
    """A scheduler that stood still longer than its lease (a loaded machine) found the lease
    lapsed with nobody holding it, and exited: a cluster without a standby had no scheduler.
    It now starts again from Redis under a new epoch, as a standby taking over would; likewise
    when the lease was taken, and when another's epoch fenced its writes first."""
    from cluster_fixtures import log_events, wait_for

    from pagefleet.common.service import free_port

    with RedisServer() as server:
        r = sync_redis.Redis(port=server.port)
        keys = Keys()
        log = tmp_path / "scheduler.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagefleet", "scheduler", "--port", str(free_port()), "--redis-url", server.url,
                 "--lease-ms", "1200", "--log-format", "json"], stdout=out, stderr=subprocess.STDOUT)
        try:
            def events(name):
                return [e for e in log_events(tmp_path, "scheduler") if e.get("event") == name]

            wait_for(lambda: events("scheduler.active"), 60, "the scheduler active")
            first = int(r.get(keys.scheduler_epoch))
            r.delete(keys.lease)  # as if it had lapsed while the process stood still
            wait_for(lambda: len(events("scheduler.active")) == 2, 30, "the scheduler active again")
            assert proc.poll() is None
            assert events("scheduler.lease_lost") and int(r.get(keys.scheduler_epoch)) > first
            assert r.get(keys.lease) is not None
            # Taken by another (a standby that took over, a Redis failover that lost the
            # renewals): it exited, and under `up` that stopped every process. It stands by now,
            # and takes the lease again once the other's lapses.
            second = int(r.get(keys.scheduler_epoch))
            r.set(keys.lease, "another", px=2500)
            wait_for(lambda: len(events("scheduler.active")) == 3, 30, "the scheduler active a third time")
            assert proc.poll() is None and int(r.get(keys.scheduler_epoch)) > second
            # Fenced by another's epoch before its own lease task noticed the lease gone (it
            # stalled past its lease, a standby took over, and its first write after waking was
            # refused: StaleScheduler): it exited 1. It stands by now.
            third = int(r.get(keys.scheduler_epoch))
            r.incr(keys.scheduler_epoch)  # another scheduler's takeover
            r.xadd(keys.requests, {"kind": "cancel", "rid": "nobody"})  # its finish is fenced off
            wait_for(lambda: len(events("scheduler.active")) == 4, 30, "the scheduler active a fourth time")
            assert proc.poll() is None and int(r.get(keys.scheduler_epoch)) > third + 1
            assert any("fenced" in e.get("after", "") for e in events("scheduler.standby"))
            assert not events("scheduler.failed")
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
            r.close()


def test_redis_server_restarts_on_its_append_only_file():
    with RedisServer(appendonly=True) as r:
        c = sync_redis.Redis(port=r.port)
        c.xadd("s", {"k": "v"})
        c.set("lease", "me", px=60_000)
        port = r.port
        t = time.monotonic()
        r.restart()
        assert r.port == port and time.monotonic() - t < 10
        c = sync_redis.Redis(port=r.port)
        assert c.xlen("s") == 1 and c.get("lease") == b"me" and c.pttl("lease") > 0


def test_a_dead_sources_moves_are_dropped_at_their_targets_together(redis_server):
    """A prefill worker dies with five prompts on their way to a decode worker that answers
    slowly. Each drop at the target is waited for before its request resumes (so that its new
    assignment there is not cancelled by it); one after another they held the scheduler's tick
    five times DROP_WAIT_S. Together: one DROP_WAIT_S at most, and every one resumes."""
    from pagefleet.protos import cluster_pb2
    from pagefleet.scheduler.moves import Transfer
    from pagefleet.scheduler.transfers import DROP_WAIT_S
    from pagefleet.scheduler.workers import WorkerEntry

    async def go():
        r = connect(redis_server.url)
        _, sched = await _scheduler_on(r, "dead-source-drops")
        ledger = sched.ledger
        for wid, role in (("p", "prefill"), ("d", "decode")):
            ledger.add_worker(WorkerEntry(wid, f"{wid}-addr", role=role))
            ledger.on_report(ledger.workers[wid], cluster_pb2.OccupancyReport(
                worker_id=wid, num_blocks=256, num_free_blocks=256, block_size=16, max_num_seqs=64,
                max_model_len=4096))
        for i in range(5):
            ledger.take(f"r{i}", f"e{i}", cluster_pb2.AssignRequest(
                request_id=f"r{i}", prompt_token_ids=[i + 1] * 300, sampling=pb.SamplingParams(max_tokens=8)))
        while (d := ledger.decide_round()).claims:
            for p, pl in d.claims:
                ledger.settled(p, pl.worker, True)
        for i in range(5):
            rid = f"r{i}"
            if ledger.where.get(rid) == "p":
                ledger.transfers[rid] = Transfer(ledger.known[rid], ledger.workers["p"], ledger.workers["d"],
                                                 "disaggregation", 1e9, 4)
        moving = len(ledger.transfers)
        assert moving >= 2, ledger.where

        async def slow_drop(w, rid):
            await asyncio.sleep(DROP_WAIT_S * 0.8)

        resumed = []

        async def requeue(p, worker_dead=""):
            resumed.append(p.request_id)

        sched.transfers.cancel_now = slow_drop
        sched._requeue = requeue
        started = time.monotonic()
        await sched._worker_dead(ledger.workers["p"], "test")
        took = time.monotonic() - started
        assert len(resumed) >= moving  # every move resumed (and what p held besides)
        assert took < 1.5 * DROP_WAIT_S, f"{moving} drops took {took:.2f} s"
        await sched.transfers.close()
        await r.aclose()

    asyncio.run(go())


def test_a_redis_that_refuses_writes_a_while_stops_nothing(tmp_path):
    """Redis full at its maxmemory (noeviction: ``OOM`` replies) for a few seconds ended the
    scheduler (and, under ``up``, the cluster), and silently ended each worker's heartbeat, so
    no request ran again even once Redis took writes. Now the refusal is waited out as a
    connection error is: the streams in flight come back whole, new requests run, every
    component is still up, and the workers' rows beat on. A wrong password is no such wait:
    a component given one says so in one line and exits."""
    from cluster_fixtures import start_cluster

    from pagefleet.client import Client

    with RedisServer() as server:
        c = start_cluster(tmp_path, num_workers=1, redis_url=server.url,
                          worker_args=["--engine", "sim", "--time-scale", "1"])
        r = sync_redis.Redis.from_url(server.url)
        try:
            keys = Keys(c.cfg.namespace)
            with Client(c.gateway_target) as client:
                streams = [client.generate_stream(f"refused {i}", max_tokens=600, temperature=0, ignore_eos=True,
                                                  request_id=f"oom-{i}", timeout=120) for i in range(3)]
                heads = [next(s) for s in streams]
                r.config_set("maxmemory", "1")
                time.sleep(4)
                r.config_set("maxmemory", "0")
                for head, s in zip(heads, streams, strict=True):
                    tokens = list(head.token_ids)
                    last = head
                    for msg in s:
                        assert msg.index == len(tokens), (msg.index, len(tokens))
                        tokens += msg.token_ids
                        last = msg
                    assert len(tokens) == 600 and last.finish_reason == pb.FINISH_REASON_LENGTH
                done = client.generate("after", max_tokens=5, temperature=0, ignore_eos=True, timeout=60)
                assert len(done.token_ids) == 5
            assert all(p.poll() is None for p in c.procs.values()), {n: p.poll() for n, p in c.procs.items()}
            (worker_id,) = r.hkeys(keys.workers)
            beat = lambda: __import__("json").loads(r.hget(keys.workers, worker_id))["beat"]  # noqa: E731
            first = beat()
            time.sleep(2.5)
            assert beat() > first
        finally:
            r.config_set("maxmemory", "0")
            r.close()
            c.stop()
    with RedisServer(password="s3cret-enough") as locked:
        wrong = locked.url.replace("redis://", "redis://:wrong@")
        out = subprocess.run([sys.executable, "-m", "pagefleet", "gateway", "--port", "0", "--redis-url", wrong],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "AuthenticationError" in out.stderr.strip().splitlines()[-1]
        out = subprocess.run([sys.executable, "-m", "pagefleet", "up", "--engine", "sim", "--redis-url", wrong],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "AuthenticationError" in out.stderr, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1 and "wrong" not in out.stderr  # the password not shown


def test_what_redis_refuses_for_now_is_waited_out_and_what_it_never_takes_is_not():
    """``OOM`` (full at its maxmemory) and ``MISCONF`` (a failed snapshot) pass once the operator
    mends them: retried as a lost connection is. A wrong password or a missing permission is
    never mended by waiting (redis-py raises the first as a connection error: it was retried for
    ever, every component hung). The gateway says which it was: refused (with Redis's words) or
    unreachable."""
    import redis.exceptions as rx

    from pagefleet.common.redis import is_transient
    from pagefleet.gateway.core import QueueUnavailable

    oom = rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    for e in (oom, rx.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable"),
              rx.ConnectionError("gone"), rx.ReadOnlyError("You can't write against a read only replica.")):
        assert is_transient(e), e
    for e in (rx.AuthenticationError("invalid username-password pair"), rx.NoPermissionError("no permissions"),
              rx.ResponseError("NOGROUP No such key"), rx.ResponseError("ERR unknown command")):
        assert not is_transient(e), e
    assert str(QueueUnavailable.of(oom)) == f"the request queue (Redis) refused: {oom}"
    assert str(QueueUnavailable.of(rx.ConnectionError("gone"))) == "the request queue (Redis) is unreachable"
