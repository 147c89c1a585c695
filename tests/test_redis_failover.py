"""A Redis Cluster failover that really loses acknowledged writes.

On loopback a replica is rarely behind its primary, so killing a primary alone loses nothing
and proves nothing. Here the loss is made on purpose: the shard's replica is stopped
(SIGSTOP) and its replication link cut (the kernel would otherwise buffer the writes for it),
the primary acknowledges writes it can no longer replicate, the primary is killed
(SIGKILL), the replica resumed (SIGCONT) and promoted with ``CLUSTER FAILOVER TAKEOVER``:
everything the primary acknowledged after the stop is gone. Replicas never promote
themselves in those tests (``cluster-replica-no-failover``): the test decides when. The last
test is the plain case: a primary killed under load, its replica promoting itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as sync_redis

from pagefleet.common.fencing import Fencing
from pagefleet.common.redis import Keys, connect, retry
from pagefleet.common.redis_cluster import RedisClusterServer
from pagefleet.common.scripts import TAKE_EPOCH

pytestmark = pytest.mark.timeout(240)


def wait_replicated(cluster: RedisClusterServer, primary: int, replica: int, timeout_s: float = 10.0) -> None:
    """Until the replica has everything the primary has written."""
    deadline = time.monotonic() + timeout_s
    with sync_redis.Redis(port=primary) as p, sync_redis.Redis(port=replica) as r:
        while p.info("replication")["master_repl_offset"] != r.info("replication").get("slave_repl_offset"):
            if time.monotonic() > deadline:
                raise TimeoutError("the replica did not catch up")
            time.sleep(0.02)


def _offset(port: int) -> int:
    with sync_redis.Redis(port=port) as c:
        return c.info("replication")["master_repl_offset"]


def lose_writes(cluster: RedisClusterServer, key: str, write) -> int:
    """Stop the replica of ``key``'s primary, run ``write()`` (acknowledged by the primary
    alone), kill the primary, resume the replica and promote it. Returns how many bytes of
    acknowledged writes the primary had not replicated when it died: the loss."""
    primary = cluster.primary_port(key)
    replica = cluster.replica_port(primary)
    wait_replicated(cluster, primary, replica)
    cluster.pause(replica)
    cluster.cut_replicas(primary)  # else the stopped replica's kernel buffers the writes: nothing lost
    replicated = _offset(primary)
    try:
        write()
        lost = _offset(primary) - replicated
    finally:
        cluster.kill(primary)
        cluster.resume(replica)
    cluster.takeover(replica)
    return lost


def test_fencing_epochs_never_go_backwards_when_acknowledged_writes_are_lost():
    keys = Keys("pf", "s0")
    with RedisClusterServer(auto_failover=False, node_timeout_ms=1000) as cluster:
        async def go():
            r = connect(cluster.url, cluster=True)
            f = Fencing(r, keys)
            epoch = int(await r.eval(TAKE_EPOCH, 1, keys.scheduler_epoch))
            first = await f.assign("a", epoch, "w1")
            return r, f, epoch, first

        loop = asyncio.new_event_loop()
        r, f, epoch, first = loop.run_until_complete(go())
        lost: dict[str, int] = {}

        def write():
            async def w():
                lost["scheduler"] = int(await r.eval(TAKE_EPOCH, 1, keys.scheduler_epoch))
                lost["a"] = await f.assign("a", lost["scheduler"], "w2")
                lost["b"] = await f.assign("b", lost["scheduler"], "w2")
            loop.run_until_complete(w())

        assert lose_writes(cluster, keys.requests, write) > 0
        assert lost["scheduler"] > epoch and lost["a"] > first > 0 and lost["b"] > 0

        async def after():
            # The promoted replica never saw the writes acknowledged after its stop: really lost.
            assert int(await retry(lambda: r.get(keys.scheduler_epoch), what="get")) == epoch
            assert int(await r.hget(keys.owner("a"), "epoch")) == first
            assert not await r.exists(keys.owner("b"))
            # A new scheduler and new assignments: above every epoch handed out before the loss.
            again = int(await r.eval(TAKE_EPOCH, 1, keys.scheduler_epoch))
            assert again > lost["scheduler"]
            assert await f.assign("a", lost["scheduler"], "w3") == -1  # the lost scheduler is stale
            assert await f.assign("a", again, "w3") > lost["a"]
            assert await f.assign("b", again, "w3") > lost["b"]
            await r.aclose()

        loop.run_until_complete(after())
        loop.close()


def _engine_reference(prompts: list[str], max_tokens: int, seeds: list[int | None]) -> list[list[int]]:
    """Tokens of the in-process engine: greedy where the seed is None, else sampled with it."""
    from pagefleet import Engine, SamplingParams

    engine = Engine(model="tiny", device="cpu", num_blocks=128)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) if seed is None else
              SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, ignore_eos=True) for seed in seeds]
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_a_failover_that_loses_acknowledged_writes_under_load_loses_doubles_and_changes_nothing(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from cluster_fixtures import PROMPTS, start_cluster

    from pagefleet.client import Client

    max_tokens = 48
    prompts = PROMPTS[:12]
    seeds = [None if i % 2 == 0 else 1000 + i for i in range(len(prompts))]
    first = 8  # running before the loss; the others are queued while the primary acknowledges alone
    want = _engine_reference(prompts, max_tokens, seeds)
    with RedisClusterServer(auto_failover=False, node_timeout_ms=1000) as redis_cluster:
        fleet = start_cluster(tmp_path, num_workers=2, redis_url=redis_cluster.url, redis_cluster=True,
                              worker_args=["--num-blocks", "128"], env={"OMP_NUM_THREADS": "1"})
        try:
            seen: list[int] = [0] * len(prompts)

            def one(c, i):
                kwargs = {"temperature": 0} if seeds[i] is None else {"temperature": 0.9, "seed": seeds[i]}
                tokens, finish = [], ""
                for msg in c.generate_stream(prompts[i], max_tokens=max_tokens, ignore_eos=True, timeout=180,
                                             **kwargs):
                    assert msg.index == len(tokens), "a token shown twice or skipped"
                    tokens.extend(msg.token_ids)
                    seen[i] = len(tokens)
                    if msg.finish_reason:
                        finish = msg.finish_reason
                return tokens, finish

            with Client(fleet.gateway_target) as c, ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(one, c, i) for i in range(first)]
                deadline = time.monotonic() + 60
                while sum(seen) < first * 4 and time.monotonic() < deadline:
                    time.sleep(0.05)

                def write():
                    # The shard's primary acknowledges ~1.5 s of token writes, new requests'
                    # entries and their assignments, which its replica never gets.
                    futures.extend(pool.submit(one, c, i) for i in range(first, len(prompts)))
                    time.sleep(1.5)

                assert lose_writes(redis_cluster, Keys("pf", "s0").requests, write) > 0
                results = [f.result(timeout=180) for f in futures]
        finally:
            fleet.stop()
    assert [t for t, _ in results] == want
    assert all(f == 2 for _, f in results)  # FINISH_REASON_LENGTH


def test_a_relay_queues_its_request_again_only_when_redis_lost_both_its_entry_and_owner():
    """What a gateway does when a failover loses a request's entry before its scheduler read
    it (the forced-loss test above queues new requests during the loss, but its scheduler
    usually reads them first): with the entry or an owner record there, nothing; with neither,
    the same entry again."""
    from argparse import Namespace

    from pagefleet.common.model_config import load_model_spec
    from pagefleet.common.redis import RedisServer
    from pagefleet.gateway.core import GatewayCore
    from pagefleet.protos import generation_pb2 as pb

    with RedisServer() as server:
        async def go():
            r = connect(server.url)
            keys = Keys("t")
            args = Namespace(max_model_len=None, max_queue=1024, max_stream_len=100, block_size=16, retry_after=1.0)
            core = GatewayCore(r, keys, load_model_spec("tiny"), args)
            req = pb.GenerateRequest(request_id="lost", prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]))
            q, = await core.enqueue([(req, [5, 6, 7])], "", client_ids=False)
            first = q.entry_id
            assert [e[0].decode() for e in await r.xrange(keys.requests)] == [first]
            await core.requeue_if_lost(q)  # its entry is there
            await r.xdel(keys.requests, first)
            await r.hset(keys.owner("lost"), "epoch", 1)
            await core.requeue_if_lost(q)  # an owner record: its scheduler took it in
            assert await r.xlen(keys.requests) == 0
            await r.delete(keys.owner("lost"))
            await core.requeue_if_lost(q)  # neither: lost, queued again
            entries = await r.xrange(keys.requests)
            assert len(entries) == 1 and entries[0][0].decode() == q.entry_id != first
            assert entries[0][1][b"rid"] == b"lost" and entries[0][1][b"payload"]
            await core.stop()
            await r.aclose()

        asyncio.run(go())


def test_a_primary_killed_under_load_is_replaced_by_its_replica_and_every_stream_comes_back_whole(tmp_path):
    """kill -9 of the shard's primary while 12 seeded streams run on simulated workers; its
    replica promotes itself (``cluster-node-timeout`` 1 s, no help from the test). Every stream
    comes back whole, no index repeated or skipped, with the tokens of the same requests run
    before the kill (a simulated token is a function of the seed and its position)."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_fixtures import start_cluster, wait_for

    from pagefleet.client import Client

    n, max_tokens = 12, 200
    with RedisClusterServer(node_timeout_ms=1000) as redis_cluster:
        fleet = start_cluster(tmp_path, num_workers=2, redis_url=redis_cluster.url, redis_cluster=True,
                              worker_args=["--engine", "sim", "--time-scale", "0.2"], env={"OMP_NUM_THREADS": "1"})
        try:
            seen = [0] * n

            def one(c, i, run):
                tokens = []
                for msg in c.generate_stream(f"failover {i}", max_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                             seed=500 + i, request_id=f"{run}-{i}", timeout=180):
                    assert msg.index == len(tokens), "a token shown twice or skipped"
                    tokens.extend(msg.token_ids)
                    if run == "run":
                        seen[i] = len(tokens)
                return tokens

            with Client(fleet.gateway_target) as c, ThreadPoolExecutor(n) as pool:
                want = list(pool.map(lambda i: one(c, i, "before"), range(n)))
                futures = [pool.submit(one, c, i, "run") for i in range(n)]
                wait_for(lambda: min(seen) >= 10, 60, "every stream running")
                primary = redis_cluster.primary_port(Keys("pf", "s0").requests)
                replica = redis_cluster.replica_port(primary)
                redis_cluster.kill(primary)
                assert max(seen) < max_tokens  # the kill came under load
                wait_for(lambda: replica in redis_cluster.primary_ports(), 60, "the replica promoted")
                got = [f.result(timeout=180) for f in futures]
        finally:
            fleet.stop()
    assert got == want and all(len(t) == max_tokens for t in got)


