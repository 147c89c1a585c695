"""``pagefleet gateway --processes N``: several gateway processes share the ports; any of them
relays, replays or cancels any request; /metrics sums them."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import grpc
import pytest
from cluster_fixtures import start_cluster, wait_for

from pagefleet.client import Client
from pagefleet.common.service import CHANNEL_OPTIONS
from pagefleet.protos import generation_pb2 as pb
from pagefleet.protos import generation_pb2_grpc

SIM = ["--engine", "sim", "--time-scale", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("gw-procs"), num_workers=2, workers_per_process=2,
                      worker_args=SIM, gateway_args=["--processes", "3"], metrics_port=0, http_port=0)
    yield c
    c.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _stub(target: str):
    # A channel of its own: its own connection, which the kernel may give to any process.
    channel = grpc.insecure_channel(target, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
    return channel, generation_pb2_grpc.GenerationStub(channel)


def test_processes_share_the_port_and_every_stream_is_whole(cluster):
    assert len(_children(cluster.procs["gateway"].pid)) == 3
    for i in range(12):
        with Client(cluster.gateway_target) as c:
            out = c.generate(f"hello {i}", max_tokens=20, temperature=0, ignore_eos=True, timeout=60)
        assert len(out.token_ids) == 20 and out.finish_reason == "length"
    text = urllib.request.urlopen(cluster.metrics_url("gateway"), timeout=10).read().decode()
    ok = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith('pagefleet:gateway_requests_total{code="OK"}'))
    assert ok >= 12  # summed over the processes, whichever served each call


def test_a_retry_and_a_cancel_through_other_connections_reach_the_whole_request(cluster):
    rid = "procs-retry-1"
    req = pb.GenerateRequest(request_id=rid, prompt="a long one",
                             sampling=pb.SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True))
    first, second = [], []

    def read(into, stub):
        try:
            for m in stub.Generate(req, timeout=120):
                into.append(m)
        except grpc.RpcError as e:
            into.append(e)

    channels = [_stub(cluster.gateway_target) for _ in range(3)]
    t1 = threading.Thread(target=read, args=(first, channels[0][1]))
    t1.start()
    wait_for(lambda: sum(len(m.token_ids) for m in first if isinstance(m, pb.GenerateResponse)) >= 10, 30,
             "the first tokens")
    t2 = threading.Thread(target=read, args=(second, channels[1][1]))  # the same id again: a replay
    t2.start()
    wait_for(lambda: sum(len(m.token_ids) for m in second if isinstance(m, pb.GenerateResponse)) >= 10, 30,
             "the retry's first tokens")
    channels[2][1].Cancel(pb.CancelRequest(request_id=rid), timeout=10)
    t1.join(60)
    t2.join(60)
    for got in (first, second):
        msgs = [m for m in got if isinstance(m, pb.GenerateResponse)]
        assert msgs and msgs[-1].finish_reason == pb.FINISH_REASON_ABORT, got[-1]
        index = 0
        for m in msgs:  # every index once, in order, from 0
            assert m.index == index
            index += len(m.token_ids)
        assert index < 1900
    for channel, _ in channels:
        channel.close()


def test_a_process_that_dies_is_replaced(cluster):
    import os
    import signal

    before = _children(cluster.procs["gateway"].pid)
    os.kill(before[0], signal.SIGKILL)
    wait_for(lambda: len(set(_children(cluster.procs["gateway"].pid)) - set(before)) == 1, 30,
             "a new gateway process")
    time.sleep(1.0)
    with Client(cluster.gateway_target) as c:
        assert len(c.generate("again", max_tokens=5, temperature=0, ignore_eos=True, timeout=60).token_ids) == 5


def test_only_the_gateways_processes_share_a_port():
    """grpc binds with SO_REUSEPORT by default: a server given a port already in use would
    share it silently and answer its clients "Method not found". Every server binds alone
    (a bind to a taken port fails), except gateway processes, which share theirs on purpose."""
    import asyncio

    from pagefleet.common.service import SERVER_OPTIONS, server_options

    async def bind_twice(options) -> bool:
        first = grpc.aio.server(options=options)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            grpc.aio.server(options=options).add_insecure_port(f"127.0.0.1:{port}")
            return True
        except RuntimeError:
            return False
        finally:
            await first.stop(None)

    assert not asyncio.run(bind_twice(SERVER_OPTIONS))
    assert not asyncio.run(bind_twice(server_options()))
    assert asyncio.run(bind_twice(server_options(reuse_port=True)))


def test_processes_share_the_health_port_pass_sighup_on_and_die_with_their_supervisor(tmp_path):
    """Each child bound ``--health-port`` alone, so all but one died in a loop; SIGHUP (the key
    reload OPERATIONS.md gives) killed the supervisor and left its children serving, unmanaged."""
    import os
    import signal
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagefleet.common.redis import RedisServer
    from pagefleet.common.service import free_port

    health_port = free_port()
    with RedisServer() as redis, open(tmp_path / "gateway.log", "w") as log:
        sup = subprocess.Popen([sys.executable, "-m", "pagefleet", "gateway", "--processes", "2", "--port", "0",
                                "--health-port", str(health_port), "--redis-url", redis.url],
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            def serving() -> bool:
                with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                    try:
                        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status \
                            == health_pb2.HealthCheckResponse.SERVING
                    except grpc.RpcError:
                        return False

            wait_for(serving, 60, "the shared health port to serve")
            wait_for(lambda: len(_children(sup.pid)) == 2, 30, "two gateway processes")
            time.sleep(3)
            children = _children(sup.pid)
            assert len(children) == 2 and "process_exited" not in (tmp_path / "gateway.log").read_text()
            # Young children killed by a signal (an operator, the OOM killer) are replaced: six such
            # kills counted as "never started" and stopped the healthy ones too (a review's repro).
            for _ in range(6):
                os.kill(_children(sup.pid)[0], signal.SIGKILL)
                time.sleep(0.3)
                wait_for(lambda: len(_children(sup.pid)) == 2, 30, "a replacement")
            wait_for(serving, 60, "the replacements to serve")
            assert sup.poll() is None and "never_started" not in (tmp_path / "gateway.log").read_text()
            time.sleep(3)
            children = _children(sup.pid)
            with open(f"/proc/{children[0]}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            metrics_dir = env[b"PROMETHEUS_MULTIPROC_DIR"].decode()
            assert os.path.isdir(metrics_dir)
            os.kill(sup.pid, signal.SIGHUP)
            time.sleep(2)
            assert sup.poll() is None and _children(sup.pid) == children  # passed on, nobody died
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait(10)

            def gone() -> bool:
                return not any(os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()
                               for pid in children)

            wait_for(gone, 20, "the children to die with their supervisor")
            # its metrics dir goes with them (the supervisor, killed, could not remove it)
            wait_for(lambda: not os.path.exists(metrics_dir), 10, "the metrics dir removed")
        finally:
            for pid in _children(sup.pid) if sup.poll() is None else []:
                os.kill(pid, signal.SIGKILL)
            if sup.poll() is None:
                sup.kill()


def _extra_gateway(cluster, log_path, shutdown_grace: str):
    """One more gateway process on the cluster's Redis: (its process, its port, its open log)."""
    import subprocess
    import sys

    from pagefleet.common.service import free_port

    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - the caller closes it
    gw = subprocess.Popen([sys.executable, "-m", "pagefleet", "gateway", "--port", str(port), "--shutdown-grace",
                           shutdown_grace, "--redis-url", cluster.component_redis_url],
                          stdout=log, stderr=subprocess.STDOUT)
    return gw, port, log


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_gateway_stopped_mid_stream_leaves_client_ids_for_their_retries(cluster, tmp_path):
    """A rolling restart sends a gateway SIGTERM while it relays: its streams are cut, and each
    client retries its id through another gateway. The cut streams were taken for clients gone
    and their requests cancelled, so a retry got ABORT part way. A request with the client's own
    id now runs on (a gateway-chosen id, which nobody can retry, is still cancelled)."""
    import signal
    import threading

    gw, port, log = _extra_gateway(cluster, tmp_path / "gateway-stopped.log", "0")

    def listening():
        return _listening(port)

    results: dict[str, tuple[int, int]] = {}

    def client(rid: str) -> None:
        req = pb.GenerateRequest(request_id=rid, prompt="z",
                                 sampling=pb.SamplingParams(max_tokens=600, temperature=0, ignore_eos=True))
        got: dict[int, int] = {}
        for target in (f"127.0.0.1:{port}", cluster.gateway_target):  # the second: the retry
            channel, stub = _stub(target)
            try:
                for m in stub.Generate(req, timeout=90):
                    got.update({m.index + k: t for k, t in enumerate(m.token_ids)})
                    last = m.finish_reason
                results[rid] = (len(got), last)
                return
            except grpc.RpcError:
                continue
            finally:
                channel.close()

    try:
        wait_for(listening, 60, "the extra gateway to listen")
        threads = [threading.Thread(target=client, args=(f"rolling-{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        gw.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert gw.wait(30) == 0
        assert results == {f"rolling-{i}": (600, pb.FINISH_REASON_LENGTH) for i in range(3)}, results
    finally:
        if gw.poll() is None:
            gw.kill()
        log.close()


def test_a_gateway_told_to_stop_lets_its_streams_end_and_refuses_new_calls(cluster, tmp_path):
    """SIGTERM cut every stream after 2 s, though the manifests promise streams time to end: a
    client without its own id (which cannot retry) lost its request. Within ``--shutdown-grace``
    the streams in flight end where they are; new calls are refused meanwhile."""
    import signal

    gw, port, log = _extra_gateway(cluster, tmp_path / "gateway-graceful.log", "60")
    try:
        wait_for(lambda: _listening(port), 60, "the gateway to listen")
        channel, stub = _stub(f"127.0.0.1:{port}")
        req = pb.GenerateRequest(prompt="z", sampling=pb.SamplingParams(max_tokens=400, temperature=0,
                                                                        ignore_eos=True))
        stream = stub.Generate(req, timeout=90)
        got = len(next(stream).token_ids)
        gw.send_signal(signal.SIGTERM)
        probe = pb.GenerateRequest(prompt="z", sampling=pb.SamplingParams(max_tokens=1))

        def refused() -> bool:  # once the signal is handled (a loaded machine may take a moment)
            try:
                list(stub.Generate(probe, timeout=10))
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.UNAVAILABLE
            return False

        wait_for(refused, 15, "new calls to be refused")
        last = None
        for m in stream:
            got += len(m.token_ids)
            last = m.finish_reason
        assert (got, last) == (400, pb.FINISH_REASON_LENGTH)
        channel.close()
        assert gw.wait(30) == 0
    finally:
        if gw.poll() is None:
            gw.kill()
        log.close()


def test_a_burst_of_dropped_streams_is_cancelled_not_run_to_the_end(cluster):
    """Hundreds of streams dropped at once: their cancels went out a connection each from the
    gateway and were carried out one after another by the scheduler, a Cancel to the worker
    only at the end of each; a third ran to max_tokens for no one (300 running on two workers).
    Now they go out in pipelines and are carried out side by side: the workers and the queue
    are empty within seconds. (Here most wait in the queue, whose cancels are cheap: this checks
    the path, not the old slowness.)"""
    from cluster_fixtures import worker_reports

    channel, stub = _stub(cluster.gateway_target)
    req = pb.GenerateRequest(prompt="z", sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True))
    streams = [stub.Generate(req, timeout=120) for _ in range(160)]
    next(streams[0])  # the calls run (a refusal would raise here)
    try:
        wait_for(lambda: sum(len(r.request_ids) for r in worker_reports(cluster).values()) >= 16, 60,
                 "the streams to run (the rest wait in the queue)")
    finally:
        for s in streams:
            s.cancel()
    t0 = time.monotonic()
    wait_for(lambda: not any(r.request_ids for r in worker_reports(cluster).values())
             and not cluster.scheduler_state().waiting_request_ids, 30, "every dropped stream's request cancelled")
    assert time.monotonic() - t0 < 20  # 2,000 tokens at an H100's pace take half a minute
    channel.close()


def test_a_second_supervisor_is_refused_the_port_and_children_that_never_start_end_it():
    """Two supervisors on one port both bound it (SO_REUSEPORT), and the kernel split the
    clients between them, another cluster's perhaps: the second is refused now, as one gateway
    process is. And children that exit at start (a model that cannot load) were restarted for
    ever, leaving metrics files behind: the supervisor gives up with an error."""
    import subprocess
    import sys

    from pagefleet.common.service import free_port

    port = free_port()
    args = [sys.executable, "-m", "pagefleet", "gateway", "--processes", "2", "--port", str(port),
            "--redis-url", "redis://127.0.0.1:1/0"]  # nothing answers there: the children wait for it
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def held() -> bool:  # as the supervisor probes it: listened on (by the first one's children)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return True
            return False

    try:
        wait_for(held, 60, "the first supervisor to hold the port")
        second = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and f"port {port}" in second.stderr and "taken" in second.stderr, \
            second.stderr[-1500:]
    finally:
        first.terminate()
        first.wait(30)
    never = subprocess.run([sys.executable, "-m", "pagefleet", "gateway", "--processes", "2", "--port", "0",
                            "--model", "/nonexistent/model"], capture_output=True, text=True, timeout=120)
    assert never.returncode == 1 and "gateway.processes_never_started" in never.stdout + never.stderr
