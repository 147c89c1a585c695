"""A worker's Assigns as messages on one long-lived call (``Worker.AssignStream``), not a call each.

A unary call costs grpc.aio a call's set-up and tear-down on both sides: ~210 µs of the
scheduler's CPU and ~345 µs of the worker's a call on this machine, against ~150 and ~145 for
a message written and answered on a stream that stays open (a trivial servicer, the same
messages). The scheduler keeps one ``AssignStream`` a worker: ``send`` writes one
``AssignBatchRequest`` and returns its response; the worker answers each message in order,
one response a message, so responses are matched to their batches by order.

Failure is what a failed unary call was: the call breaking (the worker gone, its channel
closed when it is declared dead), or a response not back within ``timeout_s``, fails every
batch waiting on it with a ``grpc.RpcError`` (the caller declares the worker dead, as before),
and the next ``send`` opens a new call. A worker that does not serve the stream (an older one:
``UNIMPLEMENTED``) raises ``NotServed`` at once, before taking anything, and is not asked again
(nor is a stub without the method). A request's trace context travels in its own
``traceparent`` (there is no call a request).
"""

from __future__ import annotations

import asyncio
import collections

import grpc

from pagefleet.protos import cluster_pb2


class NotServed(Exception):
    """The worker does not serve ``AssignStream``: send its Assigns as unary calls."""


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class AssignStream:
    def __init__(self, stub, timeout_s: float) -> None:
        """``stub``: the worker's ``WorkerStub``; ``timeout_s``: how long a batch may wait for its answer."""
        self.stub = stub
        self.timeout_s = timeout_s
        self.served = hasattr(stub, "AssignStream")  # False once the worker said UNIMPLEMENTED
        self._call = None
        self._reader: asyncio.Task | None = None
        self._waiting: collections.deque[asyncio.Future] = collections.deque()  # in the order written
        self._writing = asyncio.Lock()  # one write at a time, its future queued with it

    async def send(self, batch: cluster_pb2.AssignBatchRequest) -> cluster_pb2.AssignBatchResponse:
        """``batch``'s response; a ``grpc.RpcError`` if the call broke or the answer did not come
        within ``timeout_s``; ``NotServed`` if the worker does not serve the stream."""
        if not self.served:
            raise NotServed()
        fut = asyncio.get_running_loop().create_future()
        async with self._writing:
            call = self._call or self._open()
            self._waiting.append(fut)
            try:
                await call.write(batch)
            except (grpc.RpcError, asyncio.InvalidStateError) as e:  # broken: the reader fails the rest
                self._broken(call, e if isinstance(e, grpc.RpcError) else
                             _error(grpc.StatusCode.UNAVAILABLE, f"assign stream: {e}"))
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this sender is cancelled
                # The call was cancelled under the write (broken by another batch or the reader):
                # this batch fails as the call's others do, not as a cancelled sender.
                self._broken(call, _error(grpc.StatusCode.CANCELLED, "assign stream closed"))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            error = _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to an Assign in {self.timeout_s} s")
            self._broken(call, error)
            raise error from None

    def close(self) -> None:
        """End the call (batches waiting fail as cancelled)."""
        if self._call is not None:
            self._broken(self._call, _error(grpc.StatusCode.CANCELLED, "assign stream closed"))

    def _open(self):
        self._call = call = self.stub.AssignStream()
        self._reader = asyncio.ensure_future(self._read(call))
        return call

    async def _read(self, call) -> None:
        try:
            async for response in call:
                if call is not self._call or not self._waiting:
                    break  # broken meanwhile (its batches failed), or an answer to nothing asked
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.set_result(response)
            error = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended the assign stream")
        except grpc.RpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "assign stream closed")
        if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.served = False
            error = NotServed()
        self._broken(call, error)

    def _broken(self, call, error: BaseException) -> None:
        """``call`` is done with: every batch waiting on it fails with ``error``."""
        if call is not self._call:
            return
        self._call = None
        waiting, self._waiting = self._waiting, collections.deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: a batch whose sender timed out leaves no warning
        call.cancel()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
