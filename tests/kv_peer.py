"""A migration peer in its own process, for the cross-process tests of KV transfer.

The control messages go over a ``multiprocessing`` pipe here (the blocks over NIXL, as
between workers); ``RemoteReceiver`` (``pagefleet bench migration``'s) is the source's face
of a ``MigrationReceiver`` that lives in the child. The child runs the tiny model on CPU and answers one command at a
time, calling its transport's ``progress`` and its engine's ``step`` between them.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from pagefleet.benchmarks.migration import RemoteReceiver

__all__ = ["RemoteReceiver", "start_receiver", "start_source", "wait_for"]


def _engine():
    from pagefleet import Engine

    return Engine("tiny", device="cpu", block_size=16, num_blocks=64)


def receiver_main(conn) -> None:
    """The child: an engine, a registered pool, one migration in at a time; after a commit
    it finishes the request and sends its output tokens (by index)."""
    from pagefleet.worker.kv_transfer import NixlTransport, PoolHandle
    from pagefleet.worker.migration import Lease, MigrationReceiver

    engine, transport = _engine(), NixlTransport("tiny")
    conn.send(transport.register(engine.kv_cache).to_dict())
    recv, peer, tokens, rid = None, None, {}, None
    while True:
        transport.progress()
        busy = recv is not None and recv.pump()
        if engine.has_unfinished_requests():
            for d in engine.step():
                tokens.update({d.index + i: t for i, t in enumerate(d.token_ids)})
                if d.finish_reason:
                    conn.send(("tokens", tokens))
        if not conn.poll(0 if busy else 0.001):
            continue
        cmd, *args = conn.recv()
        if cmd == "connect":
            peer = transport.connect(PoolHandle.from_dict(args[0]))
            conn.send(peer)
        elif cmd == "begin":
            rid = args[0]
            recv = MigrationReceiver(engine, transport, peer, rid, args[1], lease=Lease.start(30, 2))
            conn.send(True)
        elif cmd == "read":
            conn.send(recv.read(*args))
        elif cmd == "poll":
            conn.send(recv.poll())
        elif cmd == "commit":
            conn.send(recv.commit(args[0]))
        elif cmd == "abort":
            recv.abort()
            conn.send(True)
        elif cmd == "free":
            conn.send((engine.kv.num_free_blocks, engine.kv.num_blocks))
        elif cmd == "stop":
            return


def start_receiver():
    """The child process, its pipe and its pool handle (a dict)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child,), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise TimeoutError("the receiver process did not start")
    return proc, parent, parent.recv()


def wait_for(conn, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            msg = conn.recv()
            if msg[0] == what:
                return msg[1]
    raise TimeoutError(f"no {what!r} from the peer")


def source_main(conn, prompt, params, after: int) -> None:
    """The child as a source: runs the request ``after`` tokens, offers its full blocks as a
    stage (``("stage", handle, block_ids, output_token_ids)``), then keeps decoding until killed."""
    from pagefleet.worker.kv_transfer import NixlTransport

    engine, transport = _engine(), NixlTransport("tiny")
    handle = transport.register(engine.kv_cache).to_dict()
    rid = engine.add_request(prompt, params, request_id="s")
    req = engine.requests[rid]
    while req.num_output_tokens < after:
        engine.step()
    full = req.num_computed_tokens // engine.block_size
    conn.send(("stage", handle, engine.kv.block_tables[rid][:full], list(req.output_token_ids)))
    while True:
        transport.progress()
        time.sleep(0.001)


def start_source(prompt, params, after: int):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child, prompt, params, after), daemon=True)
    proc.start()
    return proc, parent
