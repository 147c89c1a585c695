"""The worker's writes to Redis: every step's new tokens for all requests in one round trip.

The engine thread hands each step's messages to ``OutputWriter.put`` (on the event loop);
one task writes them in order, one script call a step for all its requests (and one entry
in this worker's steps stream, which the gateways relay from). When it falls behind, the
steps waiting are coalesced into one call. Every message goes through the fenced write
(``pagefleet.common.fencing``):
it lands only while this worker's epoch is still the request's, and a request's last
message, its acknowledgement and its "done" record are one atomic step. A request whose
write is refused (it was moved or cancelled) is handed to ``on_refused`` at once so the
engine drops it and frees its blocks.

Bounds: at most ``max_backlog`` messages wait; past it ``has_room`` is cleared and the
engine thread waits before its next step (back-pressure while Redis is away: nothing is
dropped, nothing grows without bound). Connection loss: the same batch is retried with
backoff (a message written twice is harmless: the gateway places messages by index). Any
other error splits the batch: each request's messages are written alone, and a request
whose write still fails is failed visibly (``on_failed``), never silently dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pagefleet.common.fencing import Fencing, Write
from pagefleet.common.redis import Keys, OutEntry, retry

log = structlog.get_logger("worker.redis")

# Messages that may wait for Redis before the engine stops stepping.
MAX_BACKLOG = 50_000


@dataclass(slots=True)
class Emit:
    """One message for a request's output stream, written under ``epoch``; ``entry_id`` set:
    acknowledge the request's entry in the requests stream too (its last message)."""

    request_id: str
    entry: OutEntry
    entry_id: str | None = None
    epoch: int = 0
    refresh_ttl: bool = True  # (re)set the request's TTLs with this message

    def write(self) -> Write:
        return Write(self.request_id, self.epoch, self.entry, self.entry_id or "", self.refresh_ttl)


class OutputWriter:
    def __init__(
        self,
        redis,
        keys: Keys,
        *,
        writer_id: str,
        on_refused: Callable[[str], None] = lambda rid: None,
        on_failed: Callable[[str, str], None] = lambda rid, error: None,
        max_backlog: int = MAX_BACKLOG,
        on_written: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.fencing = Fencing(redis, keys, writer_id)
        self.on_refused = on_refused
        self.on_failed = on_failed
        self.max_backlog = max_backlog
        self.on_written = on_written  # told of every round trip (a metric)
        self._queue: asyncio.Queue[list[Emit]] = asyncio.Queue()
        self._backlog = 0  # messages queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        # Set while the backlog is under its bound; the engine thread waits on it.
        self.has_room = threading.Event()
        self.has_room.set()
        self.num_round_trips = 0
        self.num_refused = 0

    @property
    def backlog(self) -> int:
        return self._backlog

    def put(self, batch: list[Emit]) -> None:
        """Queue one step's messages (call on the event loop thread)."""
        if batch:
            self._idle.clear()
            self._backlog += len(batch)
            if self._backlog >= self.max_backlog:
                self.has_room.clear()
            self._queue.put_nowait(batch)

    async def flush(self) -> None:
        """Return once everything queued so far is in Redis."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            batch = await self._queue.get()
            while not self._queue.empty():
                batch.extend(self._queue.get_nowait())
            try:
                await self._write_batch(batch)
            except Exception:  # a bug here must not stop the writer: fail the batch's requests
                log.exception("outputs.write_failed", num_messages=len(batch))
                for rid in {e.request_id for e in batch}:
                    self.on_failed(rid, "the worker could not write this request's output")
            self.num_round_trips += 1
            self.on_written()
            self._backlog -= len(batch)
            if self._backlog < self.max_backlog:
                self.has_room.set()
            if self._queue.empty():
                self._idle.set()

    async def _write_batch(self, batch: list[Emit]) -> None:
        try:
            accepted = await retry(lambda: self.fencing.write([e.write() for e in batch]), what="write_outputs")
        except Exception as e:  # not a connection blip: find the requests it is about
            log.warning("outputs.batch_failed", num_messages=len(batch), error=str(e))
            accepted = await self._write_alone(batch)
        refused = {e.request_id for e, ok in zip(batch, accepted, strict=True) if ok is False}
        for rid in refused:
            self.num_refused += 1
            log.warning("outputs.refused", request_id=rid)
            self.on_refused(rid)

    async def _write_alone(self, batch: list[Emit]) -> list[bool | None]:
        """Each request's messages in their own round trip; None where the write failed."""
        by_request: dict[str, list[int]] = {}
        for i, e in enumerate(batch):
            by_request.setdefault(e.request_id, []).append(i)
        result: list[bool | None] = [None] * len(batch)
        for rid, idx in by_request.items():
            try:
                oks = await retry(lambda idx=idx: self.fencing.write([batch[i].write() for i in idx]),
                                  what="write_outputs")
            except Exception as e:
                log.error("outputs.request_failed", request_id=rid, error=str(e))
                self.on_failed(rid, f"the worker could not write this request's output: {e}")
                continue
            for i, ok in zip(idx, oks, strict=True):
                result[i] = ok
        return result