def test_a_planned_failover_of_a_shards_primary_leaves_its_scheduler_running(tmp_path):
    """CLUSTER FAILOVER on a replica (nothing lost, well under a second): Redis answers a read
    blocked on the old primary with '-UNBLOCKED force unblock ... (master -> replica?)'. The
    scheduler's blocked read of its done stream took that for a fatal error and the process
    exited: the shard placed nothing more. It is now retried as a connection error is."""
    from pagefleet.client import Client
    from pagefleet.launcher import ClusterConfig, LocalCluster

    with RedisClusterServer(num_primaries=3, replicas=1) as rc:
        c = LocalCluster(ClusterConfig(port=0, log_dir=str(tmp_path), device="cpu", num_workers=1, redis_url=rc.url,
                                       redis_cluster=True, worker_args=["--engine", "sim", "--time-scale", "1"]))
        try:
            c.start(timeout_s=120)
            with Client(c.gateway_target) as client:
                assert client.generate("x", max_tokens=5, timeout=30).finish_reason == "length"
                primary = rc.primary_port(Keys(shard="s0").requests)
                sync_redis.Redis(port=rc.replica_port(primary)).execute_command("CLUSTER", "FAILOVER")
                deadline = time.monotonic() + 30
                while primary in rc.primary_ports():
                    assert time.monotonic() < deadline, "the replica never took over"
                    time.sleep(0.1)
                time.sleep(2)  # the scheduler's blocked reads meet the failover
                assert c.procs["scheduler"].poll() is None, "the scheduler exited"
                assert client.generate("x", max_tokens=5, timeout=30).finish_reason == "length"
        finally:
            c.stop()


