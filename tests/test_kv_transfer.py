"""KV transfer between engines: the transport (NIXL, and the in-process stand-in), the
pairing check, and live migration on the real CPU engine (tiny model): tokens identical
to an undisturbed run, greedy and seeded, whatever the stages."""

from __future__ import annotations

import pytest
import torch

from pagefleet import Engine, SamplingParams
from pagefleet.worker.kv_transfer import (
    IncompatiblePeer,
    KVLayout,
    LocalTransport,
    NixlTransport,
    PoolHandle,
    block_runs,
    detect_path,
)
from pagefleet.worker.migration import Lease, LiveMigration, MigrationReceiver

PROMPT = list(range(30, 30 + 53))  # 53 tokens: 3 full blocks of 16 and a partial one


def _engine(**kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine("tiny", device="cpu", block_size=16, **kw)


def engines_met(kind):
    """Two engines whose pools are registered with transports of ``kind`` that have met:
    ``(src, dst, source transport, receiver transport, the source's name at the receiver)``."""
    src, dst = _engine(), _engine()
    ts, td = kind("tiny"), kind("tiny")
    hs, hd = ts.register(src.kv_cache), td.register(dst.kv_cache)
    ts.connect(hd)
    return src, dst, ts, td, td.connect(hs)


@pytest.fixture(scope="module")
def pair():
    """Two engines whose pools are registered with local transports and connected."""
    src, dst, ts, td, peer = engines_met(LocalTransport)
    yield src, dst, td, peer
    ts.close()
    td.close()


class Collector:
    """A request's output tokens placed by delta index (each exactly once)."""

    def __init__(self, rid: str) -> None:
        self.rid, self.tokens, self.finish = rid, {}, None

    def take(self, deltas) -> None:
        for d in deltas:
            if d.request_id != self.rid:
                continue
            for i, t in enumerate(d.token_ids):
                assert self.tokens.setdefault(d.index + i, t) == t, "a token index came twice, different"
            self.finish = d.finish_reason or self.finish

    def ids(self) -> list[int]:
        assert sorted(self.tokens) == list(range(len(self.tokens))), "a gap in the output"
        return [self.tokens[i] for i in range(len(self.tokens))]


def migrate_midway(src, dst, transport, peer, params, *, after: int, rid: str, prompt=PROMPT, **kw):
    """Run ``rid`` on ``src`` for ``after`` tokens, migrate it live to ``dst`` (``src``
    keeps stepping during the stages), finish it there; its tokens and the migration's stats."""
    out = Collector(rid)
    src.add_request(prompt, params, request_id=rid)
    while len(out.tokens) < after:
        out.take(src.step())
    recv = MigrationReceiver(dst, transport, peer, rid, list(prompt))
    stats = LiveMigration(src, rid, recv, **kw).run(lambda: out.take(src.step()))
    assert stats.outcome == "migrated", stats
    assert rid not in src.requests and rid not in src.kv.block_tables
    while out.finish is None:
        out.take(dst.step())
    return out.ids(), stats


_UNDISTURBED: dict[str, list[int]] = {}


def undisturbed(params, prompt=PROMPT) -> list[int]:
    """The tokens of one run on an engine of its own, nothing moved (one engine for all)."""
    key = repr((params, prompt))
    if key not in _UNDISTURBED:
        if "engine" not in _UNDISTURBED:
            _UNDISTURBED["engine"] = _engine()
        _UNDISTURBED[key] = _UNDISTURBED["engine"].generate([prompt], params)[0].token_ids
    return _UNDISTURBED[key]


# -- the mechanism ----------------------------------------------------------------------


def test_block_runs_join_blocks_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


def test_pairing_is_refused_up_front_naming_what_differs():
    a = KVLayout("tiny", "float32", 16, 2, 2, 32)
    a.check_compatible(KVLayout("tiny", "float32", 16, 2, 2, 32))
    with pytest.raises(IncompatiblePeer, match=r"block_size: ours 16, peer's 32.*dtype|dtype.*block_size"):
        a.check_compatible(KVLayout("tiny", "bfloat16", 32, 2, 2, 32))
    t1, t2 = LocalTransport("tiny"), LocalTransport("tiny")
    try:
        t1.register(torch.zeros(2, 2, 8, 16, 2, 32))
        h2 = t2.register(torch.zeros(2, 2, 8, 32, 2, 32))  # another block size
        with pytest.raises(IncompatiblePeer, match="block_size"):
            t1.connect(h2)
        assert not t1.peers
        with pytest.raises(KeyError, match="connect it first"):
            t1.read(h2.agent_name, [0], [0])
    finally:
        t1.close()
        t2.close()


def test_pool_handle_round_trips_through_a_dict():
    h = PoolHandle("a", b"\x00\x01", 1234, 8, KVLayout("tiny", "float32", 16, 2, 2, 32), "host", 7)
    assert PoolHandle.from_dict(h.to_dict()) == h


def test_nixl_reads_blocks_between_two_agents():
    """Two NIXL agents (UCX) in one process: scattered blocks of every layer land exactly."""
    src = torch.randn(3, 2, 20, 4, 2, 8)
    dst = torch.zeros_like(src)
    a, b = NixlTransport("tiny"), NixlTransport("tiny")
    ha = a.register(src)
    b.register(dst)
    peer = b.connect(ha)
    assert b.transport_to(peer) == "cma"  # same process: nothing stops a direct read
    t = b.read(peer, [3, 4, 5, 17, 2], [10, 11, 12, 0, 19])
    while b.poll(t) == "PROC":  # both agents live on this thread: progress the one read from too
        a.progress()
    assert t.state == "DONE"
    assert torch.equal(dst[:, :, [10, 11, 12, 0, 19]], src[:, :, [3, 4, 5, 17, 2]])
    assert dst[:, :, 1:10].abs().sum() == 0, "only the blocks asked for are written"
    assert b.num_bytes_read_total == 5 * 3 * 2 * 4 * 2 * 8 * 4


def test_detect_path_says_tcp_when_the_peer_cannot_be_read():
    h = PoolHandle("x", b"", 0x10, 1, KVLayout("tiny", "float32", 16, 1, 1, 1), "", 1)
    assert detect_path(h) == "network"  # another host
    import socket

    h = PoolHandle("x", b"", 0x10, 1, KVLayout("tiny", "float32", 16, 1, 1, 1), socket.gethostname(), 2**22 + 7)
    assert detect_path(h) == "tcp"  # no such process: process_vm_readv fails


def test_lease_expires_without_renewal_and_at_the_deadline():
    lease = Lease.start(deadline_s=10, lease_s=1, now=0)
    assert not lease.expired(0.5)
    assert lease.expired(1.0)
    lease.renew(0.9)
    assert not lease.expired(1.5)
    assert lease.expired(10.0)
    with pytest.raises(ValueError):
        Lease.start(deadline_s=0)


# -- live migration on the real engine ---------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234),
], ids=["greedy", "seeded"])
def test_live_migration_tokens_identical_to_an_undisturbed_run(pair, params):
    src, dst, td, peer = pair
    ids, stats = migrate_midway(src, dst, td, peer, params, after=3, rid=f"m-{params.seed}", final_stage_blocks=2)
    assert ids == undisturbed(params)
    assert stats.num_stages == 2, "one stage while decoding, then the final one"
    assert stats.stage_blocks[0] == 3 and stats.num_bytes > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_received_request_is_preempted_like_any_other(mode):
    """Preempting a request that came in by migration swaps it out (or drops its KV to
    recompute) as it would any other, and it finishes with the undisturbed tokens."""
    src, dst = _engine(), _engine(num_swap_blocks=32)
    ts, td = LocalTransport("tiny"), LocalTransport("tiny")
    hs, hd = ts.register(src.kv_cache), td.register(dst.kv_cache)
    ts.connect(hd)
    peer = td.connect(hs)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=77)
    out = Collector(f"pre-{mode}")
    src.add_request(PROMPT, params, request_id=out.rid)
    while len(out.tokens) < 3:
        out.take(src.step())
    recv = MigrationReceiver(dst, td, peer, out.rid, list(PROMPT))
    assert LiveMigration(src, out.rid, recv, final_stage_blocks=2).run(lambda: out.take(src.step())).outcome \
        == "migrated"
    out.take(dst.step())
    assert dst.preempt_request(out.rid, mode=mode)
    assert out.rid not in dst.kv.block_tables or not dst.kv.block_tables[out.rid]
    assert dst.stats().num_swapped == (1 if mode == "swap" else 0)
    while out.finish is None:
        out.take(dst.step())
    ts.close()
    td.close()
    assert out.ids() == undisturbed(params)


