"""``bench token-path`` on shards (``token_path_shards.py``), small: a real 3-primary Redis
Cluster started by the fixture, 3 shards of one model whose hash tags land on the 3 primaries,
a scheduler each; every stream whole and each primary's and scheduler's costs counted over
its own shards' tokens and placements. And a one-node Redis Cluster, the one-primary baseline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster_fixtures import log_events

from pagefleet.bench.token_path_shards import Primary, primaries_of, spread_shard_names
from pagefleet.common.redis import Keys
from pagefleet.common.redis_cluster import RedisClusterServer, key_slot
from pagefleet.launcher import ClusterConfig

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def redis_cluster():
    with RedisClusterServer(num_primaries=3, replicas=0) as c:
        yield c


def test_shards_of_one_model_on_three_primaries_each_counted_on_its_own(redis_cluster, tmp_path):
    out, logs = tmp_path / "tp.json", tmp_path / "logs"
    subprocess.run([sys.executable, "-m", "pagefleet", "bench", "token-path", "--redis-cluster", "--redis-url",
                    redis_cluster.url, "--shards", "3", "--workers", "3", "--requests", "30", "--concurrency", "12",
                    "--max-tokens", "8", "--time-scale", "inf", "--no-floor", "--modes", "stream",
                    "--log-dir", str(logs), "--json", str(out)], check=True, timeout=200)
    r, = json.loads(out.read_text())["results"]
    assert r["num_whole"] == r["num_streams"] == 30, r["errors"]
    assert r["num_tokens"] == 30 * 8 and r["num_requests_found_in_shards"] == 30
    # Each shard's tag on a primary of its own: every key of a shard lives on that primary.
    primaries = {p.port: p for p in redis_cluster.nodes() if p.primary}
    assert len(r["primaries"]) == 3 and [len(p["shards"]) for p in r["primaries"]] == [1, 1, 1]
    for p in r["primaries"]:
        shard, = p["shards"]
        assert primaries[int(p["node"].rsplit(":", 1)[1])].serves(key_slot(Keys("pf", shard).requests))
        assert p["num_tokens"] == r["by_shard"][shard]["num_tokens"] == 8 * p["num_requests"]
        assert p["redis_cpu_us"] > 0 and p["redis_commands_by_name"]["xadd"] > 0
    assert sum(p["num_tokens"] for p in r["primaries"]) == r["num_tokens"]
    # The gateway spread the requests over the shards, and each shard's scheduler placed its own.
    schedulers = {s["shard"]: s for s in r["schedulers"]}
    assert set(schedulers) == set(r["shards"]) and all(s["num_placements"] > 0 for s in schedulers.values())
    assert sum(s["num_placements"] for s in schedulers.values()) == 30
    # Counted apart: /proc counts CPU in 10 ms ticks, and a scheduler's few placements of a short
    # run can take less than one, so each is counted (>= 0) and together they took some.
    assert all(s["cpu_us_per_placement"] >= 0 for s in schedulers.values())
    assert sum(s["cpu_us_per_placement"] * s["num_placements"] for s in schedulers.values()) > 0
    # Every relay was fed by its shard's steps reader: none fell back to reading its own stream
    # (as it does when a request names another shard's reader as the one to write for).
    events = log_events(logs, "gateway")
    assert any(e.get("event") == "request.enqueued" for e in events)
    assert not [e for e in events if e.get("event") == "relay.from_stream"]


def test_a_one_node_redis_cluster_serves_every_slot_with_its_replica():
    with RedisClusterServer(num_primaries=1, replicas=1) as c:
        primary, = primaries_of(c.url, cluster=True)
        assert primary.slots == ((0, 16383),) and primary.port in c.live_ports()
        assert c.replica_port(primary.port) != primary.port
        assert spread_shard_names(3, [primary]) == ["s0", "s1", "s2"]


def test_shard_names_land_on_the_primaries_in_turn():
    thirds = [Primary("h", 1, ((0, 5460),)), Primary("h", 2, ((5461, 10922),)), Primary("h", 3, ((10923, 16383),))]
    names = spread_shard_names(6, thirds)
    assert len(set(names)) == 6
    assert [next(p.port for p in thirds if p.serves(key_slot(Keys("pf", n).requests))) for n in names] == \
        [1, 2, 3, 1, 2, 3]


def test_the_launcher_takes_shard_names_in_plan_order():
    cfg = ClusterConfig(models=["a=tiny", "b=tiny"], shards_per_model=2, shard_names=["x", "y", "z", "w"])
    assert [(s, m) for s, m, _ in cfg.plan()] == [("x", "a"), ("y", "a"), ("z", "b"), ("w", "b")]
    with pytest.raises(ValueError, match="4 distinct names"):
        ClusterConfig(models=["a=tiny", "b=tiny"], shards_per_model=2, shard_names=["x", "y", "z", "z"]).plan()
    with pytest.raises(ValueError, match="hash tag"):
        ClusterConfig(shard_names=["a{b"]).plan()


@pytest.mark.parametrize("flags, error", [
    (["--primaries", "2"], "--primaries"),
    (["--shards", "0"], "--shards"),
    (["--workers", "2", "--shards", "3"], "--shards"),
    (["--replicas", "-1"], "--replicas"),
])
def test_bad_shard_flags_say_what_to_fix(flags, error):
    out = subprocess.run([sys.executable, "-m", "pagefleet", "bench", "token-path", "--no-floor", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and error in out.stderr, out.stderr
