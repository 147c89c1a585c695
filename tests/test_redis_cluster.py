"""Shards on a real Redis Cluster: two models behind one gateway.

The fixture starts a Redis Cluster on loopback (3 primaries with a replica each: six
``redis-server --cluster-enabled yes`` joined by ``redis-cli --cluster create``), then a
cluster of pagefleet on it: the built-in tiny model and a second checkpoint (a small Llama
written with transformers), one shard each (``s0``, ``s1``) with its own scheduler and
worker, two gateways serving both.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from cluster_fixtures import PROMPTS, http_json, reference, start_cluster, wait_for
from conftest import hf_greedy

from pagefleet.client import Client
from pagefleet.common.redis import Keys
from pagefleet.common.redis_cluster import RedisClusterServer, key_slot

pytestmark = pytest.mark.timeout(240)

LLAMA_PROMPTS = [[1, 5 + i, 17, 42 + i, 99, 3 + i] for i in range(4)]


@pytest.fixture(scope="module")
def redis_cluster():
    with RedisClusterServer(num_primaries=3, replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def fleet(redis_cluster, llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    c = start_cluster(log_dir, num_workers=1, redis_url=redis_cluster.url, redis_cluster=True,
                      models=["tiny", f"llama={llama_dir}"], http_port=0, num_gateways=2, metrics_port=0,
                      worker_args=["--num-blocks", "128"], env={"OMP_NUM_THREADS": "1"})
    yield c
    c.stop()


def test_the_cluster_has_three_primaries_each_with_a_replica(redis_cluster):
    nodes = redis_cluster.nodes()
    primaries = [n for n in nodes if n.primary]
    assert len(primaries) == 3 and sum(b - a + 1 for n in primaries for a, b in n.slots) == 16384
    assert sorted(n.primary_id for n in nodes if not n.primary) == sorted(n.node_id for n in primaries)


def test_two_models_through_one_gateway_on_the_cluster(fleet, llama_dir):
    max_tokens = 12
    tiny_prompts = PROMPTS[:4]
    results: dict[tuple[str, int], list[int]] = {}
    with Client(fleet.gateway_target) as c:
        def one(model, i, prompt):
            out = c.generate(prompt, model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=120)
            assert out.finish_reason == "length", out
            results[(model, i)] = out.token_ids

        threads = [threading.Thread(target=one, args=("tiny", i, p)) for i, p in enumerate(tiny_prompts)]
        threads += [threading.Thread(target=one, args=("llama", i, p)) for i, p in enumerate(LLAMA_PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [results[("tiny", i)] for i in range(4)] == reference(tiny_prompts, max_tokens)
    assert [results[("llama", i)] for i in range(4)] == hf_greedy(llama_dir, LLAMA_PROMPTS, max_tokens)
    # Each model's requests were placed by its own shard's scheduler, on its own workers.
    for shard, worker in (("s0", "worker-0"), ("s1", "worker-1")):
        state = fleet.scheduler_state(shard=shard)
        assert [(w.worker_id, w.num_assigned) for w in state.workers] == [(worker, 4)]


def test_each_shard_lives_in_one_slot_and_no_key_crosses_models(fleet, redis_cluster):
    import redis

    client = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        keys = [k.decode() for k in client.scan_iter(match="pf:*", count=1000, target_nodes=client.ALL_NODES)]
    finally:
        client.close()
    by_shard: dict[str, set[int]] = {}
    for k in keys:
        shard = k.split("{", 1)[1].split("}", 1)[0]
        by_shard.setdefault(shard, set()).add(key_slot(k))
    assert set(by_shard) == {"s0", "s1"}, by_shard
    assert by_shard["s0"] == {key_slot(Keys("pf", "s0").requests)}
    assert by_shard["s1"] == {key_slot(Keys("pf", "s1").requests)}


def test_models_lists_each_model_with_its_context_and_routes_by_model(fleet):
    status, body = http_json(f"{fleet.http_url}/v1/models")
    assert status == 200
    cards = {m["id"]: m for m in body["data"]}
    assert set(cards) == {"tiny", "llama"}
    assert cards["llama"]["max_model_len"] == 512 and cards["tiny"]["max_model_len"] > 512
    status, body = http_json(f"{fleet.http_url}/v1/completions",
                         {"model": "llama", "prompt": LLAMA_PROMPTS[0], "max_tokens": 5, "temperature": 0,
                          "ignore_eos": True})
    assert status == 200 and body["model"] == "llama" and body["usage"]["completion_tokens"] == 5
    status, body = http_json(f"{fleet.http_url}/v1/completions",
                         {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["model"] == "tiny"


def test_an_unknown_model_is_not_found_naming_the_served_ones(fleet):
    status, body = http_json(f"{fleet.http_url}/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "gpt-9" in body["error"]["message"] and "`tiny`" in body["error"]["message"] \
        and "`llama`" in body["error"]["message"]
    status, _ = http_json(f"{fleet.http_url}/v1/models/gpt-9")
    assert status == 404
    with Client(fleet.gateway_target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", model="gpt-9", max_tokens=2, timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "tiny" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # several models: a request must name one
            c.generate("hi", max_tokens=2, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "llama" in e.value.details()
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status  # the field to set, as every INVALID_ARGUMENT names one

        (detail,) = rpc_status.from_call(e.value).details
        violations = error_details_pb2.BadRequest()
        assert detail.Unpack(violations) and violations.field_violations[0].field == "model"


def test_cancel_by_id_alone_reaches_the_shard_through_another_gateway(fleet):
    first, other = fleet.gateway_targets[:2]
    rid = f"cancel-me-{time.monotonic_ns()}"
    got: list = []
    with Client(first) as c, Client(other) as c2:
        stream = c.generate_stream(LLAMA_PROMPTS[1], model="llama", max_tokens=400, temperature=0,
                                   ignore_eos=True, request_id=rid, timeout=120)
        got.append(next(stream))  # it runs
        assert c2.cancel(rid) is True
        for msg in stream:
            got.append(msg)
        assert c2.cancel("never-queued-anywhere") is False
    assert got[-1].finish_reason == 3  # FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in got) < 400
    wait_for(lambda: fleet.scheduler_state(shard="s1").workers[0].report.num_free_blocks == 128, 30,
             "the cancelled request's blocks freed")


def test_a_clients_id_is_one_models_at_a_time(fleet):
    """An id is claimed in its model's shard: the same id sent to another model ran as a second
    request, and a Cancel by it stopped both. It is refused (ALREADY_EXISTS, naming the model that
    has it), and the Cancel stops the one request."""
    rid = f"one-model-{time.monotonic_ns()}"
    with Client(fleet.gateway_targets[0]) as c:
        stream = c.generate_stream(LLAMA_PROMPTS[2], model="llama", max_tokens=400, temperature=0,
                                   ignore_eos=True, request_id=rid, timeout=120)
        got = [next(stream)]  # it runs
        with pytest.raises(grpc.RpcError) as e:
            c.generate("both models", model="tiny", max_tokens=20, request_id=rid, timeout=60)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'llama'" in e.value.details()
        assert c.cancel(rid) is True
        got += list(stream)
    assert got[-1].finish_reason == 3 and sum(len(m.token_ids) for m in got) < 400  # FINISH_REASON_ABORT


def test_worker_and_scheduler_metrics_carry_the_model_and_the_shard(fleet):
    from test_metrics import scrape

    worker = scrape(fleet.metrics_url("worker-1"), shard_labels=True)
    labels = {dict(k[1]).get("model") for k in worker}, {dict(k[1]).get("shard") for k in worker}
    assert labels == ({"llama"}, {"s1"}), labels
    assert worker[("pagefleet:num_gpu_blocks", (("model", "llama"), ("shard", "s1")))] == 128
    scheduler = scrape(fleet.metrics_url("scheduler"), shard_labels=True)
    assert scheduler[("pagefleet:scheduler_workers", (("model", "tiny"), ("shard", "s0")))] == 1


def test_gateway_metrics_carry_the_model_of_each_call(fleet):
    from test_metrics import scrape

    def calls(g, model, code="OK"):
        return g.get(("pagefleet:gateway_requests_total", (("code", code), ("model", model))), 0.0)

    before = scrape(fleet.metrics_url("gateway"), shard_labels=True)
    with Client(fleet.gateway_target) as c:
        c.generate(LLAMA_PROMPTS[2], model="llama", max_tokens=3, temperature=0, timeout=60)
        c.generate("metrics", model="tiny", max_tokens=3, temperature=0, timeout=60)
        with pytest.raises(grpc.RpcError):
            c.generate("hi", model="gpt-9", max_tokens=2, timeout=30)
    after = scrape(fleet.metrics_url("gateway"), shard_labels=True)
    assert calls(after, "llama") - calls(before, "llama") == 1
    assert calls(after, "tiny") - calls(before, "tiny") == 1
    # A model not served is no label of its own (clients choose that name): it counts under "".
    assert calls(after, "", "NOT_FOUND") - calls(before, "", "NOT_FOUND") == 1
    assert not any(dict(labels).get("model") == "gpt-9" for _, labels in after)
    ttft = "pagefleet:gateway_time_to_first_token_seconds_count"
    assert after[(ttft, (("model", "llama"),))] - before.get((ttft, (("model", "llama"),)), 0.0) == 1

    def queued(g, model, shard):
        return g.get(("pagefleet:gateway_queued_requests_total", (("model", model), ("shard", shard))), 0.0)

    # Each request is counted on the shard it was queued to (one shard a model here).
    assert queued(after, "llama", "s1") - queued(before, "llama", "s1") == 1
    assert queued(after, "tiny", "s0") - queued(before, "tiny", "s0") == 1


def test_stream_reads_on_the_cluster_ask_no_node_for_their_keys(redis_cluster):
    """redis-py would ask one node (``COMMAND GETKEYS``) for the keys of every XREAD and
    XREADGROUP: a round trip more per read, all on that node. The client of ``connect`` reads
    them from the command itself."""
    import asyncio

    import redis as sync_redis

    from pagefleet.common.redis import connect, stream_read_keys

    assert stream_read_keys(("XREAD", "COUNT", 5, "BLOCK", 10, "STREAMS", "a", b"b", "0", "0")) == ("a", b"b")
    assert stream_read_keys(("XREADGROUP", "GROUP", "g", "c", "streams", "k", ">")) == ("k",)
    assert stream_read_keys(("GET", "k")) is None
    primaries = redis_cluster.primary_ports()

    def getkeys_calls() -> int:
        total = 0
        for port in primaries:
            with sync_redis.Redis(port=port) as c:
                total += int(c.info("commandstats").get("cmdstat_command", {}).get("calls", 0))
        return total

    async def reads() -> int:
        r = connect(redis_cluster.url, cluster=True)
        try:
            await r.set(Keys("pf", "s0").num_waiting, 0)  # the client starts: one COMMAND for its table
            before = getkeys_calls()
            for shard in ("s0", "s2", "s3"):  # on the three primaries
                key = Keys("pf", shard).steps("test-reads")
                await r.xadd(key, {"o": "x"})
                assert len((await r.xread({key: "0"}, count=10))[0][1]) == 1
                await r.xgroup_create(key, "g", id="0")
                assert (await r.xreadgroup("g", "c", {key: ">"}, count=10))[0][1]
                await r.delete(key)
            return before
        finally:
            await r.aclose()

    before = asyncio.run(reads())
    assert getkeys_calls() == before
    assert len({redis_cluster.primary_port(Keys("pf", s).requests) for s in ("s0", "s2", "s3")}) == 3


def test_a_scheduler_that_cannot_take_its_lease_says_so_and_exits_1(redis_cluster):
    """A scheduler pointed at one node of a Redis Cluster without ``--redis-cluster`` got a MOVED
    reply taking its lease, logged nothing and exited 0 (a supervisor saw a clean stop, and the
    shard's requests waited for good). It says why, and exits 1."""
    import subprocess
    import sys

    node = int(redis_cluster.url.rsplit(":", 1)[1])
    shard = next(s for s in (f"s{i}" for i in range(100))
                 if redis_cluster.primary_port(Keys("pagefleet", s).lease) != node)
    p = subprocess.run([sys.executable, "-m", "pagefleet", "scheduler", "--port", "0", "--shard", shard,
                        "--redis-url", redis_cluster.url], capture_output=True, text=True, timeout=90)
    assert p.returncode == 1, (p.stdout + p.stderr)[-2000:]
    assert "scheduler.lease_failed" in p.stdout + p.stderr and "MOVED" in (p.stdout + p.stderr).upper()
