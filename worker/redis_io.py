"""The worker's writes to Redis: every step's messages for all its requests in one round trip.

The engine thread hands each step's messages, encoded (a ``StepWrite``), to
``OutputWriter.put`` straight after the step; a thread of the writer's own writes them in
order: one ``XADD`` to this worker's steps stream a step, whatever the number of requests
(``pagefleet.common.fencing``), on a blocking connection of its own
(``redis_lane.BlockingLane``) where the client allows one. No event loop is woken for a
step: a write costs the process a wake-up of this thread, one send and one receive, where the
event loop's queue, task switches and timers cost several times that. A step that finishes
requests goes through the finish script instead, which also checks that this worker still
owns each (its epoch) and makes each finish durable in one atomic step. When it falls behind,
the steps waiting are coalesced into one write (their bytes joined). A request whose finish
is refused (it was cancelled, or finished by the scheduler) is handed to ``on_refused``. A
write refused because the stream was fenced (this worker was declared dead) drops every
request the worker holds (``on_fenced``, run on the event loop) and goes on in a new stream.
With a Redis Cluster client (no lane) the thread writes through the client, on the event loop.

Bounds: at most ``max_backlog`` messages wait; past it ``has_room`` is cleared and the
engine thread waits before its next step (back-pressure while Redis is away: nothing is
dropped, nothing grows without bound). Connection loss: the same batch is retried with
backoff (a message written twice is harmless: the gateway places messages by index). Any
other error splits the batch: each request's messages are written alone, and a request
whose write still fails is failed visibly (``on_failed``), never silently dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable

import structlog

from pagefleet.common.fencing import Fenced, Fencing, is_fenced
from pagefleet.common.redis import Keys, retry_blocking
from pagefleet.common.redis_lane import LaneUnavailable, blocking_lane_for
from pagefleet.common.service import name_os_thread
from pagefleet.common.step_write import StepWrite

log = structlog.get_logger("worker.redis")

# Messages that may wait for Redis before the engine stops stepping.
MAX_BACKLOG = 50_000


async def _discard(discard: Callable[[], None]) -> None:
    discard()


class OutputWriter:
    def __init__(
        self,
        redis,
        keys: Keys,
        *,
        writer_id: str,
        on_refused: Callable[[str], None] = lambda rid: None,
        on_fenced: Callable[[Callable[[], None]], Awaitable[None]] | None = None,
        on_failed: Callable[[str, str], None] = lambda rid, error: None,
        max_backlog: int = MAX_BACKLOG,
        live: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        """Callbacks run on the writer's thread, ``on_refused``/``on_failed`` must be safe there (the
        engine loop's ``call`` is). ``on_fenced(discard)`` is awaited on the event loop: it drops
        what the engine holds and, at that moment, on the engine thread, calls ``discard``
        (``discard_pending``): nothing made before the drop is written, nothing made after it lost."""
        self.redis = redis
        self.keys = keys
        self.fencing = Fencing(redis, keys, writer_id)  # the client's path: used only without a lane
        self.lane = blocking_lane_for(redis)
        self.on_refused = on_refused
        self.on_fenced = on_fenced or _discard  # drops what the engine holds; done when it has
        self.on_failed = on_failed
        self.max_backlog = max_backlog
        self.live = live  # the requests the engine holds (the steps stream keeps their entries)
        self._pending: collections.deque[StepWrite] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._backlog = 0  # messages queued or being written
        self._busy = False  # the thread holds a batch
        self._stopping = False
        self._aio: asyncio.AbstractEventLoop | None = None
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
        """Queue one step's messages (from any thread; the engine's, straight after its step)."""
        if step.num_messages:
            with self._cond:
                self._pending.append(step)
                self._backlog += step.num_messages
                if self._backlog >= self.max_backlog:
                    self.has_room.clear()
                self._cond.notify()

    def probe(self) -> None:
        """Queue a check that this writer's stream is still its own, behind the writes queued:
        a worker declared dead while it had nothing to write learns it so (it drops what it
        holds and goes on in a new stream, as after a refused write), and is placed on again."""
        with self._cond:
            self._pending.append(StepWrite())
            self._cond.notify()

    def discard_pending(self) -> None:
        """Drop the steps waiting (any thread; see ``on_fenced``)."""
        with self._cond:
            while self._pending:
                self._backlog -= self._pending.popleft().num_messages
            if self._backlog < self.max_backlog:
                self.has_room.set()

    async def flush(self) -> None:
        """Return once everything queued so far is in Redis."""
        while self._pending or self._busy:
            await asyncio.sleep(0.002)

    async def run(self) -> None:
        """Write, on the writer's thread, until cancelled."""
        self._aio = asyncio.get_running_loop()
        context = contextvars.copy_context()  # the worker's bound log fields (worker_id)
        thread = threading.Thread(target=context.run, args=(self._run,), name="output-writer", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify()

    # -- the writer's thread ------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("output-writer")
        try:
            while True:
                try:
                    if not self._one():
                        return
                except Exception:  # a bug: the writer must go on, or the engine stalls at its bound
                    log.exception("outputs.writer_error")
                    with self._cond:
                        self._busy = False
        finally:
            if self.lane is not None:
                self.lane.close()

    def _one(self) -> bool:
        """Write what is pending (one batch); False once stopping."""
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return False
            self._busy = True  # before the queue empties: ``flush`` reads both without the lock
            batch = self._pending.popleft()
            while self._pending:
                batch.extend(self._pending.popleft())
        try:
            if not batch.num_messages:
                self._probe()
            else:
                try:
                    self._write_batch(batch)
                except Exception:  # a bug here must not stop the writer: fail the batch's requests
                    log.exception("outputs.write_failed", num_messages=batch.num_messages)
                    for rid in batch.request_ids():
                        self.on_failed(rid, "the worker could not write this request's output")
                self.num_round_trips += 1  # the worker's pagefleet:worker_output_writes_total, when scraped
        finally:
            with self._cond:
                self._backlog -= batch.num_messages
                if self._backlog < self.max_backlog and not self.has_room.is_set():
                    self.has_room.set()
                self._busy = False
        return True

    def _on_loop(self, coro: Coroutine):
        """Run ``coro`` on the event loop and wait for its result (from the writer's thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._aio).result()

    def _write(self, step: StepWrite, live=None) -> list[bool]:
        if self.lane is not None:
            try:
                return self.fencing.write_step_blocking(step, self.lane, live)
            except LaneUnavailable:
                self.lane = None
        return self._on_loop(self.fencing.write_step(step, live))

    def _write_batch(self, batch: StepWrite) -> None:
        try:
            accepted = retry_blocking(lambda: self._write(batch, self.live), what="write_outputs",
                                      stop=lambda: self._stopping)
        except Fenced:
            log.warning("outputs.refused", fenced=True, steps=self.fencing.steps_key, num_messages=batch.num_messages)
            self._fenced()
            return
        except Exception as e:  # not a connection blip: find the requests it is about
            log.warning("outputs.batch_failed", num_messages=batch.num_messages, error=str(e))
            refused = self._write_alone(batch)
        else:
            refused = {f.request_id for f, ok in zip(batch.finals, accepted, strict=True) if not ok}
        for rid in refused:
            self.num_refused += 1
            log.warning("outputs.refused", request_id=rid)
            self.on_refused(rid)

    def _fenced(self) -> None:
        """Declared dead: every request here is being resumed elsewhere after what this
        stream holds. Drop them all and write nothing of theirs, not even what steps run
        before the engine dropped them made: those waiting are discarded as it drops them
        (``on_fenced``; the engine thread queues a step's messages before it runs the next
        command). Then go on in a new stream: what was made since goes there."""
        self.num_fenced += 1

        async def drop() -> None:  # on the event loop, where ``on_fenced`` makes its awaitable
            await self.on_fenced(self.discard_pending)

        self._on_loop(drop())
        self.fencing.new_incarnation()
        self._on_loop(self.fencing.publish_stream())

    def _probe(self) -> None:
        try:
            fenced = self._on_loop(is_fenced(self.redis, self.fencing.steps_key))
        except Exception as e:  # Redis away for good: the next write will say
            log.warning("outputs.probe_failed", error=str(e))
            return
        if fenced:
            log.warning("outputs.refused", fenced=True, steps=self.fencing.steps_key, num_messages=0)
            self._fenced()

    def _write_alone(self, batch: StepWrite) -> set[str]:
        """Each request's messages in their own round trip; the requests whose finish was refused."""
        refused: set[str] = set()
        for rid, alone in batch.split().items():
            try:
                oks = retry_blocking(lambda alone=alone: self._write(alone), what="write_outputs",
                                     stop=lambda: self._stopping)
            except Fenced:
                raise
            except Exception as e:
                log.error("outputs.request_failed", request_id=rid, error=str(e))
                self.on_failed(rid, f"the worker could not write this request's output: {e}")
                continue
            if not all(oks):
                refused.add(rid)
        return refused