def test_stop_and_copy_is_one_frozen_stage(pair):
    src, dst, td, peer = pair
    params = SamplingParams(max_tokens=12, temperature=0)
    ids, stats = migrate_midway(src, dst, td, peer, params, after=3, rid="sc", max_stages=0)
    assert ids == undisturbed(params)
    assert stats.num_stages == 1 and stats.stage_blocks == [4]


def test_mid_prefill_migration_continues_the_prompt_on_the_receiver(pair):
    src, dst, td, peer = pair
    src.scheduler.max_num_batched_tokens = 16  # the prompt prefills in chunks of 16
    try:
        params = SamplingParams(max_tokens=12, temperature=0)
        out = Collector("pf")
        src.add_request(PROMPT, params, request_id="pf")
        out.take(src.step())  # one chunk computed
        recv = MigrationReceiver(dst, td, peer, "pf", PROMPT)
        stats = LiveMigration(src, "pf", recv, max_stages=0).run(lambda: out.take(src.step()))
        assert stats.outcome == "migrated"
        while out.finish is None:
            out.take(dst.step())
    finally:
        src.scheduler.max_num_batched_tokens = 2048
    assert out.ids() == undisturbed(params)


def test_prefix_cached_at_the_receiver_is_not_read_again(pair):
    src, dst, td, peer = pair
    params = SamplingParams(max_tokens=12, temperature=0)
    dst.generate([PROMPT[:48] + [7, 7]], SamplingParams(max_tokens=1))  # caches the prompt's 3 full blocks
    ids, stats = migrate_midway(src, dst, td, peer, params, after=2, rid="px", max_stages=0)
    assert ids == undisturbed(params)
    assert stats.num_blocks_read == 1, "only the partly filled last block travels"


