"""The worker's writes to Redis: every step's messages for all its requests in one round trip.

The engine thread hands each step's messages, encoded (a ``StepWrite``), to
``OutputWriter.put`` (on the event loop); one task writes them in order: one ``XADD`` to
this worker's steps stream a step, whatever the number of requests
(``pagefleet.common.fencing``), on a connection of this writer's own (``redis_lane``) where
the client allows one; a step that finishes requests goes
through the finish script instead, which also checks that this worker still owns each
(its epoch) and makes each finish durable in one atomic step. When it falls behind, the
steps waiting are coalesced into one write (their bytes joined). A request whose finish is refused (it was
cancelled, or finished by the scheduler) is handed to ``on_refused``. A write refused
because the stream was fenced (this worker was declared dead) drops every request the
worker holds (``on_fenced``) and goes on in a new stream.

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
from collections.abc import Awaitable, Callable, Iterable

import structlog

from pagefleet.common.fencing import Fenced, Fencing, is_fenced
from pagefleet.common.redis import Keys, retry
from pagefleet.common.redis_lane import lane_for
from pagefleet.common.step_write import StepWrite

log = structlog.get_logger("worker.redis")

# Messages that may wait for Redis before the engine stops stepping.
MAX_BACKLOG = 50_000


async def _nothing() -> None:
    return None


class OutputWriter:
    def __init__(
        self,
        redis,
        keys: Keys,
        *,
        writer_id: str,
        on_refused: Callable[[str], None] = lambda rid: None,
        on_fenced: Callable[[], Awaitable[None]] | None = None,
        on_failed: Callable[[str, str], None] = lambda rid, error: None,
        max_backlog: int = MAX_BACKLOG,
        on_written: Callable[[], None] = lambda: None,
        live: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.fencing = Fencing(redis, keys, writer_id, lane=lane_for(redis))
        self.on_refused = on_refused
        self.on_fenced = on_fenced or _nothing  # drops what the engine holds; done when it has
        self.on_failed = on_failed
        self.max_backlog = max_backlog
        self.on_written = on_written  # told of every round trip (a metric)
        self.live = live  # the requests the engine holds (the steps stream keeps their entries)
        self._queue: asyncio.Queue[StepWrite] = asyncio.Queue()
        self._backlog = 0  # messages queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        # Set while the backlog is under its bound; the engine thread waits on it.
        self.has_room = threading.Event()
        self.has_room.set()
        self.num_round_trips = 0
        self.num_refused = 0
        self.num_fenced = 0

    @property
    def backlog(self) -> int:
        return self._backlog

    def put(self, step: StepWrite) -> None:
        """Queue one step's messages (call on the event loop thread)."""
        if step.num_messages:
            self._idle.clear()
            self._backlog += step.num_messages
            if self._backlog >= self.max_backlog:
                self.has_room.clear()
            self._queue.put_nowait(step)

    def probe(self) -> None:
        """Queue a check that this writer's stream is still its own (call on the event loop),
        behind the writes queued: a worker declared dead while it had nothing to write learns
        it so (it drops what it holds and goes on in a new stream, as after a refused write),
        and is placed on again."""
        self._idle.clear()
        self._queue.put_nowait(StepWrite())

    async def flush(self) -> None:
        """Return once everything queued so far is in Redis."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            batch = await self._queue.get()
            while not self._queue.empty():
                batch.extend(self._queue.get_nowait())
            if not batch.num_messages:
                await self._probe()
            else:
                try:
                    await self._write_batch(batch)
                except Exception:  # a bug here must not stop the writer: fail the batch's requests
                    log.exception("outputs.write_failed", num_messages=batch.num_messages)
                    for rid in batch.request_ids():
                        self.on_failed(rid, "the worker could not write this request's output")
                self.num_round_trips += 1
                self.on_written()
                self._backlog -= batch.num_messages
            if self._backlog < self.max_backlog:
                self.has_room.set()
            if self._queue.empty():
                self._idle.set()

    async def _write_batch(self, batch: StepWrite) -> None:
        try:
            accepted = await retry(lambda: self.fencing.write_step(batch, self.live),
                                  what="write_outputs")
        except Fenced:
            log.warning("outputs.refused", fenced=True, steps=self.fencing.steps_key, num_messages=batch.num_messages)
            await self._fenced()
            return
        except Exception as e:  # not a connection blip: find the requests it is about
            log.warning("outputs.batch_failed", num_messages=batch.num_messages, error=str(e))
            refused = await self._write_alone(batch)
        else:
            refused = {f.request_id for f, ok in zip(batch.finals, accepted, strict=True) if not ok}
        for rid in refused:
            self.num_refused += 1
            log.warning("outputs.refused", request_id=rid)
            self.on_refused(rid)

    async def _fenced(self) -> None:
        """Declared dead: every request here is being resumed elsewhere after what this
        stream holds. Drop them all and write nothing of theirs, not even what steps run
        before the engine dropped them made: those waiting here now are discarded once it
        has (a step's messages are queued before a command after it completes). Then go on
        in a new stream."""
        self.num_fenced += 1
        await self.on_fenced()
        while not self._queue.empty():
            self._backlog -= self._queue.get_nowait().num_messages
        self.fencing.new_incarnation()
        await self.fencing.publish_stream()

    async def _probe(self) -> None:
        try:
            fenced = await is_fenced(self.redis, self.fencing.steps_key)
        except Exception as e:  # Redis away for good: the next write will say
            log.warning("outputs.probe_failed", error=str(e))
            return
        if fenced:
            log.warning("outputs.refused", fenced=True, steps=self.fencing.steps_key, num_messages=0)
            await self._fenced()

    async def _write_alone(self, batch: StepWrite) -> set[str]:
        """Each request's messages in their own round trip; the requests whose finish was refused."""
        refused: set[str] = set()
        for rid, alone in batch.split().items():
            try:
                oks = await retry(lambda alone=alone: self.fencing.write_step(alone), what="write_outputs")
            except Fenced:
                raise
            except Exception as e:
                log.error("outputs.request_failed", request_id=rid, error=str(e))
                self.on_failed(rid, f"the worker could not write this request's output: {e}")
                continue
            if not all(oks):
                refused.add(rid)
        return refused
