"""The scheduler's Assigns on one long-lived stream a worker (``scheduler/assign_stream.py``),
against a real grpc.aio server: each batch gets its own answer under concurrent senders, a
worker that stops answering or goes away fails the batches waiting (as a failed call did) and
the next batch opens a new call, and a worker that does not serve the stream is sent unary calls."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pagefleet.protos import cluster_pb2, cluster_pb2_grpc
from pagefleet.scheduler.assign_stream import AssignStream, NotServed


class _Worker(cluster_pb2_grpc.WorkerServicer):
    """Accepts a request whose id ends in an even digit; ``hold``: answers nothing while set."""

    def __init__(self) -> None:
        self.hold = False
        self.calls = 0

    async def AssignStream(self, request_iterator, context):
        self.calls += 1
        async for batch in request_iterator:
            while self.hold:
                await asyncio.sleep(0.01)
            yield cluster_pb2.AssignBatchResponse(responses=[
                cluster_pb2.AssignResponse(accepted=int(r.request_id[-1]) % 2 == 0) for r in batch.requests])


class _OldWorker(cluster_pb2_grpc.WorkerServicer):
    async def AssignBatch(self, request, context):
        return cluster_pb2.AssignBatchResponse(responses=[cluster_pb2.AssignResponse(accepted=True)
                                                          for _ in request.requests])


@contextlib.asynccontextmanager
async def _serving(servicer):
    """``(channel, stub)`` of a grpc.aio server running ``servicer``; both closed after, whatever happened."""
    server = grpc.aio.server()
    cluster_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, cluster_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def _batch(*ids: str) -> cluster_pb2.AssignBatchRequest:
    return cluster_pb2.AssignBatchRequest(requests=[cluster_pb2.AssignRequest(request_id=i) for i in ids])


def test_each_batch_gets_its_own_answer_on_one_call():
    async def go():
        worker = _Worker()
        async with _serving(worker) as (_, stub):
            s = AssignStream(stub, timeout_s=10)
            ids = [[f"r{i}-{j}" for j in range(i % 3 + 1)] for i in range(40)]
            answers = await asyncio.gather(*(s.send(_batch(*batch)) for batch in ids))
            for batch, answer in zip(ids, answers, strict=True):
                assert [a.accepted for a in answer.responses] == [int(i[-1]) % 2 == 0 for i in batch]
            assert worker.calls == 1
            s.close()

    asyncio.run(go())


def test_a_worker_that_stops_answering_fails_the_waiting_batches_and_the_next_opens_a_new_call():
    async def go():
        worker = _Worker()
        async with _serving(worker) as (_, stub):
            s = AssignStream(stub, timeout_s=0.3)
            assert (await s.send(_batch("a0"))).responses[0].accepted
            worker.hold = True
            results = await asyncio.gather(s.send(_batch("b0")), s.send(_batch("b2")), return_exceptions=True)
            assert all(isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                       for r in results)
            worker.hold = False
            assert [r.accepted for r in (await s.send(_batch("c1", "c2"))).responses] == [False, True]
            assert worker.calls == 2
            s.close()

    asyncio.run(go())


def test_a_worker_that_goes_away_fails_the_waiting_batches_as_a_call_did():
    async def go():
        worker = _Worker()
        async with _serving(worker) as (channel, stub):
            s = AssignStream(stub, timeout_s=30)
            await s.send(_batch("a0"))
            worker.hold = True
            waiting = asyncio.ensure_future(s.send(_batch("b0")))
            await asyncio.sleep(0.1)
            await channel.close()  # as the scheduler does when it declares the worker dead
            with pytest.raises(grpc.RpcError):
                await asyncio.wait_for(waiting, 5)

    asyncio.run(go())


def test_a_worker_that_does_not_serve_the_stream_is_sent_calls():
    async def go():
        async with _serving(_OldWorker()) as (_, stub):
            s = AssignStream(stub, timeout_s=10)
            with pytest.raises(NotServed):
                await s.send(_batch("a0"))
            assert not s.served
            with pytest.raises(NotServed):  # not asked again
                await s.send(_batch("a1"))

    asyncio.run(go())
