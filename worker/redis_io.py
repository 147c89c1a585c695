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

The engine thread sends a step itself when nothing waits before it (``put``): the step's
commands go out in one non-blocking write on the lane, and the replies are read, without
waiting, when it sends the next step; so on the common path no thread is woken for a write
and the engine never waits on Redis. Replies still owed when the engine goes idle (``idle``),
or ``SETTLE_AFTER_S`` after its last send, are read by the writer's thread. A step whose
replies hold an error, and every step in flight when the connection breaks, goes back to the
front of the queue: the writer's thread writes it again by the path above (retries, the
finish script reloaded, a fenced stream, errors request by request). A write sent twice is
harmless, as above.

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
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass

import redis.exceptions as rx
import structlog

from pagefleet.common.fencing import Fenced, Fencing, is_fenced, lane_replies
from pagefleet.common.redis import Keys, retry_blocking
from pagefleet.common.redis_lane import LaneUnavailable, blocking_lane_for
from pagefleet.common.service import name_os_thread
from pagefleet.common.step_write import StepWrite

log = structlog.get_logger("worker.redis")

# Messages that may wait for Redis before the engine stops stepping.
MAX_BACKLOG = 50_000
# Steps the engine thread may have sent whose replies are not read yet; past it, the next
# step goes to the writer's thread (which reads them first).
MAX_IN_FLIGHT = 16
# Replies owed this long after the engine's last send are read by the writer's thread (at
# once when the engine says it is idle: ``idle``).
SETTLE_AFTER_S = 0.5


@dataclass(slots=True)
class _Sent:
    """A step the engine thread sent on the lane: how many replies it is owed, and which one
    appends it (``Fencing.step_packed``)."""

    step: StepWrite
    num_replies: int
    main: int


async def _discard(discard: Callable[[], None]) -> None:
    discard()