def test_failed_read_leaves_the_request_on_the_source_and_frees_the_receiver(pair):
    src, dst, td, peer = pair
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    out = Collector("f")
    src.add_request(PROMPT, params, request_id="f")
    while len(out.tokens) < 4:
        out.take(src.step())
    td.fail_next = 1
    recv = MigrationReceiver(dst, td, peer, "f", PROMPT)
    stats = LiveMigration(src, "f", recv, final_stage_blocks=2).run(lambda: out.take(src.step()))
    assert stats.outcome == "failed"
    assert "f" not in dst.kv.block_tables and dst.kv.num_free_blocks == dst.kv.num_blocks
    while out.finish is None:
        out.take(src.step())
    assert out.ids() == undisturbed(params)


def test_expired_lease_reclaims_both_sides(pair):
    src, dst, td, peer = pair
    params = SamplingParams(max_tokens=12, temperature=0)
    out = Collector("e")
    src.add_request(PROMPT, params, request_id="e")
    out.take(src.step())
    recv = MigrationReceiver(dst, td, peer, "e", PROMPT)
    lease = Lease.start(deadline_s=60, lease_s=1e-9)
    stats = LiveMigration(src, "e", recv, lease=lease).run(lambda: out.take(src.step()))
    assert stats.outcome == "expired"
    assert recv.state == "aborted" and "e" not in dst.kv.block_tables
    while out.finish is None:
        out.take(src.step())
    assert out.ids() == undisturbed(params)


def test_receiver_without_room_refuses_and_nothing_changes(pair):
    src, _, _, _ = pair
    small = _engine(num_blocks=4)
    t = LocalTransport("tiny")
    try:
        t.register(small.kv_cache)
        ts = LocalTransport("tiny")
        peer = t.connect(ts.register(torch.zeros_like(src.kv_cache)))
        recv = MigrationReceiver(small, t, peer, "big", PROMPT)
        assert recv.read(0, list(range(5))) is None
        assert small.kv.num_free_blocks == 4
        recv.abort()
        ts.close()
    finally:
        t.close()


def test_nixl_live_migration_between_engines():
    """The same migration over NIXL (two agents, one process)."""
    src, dst, ts, td, peer = engines_met(NixlTransport)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=99)
    ids, stats = migrate_midway(src, dst, td, peer, params, after=3, rid="nx", final_stage_blocks=2,
                                progress=ts.progress)
    assert ids == undisturbed(params)
    assert stats.num_stages >= 2


# -- across processes, over NIXL, under kill -9 -------------------------------------------


@pytest.fixture
def nixl_source():
    from pagefleet.worker.kv_transfer import NixlTransport

    engine = _engine()
    transport = NixlTransport("tiny")
    transport.register(engine.kv_cache)
    return engine, transport


