"""The worker's writes to Redis: every step's new tokens for all requests in one round trip.

The engine thread hands each step's messages to ``OutputWriter.put`` (on the event loop);
one task writes them in order. When it falls behind, the steps waiting are coalesced into
one pipeline. A request's last message, its acknowledgement in the requests stream and
the deletion of its entry go in the same round trip, so a request is acknowledged only
once its output is complete. Connection loss: the same batch is retried with backoff
(a message written twice is harmless: the gateway places messages by index).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from pagefleet.common.redis import GROUP, OUT_TTL_ACTIVE_S, OUT_TTL_DONE_S, Keys, OutEntry, retry

log = structlog.get_logger("worker.redis")



@dataclass(slots=True)
class Emit:
    """One message for a request's output stream; ``entry_id`` set: acknowledge it too."""

    request_id: str
    entry: OutEntry
    entry_id: str | None = None


class OutputWriter:
    def __init__(self, redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._queue: asyncio.Queue[list[Emit]] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_round_trips = 0

    def put(self, batch: list[Emit]) -> None:
        """Queue one step's messages (call on the event loop thread)."""
        if batch:
            self._idle.clear()
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
                await retry(lambda b=batch: self._write(b), what="write_outputs")
            except Exception:  # not a connection blip (those are retried): never stop the writer
                log.exception("outputs.write_failed", num_messages=len(batch))
            self.num_round_trips += 1
            if self._queue.empty():
                self._idle.set()

    async def _write(self, batch: list[Emit]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for e in batch:
            key = self.keys.out(e.request_id)
            pipe.xadd(key, e.entry.encode())
            if e.entry.finish_reason:
                pipe.expire(key, OUT_TTL_DONE_S)
            else:
                pipe.expire(key, OUT_TTL_ACTIVE_S)
            if e.entry_id:
                pipe.xack(self.keys.requests, GROUP, e.entry_id)
                pipe.xdel(self.keys.requests, e.entry_id)
        await pipe.execute()
