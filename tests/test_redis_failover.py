"""A Redis Cluster failover that really loses acknowledged writes.

On loopback a replica is rarely behind its primary, so killing a primary alone loses nothing
and proves nothing. Here the loss is made on purpose: the shard's replica is stopped
(SIGSTOP) and its replication link cut (the kernel would otherwise buffer the writes for it),
the primary acknowledges writes it can no longer replicate, the primary is killed
(SIGKILL), the replica resumed (SIGCONT) and promoted with ``CLUSTER FAILOVER TAKEOVER``:
everything the primary acknowledged after the stop is gone. Replicas never promote
themselves here (``cluster-replica-no-failover``): the test decides when.
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


def lose_writes(cluster: RedisClusterServer, key: str, write) -> tuple[int, int]:
    """Stop the replica of ``key``'s primary, run ``write()`` (acknowledged by the primary
    alone), kill the primary, resume the replica and promote it. ``(old primary, new primary)``."""
    primary = cluster.primary_port(key)
    replica = cluster.replica_port(primary)
    wait_replicated(cluster, primary, replica)
    cluster.pause(replica)
    cluster.cut_replicas(primary)  # else the stopped replica's kernel buffers the writes: nothing lost
    try:
        write()
    finally:
        cluster.kill(primary)
        cluster.resume(replica)
    cluster.takeover(replica)
    return primary, replica


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

        lose_writes(cluster, keys.requests, write)
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