def _connect_receiver(transport):
    from kv_peer import RemoteReceiver, start_receiver

    proc, conn, handle = start_receiver()
    transport.connect(PoolHandle.from_dict(handle))
    remote = RemoteReceiver(conn)
    remote.call("connect", transport.handle().to_dict())
    return proc, conn, remote


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=7),
], ids=["greedy", "seeded"])
def test_migration_to_another_process_over_nixl(nixl_source, params):
    from kv_peer import wait_for

    src, ts = nixl_source
    proc, conn, remote = _connect_receiver(ts)
    try:
        out = Collector("x")
        src.add_request(PROMPT, params, request_id="x")
        while len(out.tokens) < 3:
            out.take(src.step())
        assert remote.call("begin", "x", PROMPT)
        stats = LiveMigration(src, "x", remote, final_stage_blocks=2, progress=ts.progress).run(
            lambda: out.take(src.step()))
        assert stats.outcome == "migrated" and stats.num_stages >= 2
        assert "x" not in src.requests
        for i, t in wait_for(conn, "tokens").items():
            assert out.tokens.setdefault(i, t) == t
        assert out.ids() == undisturbed(params)
        conn.send(("stop",))
    finally:
        proc.kill()


def test_receiver_killed_mid_transfer_leaves_the_request_running_at_the_source(nixl_source):
    import os
    import signal

    src, ts = nixl_source
    proc, conn, remote = _connect_receiver(ts)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11)
    out = Collector("k")
    src.add_request(PROMPT, params, request_id="k")
    while len(out.tokens) < 3:
        out.take(src.step())
    assert remote.call("begin", "k", PROMPT)
    mig = LiveMigration(src, "k", remote, final_stage_blocks=2, progress=ts.progress)
    assert mig.advance() == "running" and mig.in_flight  # the first stage is being read
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    stats = mig.run(lambda: out.take(src.step()))
    assert stats.outcome == "failed"
    while out.finish is None:
        out.take(src.step())
    assert out.ids() == undisturbed(params), "exactly once, as undisturbed"


def test_source_killed_mid_transfer_the_receiver_reclaims_and_the_request_resumes_from_its_tokens():
    import os
    import signal

    from kv_peer import start_source

    from pagefleet.worker.kv_transfer import NixlTransport

    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3)
    proc, conn = start_source(PROMPT, params, after=4)
    try:
        assert conn.poll(120), "the source did not offer a stage"
        _, handle, block_ids, emitted = conn.recv()
        dst = _engine()
        td = NixlTransport("tiny")
        td.register(dst.kv_cache)
        peer = td.connect(PoolHandle.from_dict(handle))
        recv = MigrationReceiver(dst, td, peer, "s", PROMPT, lease=Lease.start(30, 0.5))
        assert recv.read(0, block_ids) == len(block_ids)
        os.kill(proc.pid, signal.SIGKILL)  # mid-transfer: the source never hands over
        proc.join(10)
        deadline = __import__("time").monotonic() + 10
        while not recv.expire_if_due():
            assert __import__("time").monotonic() < deadline, "the receiver's lease never expired"
        assert recv.state == "expired" and dst.kv.num_free_blocks == dst.kv.num_blocks
        # The scheduler resumes it from the tokens Redis holds: here, those the source emitted.
        rid = dst.add_request(PROMPT, params, request_id="s", output_token_ids=emitted)
        out = Collector(rid)
        out.tokens.update(dict(enumerate(emitted)))
        while out.finish is None:
            out.take(dst.step())
        assert out.ids() == undisturbed(params)
    finally:
        proc.kill()


# -- workers meet over gRPC (KvPeer) -------------------------------------------------------

_LAYOUT_SHAPE = (4, 2, 8, 16, 4, 32)  # the tiny model's pool ([layers, 2, blocks, block_size, kv heads, dim]), 8 blocks