class OutputWriter:
    def __init__(
        self,
        redis,
        keys: Keys,
        *,
        writer_id: str,
        on_refused: Callable[[str, int], None] = lambda rid, epoch: None,
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
        # The lane's user: the engine thread (a step sent directly) or the writer's.
        self._lane_lock = threading.Lock()
        self._in_flight: collections.deque[_Sent] = collections.deque()  # sent, replies not all read
        self._replies: list = []  # the oldest step in flight's, read so far
        self._unsent = b""  # what the socket did not take of the last direct send
        self._num_back = 0  # steps at the queue's front that were sent and go again (``_back``)
        self._sent_at = 0.0  # of the last direct send (time.monotonic)
        self.num_direct = 0  # steps the engine thread sent itself
        self._idle = False  # the writer's thread waits on the queue alone, no replies owed
        self._engine_idle = False  # the engine said it has no step to run (``idle``)

    @property
    def backlog(self) -> int:
        return self._backlog

    def put(self, step: StepWrite) -> None:
        """Send or queue one step's messages (from any thread; the engine's, straight after its
        step): sent on the calling thread when nothing waits before it and the lane is free,
        never waiting on Redis; queued for the writer's thread otherwise."""
        if step.num_messages:
            lock = self._lane_lock
            if self.lane is not None and lock.acquire(blocking=False):
                try:
                    if self._send_direct(step):
                        return
                except Exception:  # a bug: the engine thread goes on, the writer's thread writes it all again
                    log.exception("outputs.direct_send_failed")
                    sent = any(s.step is step for s in self._in_flight)
                    self._resend_in_flight()
                    if sent:
                        return
                finally:
                    lock.release()
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
            self._num_back = 0
            while self._pending:
                self._backlog -= self._pending.popleft().num_messages
            if self._backlog < self.max_backlog:
                self.has_room.set()

    async def flush(self) -> None:
        """Return once everything queued or sent so far is in Redis, its replies read (or
        dropped: a fenced stream's, a request failed visibly)."""
        while self._backlog or self._pending or self._busy or self._in_flight or self._unsent:
            self.idle()  # replies owed to the engine's sends: read now, not at its next step
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
            with self._lane_lock:
                if self.lane is not None:
                    self.lane.close()

    def idle(self) -> None:
        """The engine thread has no step to run: the writer's thread reads the replies its
        sends are still owed (it would come back for them at its next step)."""
        if self._in_flight and not self._engine_idle:
            with self._cond:
                self._engine_idle = True
                self._cond.notify()

    def _owed(self) -> bool:
        """Replies the engine thread left owed: bytes it could not send, or replies it will not
        come back for soon (it is idle, waits for room, or has sent nothing for ``SETTLE_AFTER_S``)."""
        return bool(self._unsent) or bool(self._in_flight) and (
            self._engine_idle or not self.has_room.is_set() or time.monotonic() - self._sent_at >= SETTLE_AFTER_S)

    def _one(self) -> bool:
        """Read the replies owed to steps the engine sent, then write what is pending (one
        batch); False once stopping."""
        with self._cond:
            while not self._pending and not self._stopping and not self._owed():
                timed = bool(self._in_flight)
                self._idle = not timed  # a direct send wakes it (see _send_direct)
                self._cond.wait(SETTLE_AFTER_S if timed else None)
            self._idle = False
            if self._stopping:
                return False
        with self._lane_lock:
            self._engine_idle = False
            if self._in_flight or self._unsent:
                self._settle(block=True)  # a step that must be written again goes to the queue's front
            with self._cond:
                if not self._pending:
                    return True
                self._busy = True  # before the queue empties: ``flush`` reads both without the lock
                self._num_back = 0
                batch = self._pending.popleft()
                while self._pending:
                    batch.extend(self._pending.popleft())
            self._write_held(batch)
        return True

    def _write_held(self, batch: StepWrite) -> None:
        """Write ``batch`` (the lane held) and count it out of the backlog."""
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

    # -- steps the engine thread sends (the lane held) ----------------------------------
    def _send_direct(self, step: StepWrite) -> bool:
        """Send ``step`` on the calling thread if nothing waits before it: first the replies
        that have come are settled (``_settle``), then its commands go out in one write that
        does not wait. False: nothing was sent (queue it for the writer's thread)."""
        lane = self.lane
        if (lane is None or self._unsent or self._busy or self._stopping or not lane.direct
                or len(self._in_flight) >= MAX_IN_FLIGHT):
            return False
        if not self._settle(block=False) or self._pending or not lane.direct:
            return False  # a step goes back to the writer's thread, or the connection broke: queue behind it
        data, num_replies, main = self.fencing.step_packed(step, self.live)
        self._sent_at = time.monotonic()
        with self._cond:
            self._engine_idle = False
            self._backlog += step.num_messages
            self._in_flight.append(_Sent(step, num_replies, main))
            if self._backlog >= self.max_backlog:  # the engine waits for room: the writer's thread reads
                self.has_room.clear()
                self._cond.notify()
            elif self._idle:  # waiting for nothing but the queue: it reads these replies if the engine does not
                self._cond.notify()
        self.num_direct += 1
        try:
            n = lane.send_nowait(data)
        except rx.ConnectionError:
            self._resend_in_flight()
            return True
        if n < len(data):  # the socket is full: the writer's thread sends the rest, then reads
            with self._cond:
                self._unsent = data[n:]
                self._cond.notify()
        return True

    def _settle(self, block: bool) -> bool:
        """Read the replies owed to the steps in flight (``block``: all of them, waiting as long
        as the lane does; else those that have come) and settle each step: its refused finals
        to ``on_refused``, its messages out of the backlog. A step whose replies hold an error,
        and every step in flight when the connection broke, goes back to the queue's front
        (``_back``). Whether none went back."""
        lane, in_flight, back = self.lane, self._in_flight, []
        try:
            if self._unsent:
                lane.send_rest(self._unsent)
                self._unsent = b""
            while in_flight:
                sent, replies = in_flight[0], self._replies
                while len(replies) < sent.num_replies:
                    r = lane.reply() if block else lane.reply_nowait()
                    if r is False:
                        return self._back(back)
                    replies.append(r)
                replies = lane_replies(replies)
                if any(isinstance(r, Exception) for r in replies):
                    back.append(sent.step)  # fenced, the script lost, ...: the writer's path sorts it out
                else:
                    self._settled(sent, replies)
                in_flight.popleft()  # settled or going back: only now (an exception leaves it in flight)
                self._replies = []
        except rx.ConnectionError:
            self._back(back)
            self._resend_in_flight()
            return False
        return self._back(back)

    def _resend_in_flight(self) -> None:
        """The connection broke (or a bug struck): every step in flight goes back to the queue
        for the writer's thread, the replies read of them and any unsent rest forgotten, the
        lane closed (its next use opens a new connection)."""
        self._back([s.step for s in self._in_flight])
        self._in_flight.clear()
        self._replies, self._unsent = [], b""
        if self.lane is not None:
            self.lane.close()

    def _settled(self, sent: _Sent, replies: list) -> None:
        step = sent.step
        accepted = self.fencing.step_outcome(step, replies, sent.main)
        self.num_round_trips += 1
        with self._cond:
            self._backlog -= step.num_messages
            if self._backlog < self.max_backlog and not self.has_room.is_set():
                self.has_room.set()
        for f, ok in zip(step.finals, accepted, strict=True):
            if not ok:
                self._refused(f.request_id, f.epoch)

    def _back(self, steps: list[StepWrite]) -> bool:
        """Put ``steps`` (sent, in order) back in the queue for the writer's thread to write
        again (still counted in the backlog): after those sent back before them, ahead of any
        step queued since; whether there were none."""
        if not steps:
            return True
        with self._cond:
            for step in steps:
                self._pending.insert(self._num_back, step)
                self._num_back += 1
            self._cond.notify()
        return False

    def _refused(self, rid: str, epoch: int) -> None:
        """``rid``'s final under ``epoch`` was refused (``on_refused``: its run under that epoch ends)."""
        self.num_refused += 1
        log.warning("outputs.refused", request_id=rid, epoch=epoch)
        self.on_refused(rid, epoch)

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
        for f in batch.finals:
            if f.request_id in refused:
                self._refused(f.request_id, f.epoch)

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
