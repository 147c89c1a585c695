"""The gateway's admission scripts of one event-loop turn in one pipeline, and the steps
reader's XREAD on a connection of its own, against a real Redis; and the check of a request's
token ids before it is admitted."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions as rx

from pagefleet.common.redis import RedisServer, connect
from pagefleet.common.scripts import ADMIT_AND_QUEUE
from pagefleet.gateway.admission import Admissions
from pagefleet.gateway.steps_read import StepsRead


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def _call(admit: Admissions, ns: str, i: int, max_queue: int = 100):
    keys = [f"{ns}:requests", f"{ns}:waiting", f"{ns}:req:{i}"]
    return admit(keys, [1000, max_queue, 60, "", "id", str(i)])


def test_calls_of_one_turn_go_in_one_round_and_each_gets_its_own_answer(redis_url):
    async def go():
        r = connect(redis_url)
        admit = Admissions(r, r.register_script(ADMIT_AND_QUEUE))
        await r.script_load(ADMIT_AND_QUEUE)
        answers = await asyncio.gather(*(_call(admit, "a1", i) for i in range(20)), _call(admit, "a1", 3))
        assert admit.num_rounds == 1
        assert [a[0] for a in answers[:20]] == [1] * 20
        assert answers[20] == [0]  # the same id again: claimed already, not queued twice
        entries = await r.xrange("a1:requests")
        assert [f[b"id"] for _, f in entries] == [str(i).encode() for i in range(20)]  # in the calls' order
        assert [a[1] for a in answers[:20]] == [eid for eid, _ in entries]
        full = await _call(admit, "a1", 99, max_queue=20)
        assert full[0] == -1 and admit.num_rounds == 2  # a later turn: a round of its own
        await r.aclose()

    asyncio.run(go())


def test_a_script_redis_lost_is_loaded_and_each_call_runs_once(redis_url):
    async def go():
        r = connect(redis_url)
        admit = Admissions(r, r.register_script(ADMIT_AND_QUEUE))
        await _call(admit, "a2", 0)
        await r.script_flush()
        rounds = admit.num_rounds
        answers = await asyncio.gather(*(_call(admit, "a2", i) for i in range(1, 6)))
        assert [a[0] for a in answers] == [1] * 5
        assert admit.num_rounds == rounds + 2  # refused whole, then run again once loaded
        assert await r.xlen("a2:requests") == 6
        await r.aclose()

    asyncio.run(go())


def test_an_unreachable_redis_fails_every_call_of_the_round():
    async def go():
        r = connect("redis://127.0.0.1:1/0")
        admit = Admissions(r, r.register_script(ADMIT_AND_QUEUE))
        results = await asyncio.gather(*(_call(admit, "a3", i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(e, rx.ConnectionError) for e in results)
        await r.aclose()

    asyncio.run(go())


def _plain(got) -> list:
    return [(key, [(eid, list(fields)) for eid, fields in entries]) for key, entries in got]


def test_steps_read_returns_every_entry_after_the_cursors_and_blocks_until_one_comes(redis_url):
    async def go():
        r = connect(redis_url)
        read = StepsRead(r)
        first = await r.xadd("s1", {"o": b"a", "o:x": b"b"})
        await r.xadd("s2", {"o": b"c"})
        got = _plain(await read({"s1": "0-0", "s2": "0-0"}, 10, 100))
        assert got == [("s1", [(first, [b"o", b"a", b"o:x", b"b"])]), ("s2", [(got[1][1][0][0], [b"o", b"c"])])]
        assert await read({"s1": first.decode()}, 10, 50) == []  # nothing new: empty after the block
        later = asyncio.ensure_future(read({"s1": first.decode()}, 10, 5000))
        await asyncio.sleep(0.05)
        third = await r.xadd("s1", {"o": b"d"})
        assert _plain(await asyncio.wait_for(later, 5)) == [("s1", [(third, [b"o", b"d"])])]
        blocked = asyncio.ensure_future(read({"s1": third.decode()}, 10, 5000))
        await asyncio.sleep(0.05)
        blocked.cancel()  # cut mid-read: its reply (when it comes) is dropped, the next read gets its own
        await asyncio.gather(blocked, return_exceptions=True)
        fourth = await r.xadd("s1", {"o": b"e"})
        assert _plain(await read({"s1": third.decode()}, 10, 100)) == [("s1", [(fourth, [b"o", b"e"])])]
        await read.close()
        await r.aclose()

    asyncio.run(go())


def test_on_a_redis_cluster_both_go_through_the_cluster_client():
    from pagefleet.common.redis_cluster import RedisClusterServer

    async def go(url: str):
        r = connect(url, cluster=True)
        admit = Admissions(r, r.register_script(ADMIT_AND_QUEUE))
        shards = ("{c0}", "{c1}", "{c2}", "{c3}")  # spread over the primaries
        answers = await asyncio.gather(*(_call(admit, f"pf:{s}", i) for s in shards for i in range(3)))
        assert [a[0] for a in answers] == [1] * 12
        for s in shards:
            assert await r.xlen(f"pf:{s}:requests") == 3
        read = StepsRead(r)
        eid = await r.xadd("pf:{c1}:steps:w1", {"o": b"a"})
        got = await read({"pf:{c1}:steps:w1": "0-0", "pf:{c1}:steps:w2": "0-0"}, 10, 100)
        assert _plain(got) == [("pf:{c1}:steps:w1", [(eid, [b"o", b"a"])])]
        await read.close()
        await r.aclose()

    with RedisClusterServer(num_primaries=3, replicas=0) as c:
        asyncio.run(go(c.url))


def test_a_call_alone_in_its_turn_loads_a_lost_script_and_runs_once(redis_url):
    async def go():
        r = connect(redis_url)
        admit = Admissions(r, r.register_script(ADMIT_AND_QUEUE))
        await r.script_flush()
        assert (await _call(admit, "a4", 0))[0] == 1  # refused (NOSCRIPT), loaded, run again
        assert (await _call(admit, "a4", 0)) == [0]  # one round
        assert admit.num_rounds == 3 and await r.xlen("a4:requests") == 1
        assert admit.mux is not None and admit.mux.num_connects == 1  # every round on one connection
        await admit.aclose()
        await r.aclose()

    asyncio.run(go())


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_first():
    from pagefleet.common.model_config import load_model_spec
    from pagefleet.gateway.validate import BadField, check
    from pagefleet.protos import generation_pb2 as pb

    spec = load_model_spec("tiny")
    vocab = spec.vocab_size

    def req(**sampling) -> pb.GenerateRequest:
        r = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]))
        r.sampling.max_tokens = 4
        for name, value in sampling.items():
            getattr(r.sampling, name).update(value) if name == "logit_bias" else getattr(r.sampling, name).extend(value)
        return r

    assert check(req(), spec, 4096) == [1, 2, 3]
    assert check(req(logit_bias={vocab - 1: 1.0}, allowed_token_ids=[0, vocab - 1]), spec, 4096) == [1, 2, 3]
    bad = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, vocab + 5, vocab, 2]))
    bad.sampling.max_tokens = 4
    with pytest.raises(BadField, match=f"token id {vocab + 5} is outside") as e:
        check(bad, spec, 4096)
    assert e.value.field == "prompt_token_ids"
    for name, value in (("logit_bias", {3: 1.0, vocab: -1.0}), ("allowed_token_ids", [3, vocab + 1])):
        with pytest.raises(BadField, match="is outside the vocabulary") as e:
            check(req(**{name: value}), spec, 4096)
        assert e.value.field == f"sampling.{name}"