def test_workers_meet_over_grpc_and_an_incompatible_pool_is_refused_up_front(tmp_path):
    """A worker with --kv-transfer nixl (and --role decode, which its reports carry) meets a
    peer over KvPeer; a peer whose pool holds other blocks is refused before anything moves."""
    import grpc
    from cluster_fixtures import start_cluster

    from pagefleet.protos import cluster_pb2, cluster_pb2_grpc
    from pagefleet.worker.kv_transfer import handle_from_proto, handle_to_proto

    c = start_cluster(tmp_path, num_workers=1, worker_args=["--num-blocks", "64", "--kv-transfer", "nixl",
                                                             "--role", "decode"])
    try:
        (row,) = c.scheduler_state().workers
        assert row.report.role == cluster_pb2.WORKER_ROLE_DECODE
        stub = cluster_pb2_grpc.WorkerStub(grpc.insecure_channel(row.address))
        ours = NixlTransport("tiny")
        h = ours.register(torch.zeros(_LAYOUT_SHAPE))
        answer = stub.KvPeer(handle_to_proto(h, "test-peer"), timeout=30)
        assert answer.worker_id == row.worker_id and answer.path == "cma"
        theirs = handle_from_proto(answer)
        assert theirs.num_blocks == 64 and theirs.layout == h.layout
        ours.connect(theirs)

        bad = NixlTransport("tiny")
        hb = bad.register(torch.zeros(_LAYOUT_SHAPE[0], 2, 8, 32, *_LAYOUT_SHAPE[4:]))  # another block size
        with pytest.raises(grpc.RpcError) as err:
            stub.KvPeer(handle_to_proto(hb, "bad-peer"), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: ours 16, peer's 32" in err.value.details()
    finally:
        c.stop()


def test_a_migrate_caller_gone_midway_leaves_the_engine_thread_serving(pair):
    """The source's Migrate handler awaits the migration's future; a handler cancelled (its
    call's deadline, its scheduler gone) cancelled that future through ``wrap_future``, and the
    engine thread's later ``set_result`` raised there: the thread died and the worker served
    nothing more. The migration now runs to its end whoever waits for it."""
    import asyncio
    import time

    from pagefleet.worker.engine_loop import EngineLoop

    src, dst, td, peer = pair
    loop = EngineLoop(src, emit=lambda step: None, notify=lambda: None)
    loop.start()

    class SlowReceiver:  # the target as seen over gRPC, busy: each call takes a while
        def __init__(self, r):
            self.r = r

        def read(self, *a):
            time.sleep(0.1)
            return self.r.read(*a)

        def poll(self):
            time.sleep(0.1)
            return self.r.poll()

        def commit(self, h):
            return self.r.commit(h)

        def abort(self):
            return self.r.abort()

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def caller_gone() -> object:
        loop.call(lambda: src.add_request(PROMPT, params, request_id="gone")).result()
        while len(src.requests["gone"].output_token_ids) < 3:
            await asyncio.sleep(0.01)
        recv = SlowReceiver(MigrationReceiver(dst, td, peer, "gone", PROMPT))
        fut = loop.call(lambda: loop.migrate(LiveMigration(src, "gone", recv, final_stage_blocks=2))).result()
        with pytest.raises(TimeoutError):  # as Migrations._migrate's await, cancelled by its call
            await asyncio.wait_for(asyncio.wrap_future(fut), 0.05)
        return fut

    try:
        fut = asyncio.run(caller_gone())
        assert fut.result(timeout=30).outcome == "migrated"
        assert loop.call(lambda: "serving").result(timeout=5) == "serving"
        assert loop._thread.is_alive()
    finally:
        loop.stop()
    out = Collector("gone")
    while out.finish is None:  # and the request goes on where it went
        out.take(dst.step())
    assert out.finish == "length"


class _GatedTarget:
    """A migration target over real gRPC (a ``Worker`` servicer of the four calls a source
    makes), backed by a ``MigrationReceiver``; each call named in ``stall`` waits until
    ``release()``, as a frozen or stalled worker's calls do."""

    def __init__(self, dst, transport, peer, rid: str, prompt: list[int], stall: set[str]) -> None:
        import threading
        from concurrent import futures

        import grpc

        from pagefleet.common.sampling_proto import from_proto
        from pagefleet.protos import cluster_pb2, cluster_pb2_grpc
        from pagefleet.worker.migration import Handover

        self.recv = MigrationReceiver(dst, transport, peer, rid, prompt)
        self.gate, self.lock, self.closed = threading.Event(), threading.Lock(), False
        target = self

        def gated(name, fn):
            def handler(_self, req, ctx):
                if name in stall:
                    target.gate.wait()
                with target.lock:
                    return fn(req)
            return handler

        def read(req):
            n = None if self.closed else self.recv.read(req.first_block, list(req.block_ids))
            return cluster_pb2.MigrateReadResponse(accepted=n is not None, num_blocks_read=n or 0)

        def poll(req):
            state = self.recv.poll() if self.recv.state == "open" and not self.closed else "ERR"
            return cluster_pb2.MigratePollResponse(state={"DONE": cluster_pb2.KV_TRANSFER_STATE_DONE,
                                                          "PROC": cluster_pb2.KV_TRANSFER_STATE_IN_PROGRESS,
                                                          "ERR": cluster_pb2.KV_TRANSFER_STATE_FAILED}[state])

        def commit(req):
            ok = (not self.closed and self.recv.state == "open" and self.recv.commit(Handover(
                req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), from_proto(req.sampling),
                req.priority, req.num_computed_tokens, list(req.final_block_ids), list(req.final_checksums))))
            return cluster_pb2.MigrateCommitResponse(committed=ok, epoch=1 if ok else 0)

        def abort(req):
            self.recv.abort()
            return cluster_pb2.MigrateAbortResponse()

        servicer = type("Target", (cluster_pb2_grpc.WorkerServicer,), {
            "MigrateRead": gated("read", read), "MigratePoll": gated("poll", poll),
            "MigrateCommit": gated("commit", commit), "MigrateAbort": gated("abort", abort)})()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        cluster_pb2_grpc.add_WorkerServicer_to_server(servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = cluster_pb2_grpc.WorkerStub(self.channel)

    def release(self) -> None:
        with self.lock:
            self.closed = True  # what a stalled call does once let go changes nothing
            self.recv.abort()
        self.gate.set()
        self.channel.close()
        self.server.stop(grace=None)


@pytest.mark.parametrize("stall", ["read", "commit"])
def test_a_stalled_target_never_stops_the_source_engine(stall):
    """The source drives a migration between its steps, on its engine thread. Its calls to the
    target were blocking (up to 5 s each, and an abort after a timeout 5 s more): a frozen or
    stalled target stopped every request of the source for that long. Now each call goes out
    as a future: a stage's read, or the final stage's commit, left unanswered lets the source
    step on (its other requests, here a bystander, keep decoding), and the migration ends by
    its lease (a stage) or its commit's timeout, after which the source asks who owns the
    request (here: itself); the request then runs on at the source, exactly once."""
    import time

    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.protos import cluster_pb2
    from pagefleet.worker.migration_rpc import GrpcReceiver

    src, dst, ts, td, peer = engines_met(LocalTransport)
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    out, bystander = Collector("m"), Collector("b")
    src.add_request(PROMPT, params, request_id="m")
    src.add_request(PROMPT[:20], params, request_id="b")

    def step():
        deltas = src.step()
        out.take(deltas)
        bystander.take(deltas)

    while len(out.tokens) < 3:
        step()
    target = _GatedTarget(dst, td, peer, "m", PROMPT, {stall})
    settled = []
    try:
        receiver = GrpcReceiver(target.stub, "m", lambda h: cluster_pb2.MigrateCommitRequest(
            request_id=h.request_id, prompt_token_ids=h.prompt_token_ids, output_token_ids=h.output_token_ids,
            sampling=to_proto(h.params), priority=h.priority, num_computed_tokens=h.num_computed_tokens,
            final_block_ids=h.final_block_ids, final_checksums=h.final_checksums),
            settle=lambda: settled.append(True) or False, timeout_s=5.0 if stall == "read" else 1.5)
        # A read stalls at the first stage (the lease, 0.5 s, ends it before the call's timeout); a
        # commit at the end (one stage of everything: its timeout, 1.5 s, ends it, and the
        # source keeps the request).
        mig = LiveMigration(src, "m", receiver, final_stage_blocks=2 if stall == "read" else 64,
                            lease=Lease.start(30.0, 0.5))
        longest, before = 0.0, len(bystander.tokens)
        while True:
            t0 = time.perf_counter()
            outcome = mig.advance()
            longest = max(longest, time.perf_counter() - t0)
            if outcome != "running":
                break
            step()
            time.sleep(0.01)  # a step at least 10 ms: the request outlives the lease however fast it decodes
        decoded = len(bystander.tokens) - before
    finally:
        target.release()
    assert outcome == ("expired" if stall == "read" else "failed"), outcome
    assert settled == ([] if stall == "read" else [True])
    assert longest < 0.5, f"an advance held the source's engine thread {longest:.2f} s"
    assert decoded >= 1, f"the bystander decoded {decoded} tokens while the target stalled"
    assert "m" in src.requests and not mig.frozen
    while out.finish is None or bystander.finish is None:
        step()
    assert out.ids() == undisturbed(params), "exactly once, as undisturbed"
    ts.close()
    td.close()


class _Unanswered:
    """A target whose calls stay unanswered (``GrpcReceiver`` with a frozen peer) until told:
    ``answer`` for a poll, ``verdict`` for a commit."""

    def __init__(self, answer: str = "PROC") -> None:
        self.waiting, self.answer, self.verdict = True, answer, None
        self.num_unread = self.num_aborts = 0

    def read(self, first, ids):
        return len(ids)

    def poll(self):
        self.waiting = self.answer == "PROC"
        return self.answer

    def commit(self, h):
        self.waiting = self.verdict is None
        return self.verdict

    def abort(self):
        self.num_aborts += 1


def _frozen_for_its_final_stage(receiver) -> tuple[Engine, LiveMigration]:
    src = _engine()
    src.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id="m")
    for _ in range(3):
        src.step()
    mig = LiveMigration(src, "m", receiver, final_stage_blocks=64, lease=Lease.start(30.0, 5.0))
    assert mig.advance() == "running" and mig.frozen  # the source steps on meanwhile
    return src, mig


