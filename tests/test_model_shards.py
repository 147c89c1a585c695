"""One model on several shards of a real Redis Cluster: the gateway spreads its requests over
the shards by id, each shard's scheduler places its own, and a Cancel naming only the id
reaches the request's shard through any gateway process.

The fixture starts a Redis Cluster of 3 primaries on loopback, then simulated workers (two
shards, ``s2`` and ``s3``, whose tags hash to two different primaries, a worker and a
scheduler each) and two gateways."""

from __future__ import annotations

import threading
import zlib

import pytest
from cluster_fixtures import start_cluster, wait_for

from pagefleet.client import Client
from pagefleet.common.redis import Keys
from pagefleet.common.redis_cluster import RedisClusterServer
from pagefleet.launcher import ClusterConfig, LocalCluster

pytestmark = pytest.mark.timeout(240)

SHARDS = ["s2", "s3"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with RedisClusterServer(num_primaries=3, replicas=0) as redis_cluster:
        c = start_cluster(tmp_path_factory.mktemp("model-shards"), num_workers=2, shards_per_model=2,
                          shard_names=SHARDS, redis_url=redis_cluster.url, redis_cluster=True, num_gateways=2,
                          worker_args=["--engine", "sim", "--time-scale", "1"], env={"OMP_NUM_THREADS": "1"})
        try:
            yield c, redis_cluster
        finally:
            c.stop()


def _shard_of(request_id: str) -> str:
    return SHARDS[zlib.crc32(request_id.encode()) % len(SHARDS)]


def _cancelled_through_another(streams: str, cancels: str, rid: str) -> None:
    """``rid`` streamed through gateway ``streams`` and cancelled by id through ``cancels``: the
    stream ends aborted, long before its 2,000 tokens."""
    got = []
    with Client(streams) as c, Client(cancels) as c2:
        stream = c.generate_stream("cancel me", max_tokens=2000, ignore_eos=True, request_id=rid, timeout=120)
        got.append(next(stream))
        assert c2.cancel(rid) is True
        got.extend(stream)
    assert got[-1].finish_reason == 3  # FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in got) < 2000


def test_the_two_shards_live_on_two_primaries(fleet):
    _, redis_cluster = fleet
    assert len({redis_cluster.primary_port(Keys("pf", s).requests) for s in SHARDS}) == 2


def test_a_models_requests_spread_over_its_shards_each_placed_by_its_own_scheduler(fleet):
    cluster, _ = fleet
    ids = [f"spread-{i}" for i in range(12)]
    assert {_shard_of(i) for i in ids} == set(SHARDS)
    before = {s: {w.worker_id: w.num_assigned for w in cluster.scheduler_state(shard=s).workers} for s in SHARDS}
    got: dict[str, int] = {}
    with Client(cluster.gateway_target) as c:
        def one(rid):
            got[rid] = len(c.generate("spread", request_id=rid, max_tokens=8, ignore_eos=True, timeout=60).token_ids)

        threads = [threading.Thread(target=one, args=(rid,)) for rid in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == {rid: 8 for rid in ids}
    for shard, worker in zip(SHARDS, ("worker-0", "worker-1"), strict=True):
        state = cluster.scheduler_state(shard=shard)
        assert [(w.worker_id, w.num_assigned - before[shard][worker]) for w in state.workers] == \
            [(worker, sum(_shard_of(i) == shard for i in ids))]


def test_cancel_by_id_alone_reaches_the_requests_shard_through_another_gateway(fleet):
    cluster, _ = fleet
    first, other = cluster.gateway_targets[:2]
    rid = next(f"cancel-{i}" for i in range(100) if _shard_of(f"cancel-{i}") == SHARDS[1])
    _cancelled_through_another(first, other, rid)
    wait_for(lambda: cluster.scheduler_state(shard=SHARDS[1]).workers[0].report.num_running == 0, 30,
             "the cancelled request to leave its worker")


def test_a_single_shard_not_named_s0_is_given_to_the_gateway():
    cluster = LocalCluster(ClusterConfig(port=0, shard_names=["s2"]))
    assert cluster._model_flags() == ["--model", "tiny", "--shards", "tiny=s2"]


def test_a_cancel_reaches_a_request_queued_before_its_model_gained_a_shard(fleet):
    """A gateway started before the model gained its second shard queued the request on the
    only shard it knew; a gateway started since maps the id to the other one, and queued the
    cancel there, where no scheduler knew it: the Cancel answered True and the request ran to
    its end. Every shard of the model is looked in now."""
    import subprocess
    import sys

    from pagefleet.common.service import free_port

    cluster, _ = fleet
    rid = next(f"moved-{i}" for i in range(100) if _shard_of(f"moved-{i}") == SHARDS[1])
    port = free_port()
    old = subprocess.Popen([sys.executable, "-m", "pagefleet", "gateway", "--port", str(port), "--model", "tiny",
                            "--shards", f"tiny={SHARDS[0]}", "--redis-url", cluster.component_redis_url,
                            "--redis-cluster"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import socket

        def listening():
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 60, "the gateway of one shard to listen")
        _cancelled_through_another(f"127.0.0.1:{port}", cluster.gateway_target, rid)
    finally:
        old.terminate()
        old.wait(30)