def test_a_relay_silent_after_its_first_tokens_still_looks_for_its_request(monkeypatch):
    """A failover that rolls back a request's entry and its assignment can come after the
    request's first tokens were relayed (its scheduler, rebuilt from Redis, then withdraws it
    from its worker as an orphan): a relay silent for ``SILENCE_S`` looks for its request
    whatever it relayed, or its client waits for ever (a review's forced-loss run: four streams
    stopped at ~500 of 800 tokens until their deadlines)."""
    from pagefleet.common.redis import RedisServer
    from pagefleet.gateway import relay as relay_mod

    monkeypatch.setattr(relay_mod, "SILENCE_S", 0.05)
    with RedisServer() as server:
        async def go():
            r = connect(server.url)
            looks = []

            async def on_silence():
                looks.append(time.monotonic())

            step = relay_mod.StepRelay("half-done")
            step.feed_row(0, [5, 6, 7], "abc")
            messages = relay_mod.relay_steps(r, Keys("t"), step, 3, on_silence=on_silence)
            first = await messages.__anext__()
            assert list(first.token_ids) == [5, 6, 7]
            waiting = asyncio.ensure_future(messages.__anext__())
            await asyncio.sleep(0.5)
            assert len(looks) >= 3 and not waiting.done()  # silent: looked, and looked again
            waiting.cancel()
            await r.aclose()

        asyncio.run(go())