@pytest.mark.parametrize(("stage", "answer"), [("reading", "ERR"), ("committing", False), ("committing", True)])
def test_a_migrations_end_never_touches_another_request_of_its_id(stage, answer):
    """A request frozen for its final stage is aborted at the source while that stage's read or
    its commit is unanswered, and the scheduler places its id there again: the migration's end
    thawed (attached the new request to the running queue a second time: the next step failed
    every request of the worker) or released (freed the new request) by id."""
    recv = _Unanswered("PROC" if stage == "reading" else "DONE")
    src, mig = _frozen_for_its_final_stage(recv)
    assert (mig._handover is not None) == (stage == "committing")
    assert src.abort_request("m") is not None
    src.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id="m",
                    output_token_ids=[1, 2, 3])
    new = src.requests["m"]
    if stage == "reading":
        recv.answer = answer
    else:
        recv.verdict = answer
    outcome = mig.advance()
    assert outcome == ("migrated" if answer is True else "failed"), outcome
    assert src.requests.get("m") is new
    queued = sum(r is new for r in src.scheduler.running) + sum(r is new for r in src.scheduler.waiting)
    assert queued == 1, f"the new request is queued {queued} times"
    src.step()  # and the engine steps on


def test_fail_waits_out_a_commit_in_flight():
    """``EngineLoop.pause`` (a worker handing its requests back) ends its migrations with
    ``fail()``: with a commit in flight that aborted the target (which cannot stop a commit
    under way) and thawed the request here, while the commit went on there: the request ran at
    both ends. The commit is waited out now; committed, the request is the target's."""
    import threading

    recv = _Unanswered("DONE")
    src, mig = _frozen_for_its_final_stage(recv)
    assert mig._handover is not None  # committing
    threading.Timer(0.3, lambda: setattr(recv, "verdict", True)).start()
    mig.fail()
    assert (mig.stats.outcome, recv.num_aborts) == ("migrated", 0)
    assert "m" not in src.requests and not src.scheduler.running


