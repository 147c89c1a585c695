"""Exactly-once by construction, with real processes: fenced ownership, durable finish,
deterministic resume, deadlines that cut running requests, undecodable bytes refused."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_fixtures import PROMPTS, log_events, start_cluster, wait_for, worker_reports

from pagefleet.client import Client

SEEDED = dict(temperature=0.9, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("exactly-once")
    c = start_cluster(log_dir, num_workers=2, worker_args=["--num-blocks", "256"],
                      scheduler_args=["--dead-after", "1.0"])
    try:
        yield c
    finally:
        c.stop()


def _idle(cluster) -> bool:
    reports = worker_reports(cluster)
    return bool(reports) and all(r.num_free_blocks == r.num_blocks and not r.request_ids for r in reports.values())


def test_undecodable_bytes_are_invalid_argument_and_harm_nothing(cluster):
    with grpc.insecure_channel(cluster.gateway_target) as ch:
        raw = ch.unary_stream("/pagefleet.v1.Generation/Generate")  # bytes in, bytes out
        for junk in (b"\xff\xff\xff\xff", b"\x12\x05\xc3\x28abc", b"\x0a"):
            with pytest.raises(grpc.RpcError) as err:
                list(raw(junk, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, junk
            assert "does not decode" in err.value.details()
        cancel = ch.unary_unary("/pagefleet.v1.Generation/Cancel")
        with pytest.raises(grpc.RpcError) as err:
            cancel(b"\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(cluster.gateway_target) as c:
        assert c.generate("still served", max_tokens=4, temperature=0).finish_reason == "length"


def test_a_deadline_cuts_a_running_request(cluster):
    with Client(cluster.gateway_target) as c:
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for msg in c.generate_stream("a long answer", max_tokens=1500, temperature=0, ignore_eos=True,
                                         deadline_ms=1500, timeout=60):
                got.append(msg)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert sum(len(m.token_ids) for m in got) > 0  # it was running when the deadline came
        assert sum(len(m.token_ids) for m in got) < 1500
    wait_for(lambda: _idle(cluster), 20, "the worker to free the request's blocks")


def test_unseeded_sampled_requests_get_a_seed_at_the_gateway(cluster):
    """A request without a seed is continued, not re-rolled, when resumed: the gateway gave it
    one (visible as the same request id replaying the same tokens)."""
    with Client(cluster.gateway_target) as c:
        a = c.generate("roll", max_tokens=12, temperature=1.0, request_id="unseeded-a")
        again = c.generate("roll", max_tokens=12, temperature=1.0, request_id="unseeded-a")
        assert again.token_ids == a.token_ids  # idempotent replay of one generation


def _run_seeded(target: str, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    with Client(target) as c, ThreadPoolExecutor(len(prompts)) as pool:
        futs = {p: pool.submit(c.generate, p, max_tokens=max_tokens, seed=1000 + i, timeout=120, **SEEDED)
                for i, p in enumerate(prompts)}
        outs = {p: f.result() for p, f in futs.items()}
    for o in outs.values():
        assert o.finish_reason == "length"
    return {p: o.token_ids for p, o in outs.items()}


def test_a_frozen_worker_declared_dead_cannot_splice_its_tokens(cluster):
    """SIGSTOP one worker past --dead-after while it generates seeded requests, then SIGCONT
    it: the scheduler resumes its requests on the other worker under a newer epoch; the
    thawed worker's writes are refused and it drops them. Every client sees exactly the
    tokens an undisturbed run gives."""
    prompts = PROMPTS[:6]
    # Long enough that the victim is mid-generation when frozen, and has writes to make after.
    reference = _run_seeded(cluster.gateway_target, prompts, 400)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_run_seeded, cluster.gateway_target, prompts, 400)
        victim = wait_for(lambda: next((w for w, r in worker_reports(cluster).items() if r.num_running), None),
                          30, "a worker to run something")
        pid = cluster.procs[victim].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: victim not in worker_reports(cluster), 20, "the frozen worker to be declared dead")
        finally:
            os.kill(pid, signal.SIGCONT)
        got = fut.result(timeout=180)
    assert got == reference
    wait_for(lambda: any(e.get("event") in ("outputs.refused", "request.fenced_off")
                         for e in log_events(cluster.cfg.log_dir, victim)),
             60, "the thawed worker to have its writes refused")
    wait_for(lambda: len(worker_reports(cluster)) == 2, 30, "the thawed worker to register again")
    wait_for(lambda: _idle(cluster), 30, "every worker to end with its blocks free")


def test_every_worker_declared_dead_while_alive_loses_nothing(cluster):
    """SIGSTOP every worker past --dead-after mid-generation, then SIGCONT them: their streams
    were fenced, so each drops what it held and comes back writing to a new stream, on which the
    scheduler places again; every request resumes after exactly the tokens in Redis."""
    import json

    import redis as sync_redis

    from pagefleet.common.fencing import FENCE_ID
    from pagefleet.common.redis import Keys

    r = sync_redis.Redis.from_url(cluster.redis_url)
    keys = Keys(cluster.cfg.namespace)

    def streams() -> dict[str, str]:
        return {k.decode(): json.loads(v)["steps"] for k, v in r.hgetall(keys.workers).items()}

    prompts = PROMPTS[6:12]
    # Long enough that the freeze lands mid-generation (a short run can end between two looks).
    reference = _run_seeded(cluster.gateway_target, prompts, 400)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_run_seeded, cluster.gateway_target, prompts, 400)
        wait_for(lambda: any(r.num_running for r in worker_reports(cluster).values()), 30, "a worker to run something")
        before = streams()
        pids = [p.pid for n, p in cluster.procs.items() if n.startswith("worker")]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: not worker_reports(cluster), 20, "every worker to be declared dead")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        got = fut.result(timeout=180)
    assert got == reference
    wait_for(lambda: len(worker_reports(cluster)) == 2, 30, "the workers to be placed on again")
    wait_for(lambda: _idle(cluster), 30, "every worker to end with its blocks free")
    after = streams()
    fenced = [s for s in before.values() if (last := r.xrevrange(s, count=1)) and last[0][0].decode() == FENCE_ID]
    assert fenced  # the streams of the workers that held requests were closed...
    assert all(after[w] != s for w, s in before.items() if s in fenced)  # ...and they write to new ones
    r.close()


def test_cancels_at_random_moments_leak_no_blocks(cluster):
    import random

    rng = random.Random(5)
    with Client(cluster.gateway_target) as c, ThreadPoolExecutor(8) as pool:
        def one(i: int) -> None:
            rid = f"cancel-{i}"
            stream = c.generate_stream(f"cancel me {i}", max_tokens=200, temperature=0, ignore_eos=True,
                                       request_id=rid, timeout=300)
            time.sleep(rng.random() * 0.5)
            c.cancel(rid)
            for _ in stream:
                pass

        list(pool.map(one, range(24)))
    wait_for(lambda: _idle(cluster), 30, "every worker to end with its blocks free")


def test_an_entry_whose_delivery_reply_was_lost_is_still_placed(cluster):
    """``XREADGROUP >`` delivered an entry and Redis kept it pending, but the reply never
    arrived (Redis went away mid-call): ``>`` never shows it again. Once its connection
    breaks, the scheduler takes it in from its pending list."""
    import redis as sync_redis

    from pagefleet.common.redis import GROUP, Keys

    requests_key = Keys(cluster.cfg.namespace).requests
    pid = cluster.procs["scheduler"].pid
    r = sync_redis.Redis.from_url(cluster.redis_url)
    try:
        with Client(cluster.gateway_target) as c, ThreadPoolExecutor(1) as pool:
            os.kill(pid, signal.SIGSTOP)
            try:
                # Every connection breaks, as in a restart; first, so that no read of the
                # stopped scheduler is still waiting in Redis to be handed the entry.
                r.client_kill_filter(_type="normal", skipme=True)
                fut = pool.submit(c.generate, "a reply lost", max_tokens=5, temperature=0, ignore_eos=True,
                                  request_id="lost-reply", timeout=60)
                # The scheduler's consumer is handed the entry here, as by the reply that was lost.
                wait_for(lambda: r.xreadgroup(GROUP, "scheduler", {requests_key: ">"}, count=10), 5,
                         "the gateway to queue the request")
            finally:
                os.kill(pid, signal.SIGCONT)
            out = fut.result(timeout=30)
    finally:
        r.close()
    assert len(out.token_ids) == 5
    assert any(e.get("event") == "intake.recovered_pending" for e in log_events(cluster.cfg.log_dir, "scheduler"))