def test_requests_streaming_through_a_loss_that_takes_their_assignments_and_the_lease_come_back_whole(tmp_path):
    """A loss long enough to take the scheduler's lease too (2.5 s, a 2 s lease): requests queued
    during it stream their first tokens, then Redis loses their entries, their assignments and
    the lease. The scheduler, rebuilt from what survived, finds them on its worker as orphans and
    withdraws them; each relay, silent, finds its request gone and queues it again. Every stream
    whole and equal to an undisturbed run (a review found them waiting until their deadlines at
    ~500 of 800 tokens: a relay looked for its request only while it had relayed nothing)."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_fixtures import PROMPTS, log_events, start_cluster

    from pagefleet.client import Client

    max_tokens = 1500  # ~600 of them stream during the loss here
    prompts = PROMPTS[:4]
    seeds = [None, 2001, None, 2003]
    want = _engine_reference(prompts, max_tokens, seeds)
    with RedisClusterServer(auto_failover=False, node_timeout_ms=1000) as redis_cluster:
        fleet = start_cluster(tmp_path, num_workers=1, redis_url=redis_cluster.url, redis_cluster=True,
                              worker_args=["--num-blocks", "256"], scheduler_args=["--lease-ms", "2000"],
                              env={"OMP_NUM_THREADS": "1"})
        try:
            seen = [0] * len(prompts)

            def one(c, i):
                kwargs = {"temperature": 0} if seeds[i] is None else {"temperature": 0.9, "seed": seeds[i]}
                tokens, finish = [], 0
                for msg in c.generate_stream(prompts[i], max_tokens=max_tokens, ignore_eos=True, timeout=180,
                                             **kwargs):
                    assert msg.index == len(tokens), "a token shown twice or skipped"
                    tokens.extend(msg.token_ids)
                    seen[i] = len(tokens)
                    finish = msg.finish_reason or finish
                return tokens, finish

            with Client(fleet.gateway_target) as c, ThreadPoolExecutor(len(prompts)) as pool:
                futures = []

                def write():
                    futures.extend(pool.submit(one, c, i) for i in range(len(prompts)))
                    start = time.monotonic()
                    while (min(seen) < 8 or time.monotonic() - start < 2.5) and time.monotonic() - start < 30:
                        time.sleep(0.02)
                    assert max(seen) < max_tokens, "a request finished before the loss: nothing left to test"

                assert lose_writes(redis_cluster, Keys("pf", "s0").requests, write) > 0
                results = [f.result(timeout=180) for f in futures]
        finally:
            fleet.stop()
        requeued = {e["request_id"] for e in log_events(tmp_path, "gateway") if e.get("event") == "request.requeued_lost"}
    assert [t for t, _ in results] == want
    assert all(f == 2 for _, f in results)  # FINISH_REASON_LENGTH
    assert requeued, "the loss was meant to take requests that had streamed tokens"