class _DeferredLocal(LocalTransport):
    """A local transport whose copy lands at the first poll, as an asynchronous NIXL read does
    (over TCP, or between hosts)."""

    def _start(self, t, remote, local):
        t.handle = (remote, local)

    def _poll(self, t):
        remote, local = t.handle
        LocalTransport._start(self, t, remote, local)
        return "DONE"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_while_a_stage_is_read_is_not_committed_from_stale_blocks(mode):
    """The source preempted the migrating request while a stage's read was in flight, and
    another request took its blocks; the read copied that request's K/V, and only the final
    stage is checked at the handover: the request went on with wrong tokens. A migration now
    fails when its request is preempted; the request goes on at the source, its tokens unchanged."""
    params = SamplingParams(max_tokens=12, temperature=0)
    src = Engine("tiny", device="cpu", block_size=16, num_blocks=5, enable_prefix_caching=False,
                 **({"num_swap_blocks": 16} if mode == "swap" else {}))
    dst = _engine(enable_prefix_caching=False)
    ts, td = _DeferredLocal("tiny"), _DeferredLocal("tiny")
    hs, hd = ts.register(src.kv_cache), td.register(dst.kv_cache)
    ts.connect(hd)
    peer = td.connect(hs)
    try:
        out = Collector("r")
        src.add_request(PROMPT, params, request_id="r")
        while len(out.tokens) < 3:
            out.take(src.step())
        mig = LiveMigration(src, "r", MigrationReceiver(dst, td, peer, "r", PROMPT), final_stage_blocks=2)
        assert mig.advance() == "running" and mig.in_flight
        assert src.preempt_request("r", mode=mode)
        src.add_request(list(range(150, 210)), SamplingParams(max_tokens=4, temperature=0), request_id="o",
                        priority=10)
        out.take(src.step())  # "o" prefills into the blocks "r" left
        stats = mig.run(lambda: out.take(src.step()))
        assert stats.outcome == "failed"
        assert "r" not in dst.kv.block_tables and dst.kv.num_free_blocks == dst.kv.num_blocks
        while out.finish is None:
            out.take(src.step())
        assert out.ids() == undisturbed(params)
    finally:
        ts.close()
        td.close()


