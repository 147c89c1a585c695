"""``pagefleet bench migration``: the downtime of a live migration against sequence length.

One request of 1k, 4k and 8k tokens on the real engine (Llama-3.2-1B shape, dummy weights,
bfloat16 by default: 32 KiB of KV a token; float32: 64) is moved to a receiver in another
process over NIXL (UCX), twice per length in the same run:

* ``multi-stage`` (Llumnix): the source keeps decoding while the receiver reads the full
  blocks; the final stage (under ``--final-stage-blocks``) freezes the request;
* ``stop-and-copy``: frozen first, every block read while it waits.

Downtime is the time the request is frozen (final stage start to handover), in ms and in
the source's decode steps (downtime over the median step time measured beside it). Also:
stages, blocks and bytes read, the path UCX took (``cma`` or ``tcp``).

The prompt's KV is written straight into the blocks (random values; the model computes
every token after it): an 8k prefill of a 1B model on a CPU would take minutes and prove
nothing about the copy. The receiver is a pool alone (no model: one 1B model in memory).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from .results import header, int_list

# (deadline, lease) in seconds: a CPU decode step of this shape at 8k takes seconds here, and
# neither side hears from the other during one.
LEASE = (600.0, 60.0)


class RemoteReceiver:
    """A ``MigrationReceiver`` in another process, over a pipe (``receiver_main``); a dead
    peer raises ``EOFError`` / ``ConnectionError``, which ``LiveMigration`` takes for gone."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def call(self, *msg):
        self.conn.send(msg)
        return self.conn.recv()

    def read(self, first, ids):
        return self.call("read", first, ids)

    def poll(self):
        return self.call("poll")

    def commit(self, h):
        return self.call("commit", h)

    def abort(self):
        return self.call("abort")


class PoolOnly:
    """What ``MigrationReceiver`` needs of an engine, without a model: a pool and its tables."""

    def __init__(self, layout: dict, num_blocks: int) -> None:
        import torch

        from pagefleet.worker.kv_cache_manager import KVCacheManager

        self.block_size = layout["block_size"]
        self.kv = KVCacheManager(num_blocks, self.block_size)
        self.kv_cache = torch.zeros((layout["num_layers"], 2, num_blocks, self.block_size, layout["num_kv_heads"],
                                     layout["head_dim"]), dtype=getattr(torch, layout["dtype"]))
        self.requests: dict = {}
        self.committed: list[str] = []

    def _make_request(self, prompt, params, request_id, priority, output_token_ids):
        from pagefleet.worker.request import Request

        return Request(request_id, list(prompt), params, output_token_ids=output_token_ids)

    def import_request(self, req) -> None:
        self.committed.append(req.request_id)
        self.kv.free(req.request_id)  # the bench measures the move, not what runs after


def receiver_main(conn, layout: dict, num_blocks: int, model: str) -> None:
    """The receiving process: one migration at a time, commands from the pipe, the
    transport's progress between them."""
    from pagefleet.worker.kv_transfer import NixlTransport, PoolHandle
    from pagefleet.worker.migration import Lease, MigrationReceiver

    pool, transport = PoolOnly(layout, num_blocks), NixlTransport(model)
    conn.send(transport.register(pool.kv_cache).to_dict())
    recv, peer = None, None
    while True:
        transport.progress()
        busy = recv is not None and recv.pump()  # reads in flight: no waiting on the pipe
        if not conn.poll(0 if busy else 0.0005):
            continue
        cmd, *args = conn.recv()
        if cmd == "connect":
            peer = transport.connect(PoolHandle.from_dict(args[0]))
            conn.send((peer, transport.transport_to(peer)))
        elif cmd == "begin":
            recv = MigrationReceiver(pool, transport, peer, args[0], args[1], lease=Lease.start(*LEASE))
            conn.send(True)
        elif cmd == "stop":
            return
        else:
            conn.send(getattr(recv, cmd)(*args))


def start_receiver(layout: dict, num_blocks: int, model: str):
    """The receiving process, its pipe, and its pool's handle (a dict)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, layout, num_blocks, model), daemon=True)
    proc.start()
    if not parent.poll(300):
        proc.kill()
        raise TimeoutError("the receiver process did not start")
    return proc, parent, parent.recv()


def prefilled(engine, rid: str, num_tokens: int, params):
    """A running request of ``num_tokens`` prompt tokens whose K/V (random) is in its blocks."""
    import torch

    vocab = engine.model_config.vocab_size
    prompt = [(7 * j) % (vocab - 10) + 5 for j in range(num_tokens)]
    req = engine._make_request(prompt, params, rid, 0, None)
    table = engine.kv.allocate_slots(rid, num_tokens)
    cache = engine.kv_cache
    g = torch.Generator().manual_seed(num_tokens)
    for b in table:
        cache[:, :, b].copy_(torch.randn(cache[:, :, b].shape, generator=g) * 0.1)
    req.num_computed_tokens = num_tokens - 1
    engine.import_request(req)
    return req


def measure(engine, transport, remote, *, num_tokens: int, mode: str, final_stage_blocks: int) -> dict:
    from pagefleet import SamplingParams
    from pagefleet.worker.migration import Lease, LiveMigration

    rid = f"{mode}-{num_tokens}"
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prefilled(engine, rid, num_tokens, params)
    step_times = []

    def step():
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)

    step()  # the prompt's last token
    step()
    assert remote.call("begin", rid, engine.requests[rid].prompt_token_ids)
    max_stages = 0 if mode == "stop-and-copy" else 3
    t0 = time.perf_counter()
    stats = LiveMigration(engine, rid, remote, final_stage_blocks=final_stage_blocks, max_stages=max_stages,
                          progress=transport.progress, lease=Lease.start(*LEASE)).run(step)
    total = time.perf_counter() - t0
    if rid in engine.requests:
        engine.abort_request(rid)
    step_s = statistics.median(step_times)
    return dict(num_tokens=num_tokens, mode=mode, outcome=stats.outcome, downtime_ms=1000 * stats.downtime_s,
                downtime_steps=stats.downtime_s / step_s, step_ms=1000 * step_s, num_stages=stats.num_stages,
                stage_blocks=stats.stage_blocks, num_blocks_read=stats.num_blocks_read, bytes=stats.num_bytes,
                migration_s=total, source_steps_during=len(step_times) - 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench migration", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192", help="sequence lengths in tokens")
    p.add_argument("--shape", default="llama-3.2-1b", help="a shape of `pagefleet bench decode`")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--final-stage-blocks", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="runs per length and mode (the median is kept)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    import torch

    from pagefleet import Engine
    from pagefleet.worker.kv_transfer import NixlTransport, PoolHandle

    from .decode import write_shape

    lengths = int_list(args.lengths)
    num_blocks = (max(lengths) + 128) // args.block_size + 8
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_shape(args.shape, Path(tmp) / args.shape))
        engine = Engine(model, device="cpu", dtype=args.dtype, load_format="dummy", block_size=args.block_size,
                        num_blocks=num_blocks, max_num_seqs=4, max_model_len=max(lengths) + 128,
                        enable_prefix_caching=False)
        transport = NixlTransport(args.shape)
        handle = transport.register(engine.kv_cache)
        layout = dict(block_size=args.block_size, num_layers=handle.layout.num_layers,
                      num_kv_heads=handle.layout.num_kv_heads, head_dim=handle.layout.head_dim, dtype=args.dtype)
        proc, conn, peer_handle = start_receiver(layout, num_blocks, args.shape)
        try:
            transport.connect(PoolHandle.from_dict(peer_handle))
            remote = RemoteReceiver(conn)
            _, path = remote.call("connect", transport.handle().to_dict())
            rows = []
            for n in lengths:
                for mode in ("multi-stage", "stop-and-copy"):
                    runs = [measure(engine, transport, remote, num_tokens=n, mode=mode,
                                    final_stage_blocks=args.final_stage_blocks) for _ in range(args.repeat)]
                    row = sorted(runs, key=lambda r: r["downtime_ms"])[len(runs) // 2]
                    rows.append(row)
                    print(f"{n:>6} {mode:<14} {row['outcome']:<9} downtime {row['downtime_ms']:8.1f} ms "
                          f"({row['downtime_steps']:.2f} steps of {row['step_ms']:.0f} ms)  stages {row['stage_blocks']}  "
                          f"{row['bytes'] / 2**20:.0f} MiB", flush=True)
            remote.conn.send(("stop",))
        finally:
            proc.kill()
    by = {(r["num_tokens"], r["mode"]): r for r in rows}
    lo, hi = min(lengths), max(lengths)
    ratio = by[(hi, "multi-stage")]["downtime_ms"] / max(by[(lo, "multi-stage")]["downtime_ms"], 1e-9)
    print(f"multi-stage downtime at {hi} / at {lo}: {ratio:.2f}x (target <= 1.2x); UCX path: {path}")
    out = header("migration", "pagefleet bench migration " + " ".join(argv or []), torch=torch.__version__,
                 threads=torch.get_num_threads())
    out.update(shape=args.shape, dtype=args.dtype, path=path, rows=rows, multi_stage_ratio=ratio)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0