_LATE_READ = """
from pagefleet import Engine, SamplingParams
from pagefleet.worker.kv_transfer import NixlTransport
from pagefleet.worker.migration import MigrationReceiver

PROMPT, OTHER = list(range(30, 83)), list(range(100, 160))
greedy = SamplingParams(max_tokens=16, temperature=0)
mk = lambda n: Engine("tiny", device="cpu", block_size=16, num_blocks=n, enable_prefix_caching=False)
want = mk(64).generate([OTHER], greedy)[0].token_ids
src, dst = mk(64), mk(8)
ts, td = NixlTransport("tiny"), NixlTransport("tiny")
hs, hd = ts.register(src.kv_cache), td.register(dst.kv_cache)
ts.connect(hd)
peer = td.connect(hs)
src.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0), request_id="r")
for _ in range(3):
    src.step()
recv = MigrationReceiver(dst, td, peer, "r", PROMPT)
recv.read(0, src.kv.block_tables["r"][:3])
recv.abort()
dst.add_request(OTHER, greedy, request_id="o")
got = {}
for d in dst.step():
    got.update({d.index + i: t for i, t in enumerate(d.token_ids)})
for _ in range(3000):
    ts.progress()
    td.progress()
while "o" in dst.requests:
    for d in dst.step():
        got.update({d.index + i: t for i, t in enumerate(d.token_ids)})
print("IDENTICAL" if [got[i] for i in sorted(got)] == want else "DIFFERENT")
"""


def test_an_aborted_nixl_read_never_lands_in_blocks_given_to_another_request():
    """Over TCP (UCX's path when a peer's memory cannot be read directly, and between hosts) a
    NIXL read goes on after its handle is released; the receiver's abort freed its blocks at
    once, the read landed in the next request's K/V, and that request's tokens changed. A
    cancelled read is now let end before its blocks are freed."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, UCX_TLS="tcp")
    run = subprocess.run([sys.executable, "-c", _LATE_READ], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "IDENTICAL", run.stdout[-2000:]


def test_blocks_a_read_may_still_write_are_set_aside_never_reused():
    """A read that does not end when cancelled (a hung peer) may still write its blocks: they
    are kept out of the pool for good, the rest of the reservation freed."""

    class Unstoppable(_DeferredLocal):
        def cancel(self, t):
            return False

    src, dst = _engine(), _engine(num_blocks=8)
    ts, td = LocalTransport("tiny"), Unstoppable("tiny")
    hs, hd = ts.register(src.kv_cache), td.register(dst.kv_cache)
    ts.connect(hd)
    peer = td.connect(hs)
    try:
        src.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0), request_id="h")
        src.step()
        recv = MigrationReceiver(dst, td, peer, "h", PROMPT)
        assert recv.read(0, src.kv.block_tables["h"][:3]) == 3
        reading = list(recv.transfers[0].local_block_ids)
        recv.abort()
        assert dst.kv.set_aside_blocks == reading and "h" not in dst.kv.block_tables
        assert dst.kv.num_free_blocks == dst.kv.num_blocks - 3
        dst.add_request(list(range(100, 160)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="o")
        dst.step()
        assert len(dst.kv.block_tables["o"]) == 4 and not set(dst.kv.block_tables["o"]) & set(reading)
        while dst.has_unfinished_requests():
            dst.step()
    finally:
        ts.close()
        td.close()
