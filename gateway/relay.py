"""Relay a request's output to the client, in index order, from one read for all requests.

Where tokens come from: every accepted message of a worker's write is both in the request's
own record (``out``/``fin`` of ``<ns>:own:<id>``, kept at a resume and a finish) and in the worker's steps stream
(``<ns>:steps:<worker>``, one entry per write for all its requests). A gateway process reads
the steps streams of every worker with **one** blocking ``XREAD`` (``StepReader``) and hands
each message to the relay of its request, if this process holds one; so the Redis
connections and commands of the reads do not grow with the requests relayed.

Bounds: a relay buffers at most ``MAX_BUFFERED`` messages its client has not taken, and at most
``MAX_BUFFERED_LOGPROBS`` log-probabilities in them (gathered
as they come into one pending message: ``StepRelay``). Past that (a client that does not
read) it is detached: the reader stops feeding it, and it
goes on from the request's own output stream at its client's pace, so the backlog stays in
Redis, never in the gateway. Its client takes whatever waits at once: a client that falls
behind gets several steps in one message. The same stream is read when a relay sees nothing
for ``SILENCE_S`` seconds while that stream holds more (a steps entry it could not see: a
gap, or one trimmed before it was read), and for a retry of a request queued before.

Messages are placed by the index of their first token (``Reorder``): a message whose tokens
were already relayed is dropped (a request resumed elsewhere, or a write retried, may repeat
them), and one that starts past the next index waits until the gap is filled (the old
worker's last writes can land after the new worker's first). So the client sees every
token exactly once, in order. A message's logprobs (one per token) are cut with its tokens.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator

import structlog
from google.protobuf.message import DecodeError

from pagefleet.common.fencing import entry_of, outputs_of, read_record, steps_field
from pagefleet.common.redis import GATEWAY_TTL_S, SCHEDULER_STEPS, Keys, OutEntry, retry
from pagefleet.common.step_write import row_fields, set_stop, stop_of
from pagefleet.protos import cluster_pb2
from pagefleet.protos import generation_pb2 as pb

from .steps_read import StepsRead

log = structlog.get_logger("gateway.relay")

FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
BLOCK_MS = 5000
# Messages a relay holds for its client before it reads from Redis at the client's pace.
MAX_BUFFERED = 1024
# ... and log-probabilities (each token's counts one and one for each of its top alternatives):
# a stream of top-20 logprobs holds ~200 tokens' worth, not 1,024 (each is a protobuf of 21 entries).
MAX_BUFFERED_LOGPROBS = 4096
# A relay that gets nothing for this long looks at its request's own output stream.
SILENCE_S = 5.0
# Entries a read takes from each steps stream at most: a reader that fell behind catches up
# in reads of this many, so what one read brings (and decodes at once) stays small.
READ_COUNT = 128
# How often the reader looks for workers (new steps streams), and how far back it reads a new one.
REFRESH_S = 1.0
LOOKBACK_MS = 10_000


class Reorder:
    """Turn messages in any order, with repeats, into one contiguous sequence."""

    def __init__(self) -> None:
        self.next_index = 0
        self._pending: dict[int, OutEntry] = {}

    @property
    def has_gap(self) -> bool:
        """Messages wait for ones before them that have not come."""
        return bool(self._pending)

    def add(self, e: OutEntry) -> list[OutEntry]:
        """The messages now ready, in order; the last one may carry the finish reason."""
        if e.index == self.next_index and not self._pending and not e.finish_reason:  # the common case
            self.next_index += len(e.token_ids)
            return [e] if e.token_ids or e.text else []
        if not isinstance(e, OutEntry):  # a StepOutput or a Row, fed by the reader: cut below as an OutEntry
            e = entry_of(e)
        end = e.index + len(e.token_ids)
        if e.finish_reason in ("abort", "error") and not e.token_ids and e.index >= self.next_index:
            self._pending.clear()  # the end: nothing more will be generated
            return [OutEntry(self.next_index, [], e.text, e.finish_reason, e.error)]
        if end <= self.next_index and not e.finish_reason:
            return []
        old = self._pending.get(e.index)
        if old is None or (e.finish_reason and not old.finish_reason):
            self._pending[e.index] = e
        ready = []
        while True:
            start = next((i for i in sorted(self._pending) if i <= self.next_index), None)
            if start is None:
                return ready
            m = self._pending.pop(start)
            skip = self.next_index - m.index
            if skip >= len(m.token_ids) and not m.finish_reason:
                continue
            out = m.cut(skip) if skip else m  # a record's text is cut with its tokens (text_lengths)
            self.next_index += len(out.token_ids)
            ready.append(out)
            if out.finish_reason:
                self._pending.clear()
                return ready


async def relay(redis, keys: Keys, request_id: str, num_prompt_tokens: int,
                order: Reorder | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """Yield the request's messages from Redis, read for this request alone, until (and
    including) its last one: its own record (what it had when resumed; everything, once it
    finished), then its current worker's steps stream from its assignment on, at the pace
    the caller takes them. ``order``: what was relayed already (not repeated). The path of a
    retry, and of a relay whose client fell behind."""
    order = order or Reorder()
    worker, key, cursor = None, None, "0-0"
    # The scheduler's own stream too, from its last entry before the record's first read: a
    # final it writes (a Cancel, a deadline, a request it ends) comes there, not in the worker's.
    ends = keys.steps(SCHEDULER_STEPS)
    last = await retry(lambda: redis.xrevrange(ends, count=1), what="xrevrange_ends")
    ends_cursor = last[0][0] if last else "0-0"
    while True:
        ready = [m for e in await read_record(redis, keys, request_id) for m in order.add(e)]
        if ready:
            msg = _finished(_merged(request_id, ready), order, num_prompt_tokens)
            yield msg
            if msg.finish_reason:
                return
        owner = await retry(lambda: redis.hmget(keys.owner(request_id), "worker", "t", "steps"), what="hmget_own")
        if (owner[0], owner[1]) != worker:  # (re)assigned: read its new worker from the assignment on
            worker = (owner[0], owner[1])
            key = None
            if owner[0] and owner[0].decode() not in ("", "scheduler"):
                raw = owner[2] or await retry(lambda w=owner[0]: redis.get(keys.steps_of(w.decode())),
                                              what="get_steps_of")
                key = raw.decode() if raw else None
            cursor = f"{max(0, int(owner[1] or 0) - 1)}-0"  # XREAD reads past it: the first entry included
        if key is None:
            await asyncio.sleep(0.2)  # waiting to be placed
            continue
        resp = await retry(lambda k=key, c=cursor, e=ends_cursor: redis.xread({k: c, ends: e}, count=256,
                                                                               block=BLOCK_MS), what="xread")
        ready = []
        for stream, entries in resp or ():
            from_ends = (stream.decode() if isinstance(stream, bytes) else stream) == ends
            for entry_id, fields in entries:
                if from_ends:
                    ends_cursor = entry_id
                else:
                    cursor = entry_id
                ready += [m for o in outputs_of(fields) if o.request_id == request_id for m in order.add(entry_of(o))]
        if ready:  # what this read found, in one message
            msg = _finished(_merged(request_id, ready), order, num_prompt_tokens)
            yield msg
            if msg.finish_reason:
                return


def _finished(msg: pb.GenerateResponse, order: Reorder, num_prompt_tokens: int) -> pb.GenerateResponse:
    if msg.finish_reason:
        msg.usage.prompt_tokens = num_prompt_tokens
        msg.usage.completion_tokens = order.next_index
    return msg



class StepRelay:
    """One request's messages as the reader hands them over (``StepReader.open``).

    The reader's ``feed`` puts each message in order (``Reorder``) as it comes and gathers what
    is ready into one pending message (its tokens, text pieces and logprobs); its relay's
    ``take`` hands that over as one ``GenerateResponse``. So a token costs a list extend here,
    not an object of its own, and a message is built once, whatever number of steps it holds.
    Bound: ``MAX_BUFFERED`` messages (``MAX_BUFFERED_LOGPROBS`` log-probabilities) fed and not
    taken, then detached (see the module doc).
    """

    __slots__ = ("request_id", "order", "detached", "wake_after", "num_buffered", "_start", "_token_ids",
                 "_texts", "_logprobs", "_last", "_wake", "_loop", "_waiting", "wait_until", "num_logprobs")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None,
                 waiting: set[StepRelay] | None = None) -> None:
        """``loop``: the running one (default: looked up; each look-up costs a ``getpid``).
        ``waiting``: where a waiting relay puts itself for its reader to end the waits past
        their time (``StepReader``'s sweep: no timer per wait); None: a timer per wait."""
        self.request_id = request_id
        self._loop = loop or asyncio.get_running_loop()
        self._waiting = waiting
        self.wait_until = 0.0  # the loop's time at which a wait ends without news
        self.order = Reorder()  # fed up to ``order.next_index``; taken up to ``_start``
        self.detached = False  # past MAX_BUFFERED: read from the request's output stream instead
        self.wake_after = 1  # tokens fed before its reader is woken (``--stream-interval``)
        self.num_buffered = 0  # messages fed since the last take
        self.num_logprobs = 0  # their log-probabilities (``MAX_BUFFERED_LOGPROBS``)
        self._start = 0
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list = []
        self._last: OutEntry | None = None  # the message with the finish reason, once fed
        self._wake: asyncio.Future | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens fed and not taken."""
        return len(self._token_ids)

    @property
    def finished(self) -> bool:
        """Its last message was fed."""
        return self._last is not None

    def feed(self, o) -> None:
        """One message of the request (a ``StepOutput``, a ``Row`` or an ``OutEntry``), in any order."""
        self._feed(o.index, o.token_ids, o.text, o.logprobs, o.finish_reason, o)

    def feed_row(self, index: int, token_ids: list[int], text: str) -> None:
        """One message that finishes nothing and has no logprobs (a row of a step's columns)."""
        self._feed(index, token_ids, text, None, "", None)

    def _feed(self, index: int, ids, text: str, lp, finish_reason: str, o) -> None:
        if self.detached:
            return
        self.num_buffered += 1
        if self.num_buffered > MAX_BUFFERED:
            self.detach()
        else:
            order = self.order
            if index == order.next_index and not finish_reason and not order.has_gap:  # the common case
                if ids:
                    self._token_ids.extend(ids)
                    order.next_index += len(ids)
                    if lp:
                        self._add_logprobs(lp)
                self._texts.append(text)
            else:
                for e in order.add(o if o is not None else OutEntry(index, list(ids), text)):
                    self._add(e)
            if self.num_logprobs > MAX_BUFFERED_LOGPROBS:
                self.detach()
            elif len(self._token_ids) < self.wake_after and self._last is None:
                return  # its reader would only hold these back: no wake-up per token
        w = self._wake
        if w is not None and not w.done():
            w.set_result(True)

    def _add(self, e: OutEntry) -> None:
        self._token_ids.extend(e.token_ids)
        self._texts.append(e.text)
        if e.logprobs:
            self._add_logprobs(e.logprobs)
        if e.finish_reason:
            self._last = e

    def _add_logprobs(self, lp) -> None:
        self._logprobs.extend(lp)
        self.num_logprobs += sum(1 + len(x.top_logprobs) for x in lp)

    def detach(self) -> None:
        """Stop taking messages from the reader: what was fed and not taken is dropped (its
        relay reads it from the request's own stream, from the last index taken), the last
        message too (read again there with the tokens before it: a finish taken alone would end
        the stream short)."""
        self.detached = True
        self.order = Reorder()
        self.order.next_index = self._start
        self._last = None
        self._clear()

    def _clear(self) -> None:
        self.num_buffered = 0
        self.num_logprobs = 0
        self._token_ids = []
        self._texts = []
        self._logprobs = []

    def take(self) -> pb.GenerateResponse | None:
        """What was fed since the last take as one message (None if nothing): the request's
        last message, with its finish reason, if that was fed."""
        last = self._last
        if not self._token_ids and last is None and not any(self._texts):
            self.num_buffered = 0
            return None
        msg = pb.GenerateResponse()  # fields set one by one: a third cheaper than as keywords
        msg.request_id = self.request_id
        msg.index = self._start
        msg.token_ids.extend(self._token_ids)
        msg.text = "".join(self._texts)
        if self._logprobs:
            msg.logprobs.extend(self._logprobs)
        if last is not None:
            msg.finish_reason = FINISH.get(last.finish_reason, pb.FINISH_REASON_ERROR)
            msg.error = last.error
            if (stop := stop_of(last)) is not None:
                set_stop(msg, stop)
        self._start = self.order.next_index
        self._clear()
        return msg

    async def wait(self, timeout_s: float) -> bool:
        """Until ``wake_after`` tokens or a last message were fed (or the relay detached); False
        after ``timeout_s`` of that not happening."""
        if self.detached or len(self._token_ids) >= self.wake_after or self._last is not None:
            return True
        loop = self._loop
        wake = self._wake = loop.create_future()
        waiting = self._waiting
        if waiting is None:
            timer = loop.call_later(timeout_s, _expire, wake)
        else:
            self.wait_until = loop.time() + timeout_s
            waiting.add(self)
        try:
            await wake
            return bool(wake.result()) or self.detached
        finally:
            if waiting is None:
                timer.cancel()
            else:
                waiting.discard(self)
            self._wake = None

    def expire(self) -> None:
        """End a wait that is past its time (its ``wait`` returns False)."""
        if self._wake is not None:
            _expire(self._wake)


def _expire(wake: asyncio.Future) -> None:
    if not wake.done():
        wake.set_result(False)


class StepReader:
    """One blocking read of every worker's steps stream for all the relays of this process.

    Each step entry carries a field per gateway process (``o:<reply_to>``, named in the
    requests this process queues) and ``o`` for messages of no gateway's (the scheduler's
    own): this process decodes those two only, so its work per token does not grow with the
    number of gateway processes. (A retry relayed by another process reads its request alone:
    ``relay``.)

    Started with the first relay. Every ``REFRESH_S`` it looks up the workers (one ``HGETALL``,
    and Redis's clock) and starts reading a new worker's stream ``LOOKBACK_MS`` before now, so
    a worker found late loses nothing a relay could want. Its sweep ends the relays' waits
    that saw nothing for their time (``StepRelay.wait``), with no timer per wait. Another task
    keeps this process's liveness key set (``_keep_alive``).
    """

    def __init__(self, redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.reply_to = secrets.token_hex(6)  # this process, in the requests it queues
        self._fields = (b"o", steps_field(self.reply_to).encode())
        self.relays: dict[str, StepRelay] = {}
        self._cursors: dict[str, str] = {}  # steps stream -> last id read
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: set[StepRelay] = set()  # relays waiting for news (``StepRelay.wait``)
        self._sweeper: asyncio.Task | None = None
        self._alive: asyncio.Task | None = None
        self._read = StepsRead(redis)
        self._refreshed_at = 0.0
        self.num_reads = 0
        # The shard's registered workers at the last refresh (None: not looked yet); a shard's
        # scheduler removes a dead one's row, so 0 is a shard no request of ours should wait in.
        self.num_workers: int | None = None

    def start(self) -> None:
        """Start reading (if not yet): the first relay does, or the gateway for a model on
        several shards, so each shard's ``num_workers`` is known before its first request."""
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run())
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = self._loop.create_task(self._sweep())
            if self._alive is None or self._alive.done():
                self._alive = self._loop.create_task(self._keep_alive())

    def open(self, request_id: str) -> StepRelay:
        """The relay of ``request_id`` (opened before its request is queued, so nothing is missed)."""
        self.start()
        r = self.relays.get(request_id)
        if r is None:
            r = self.relays[request_id] = StepRelay(request_id, self._loop, self._waiting)
        return r

    def close(self, request_id: str) -> None:
        self.relays.pop(request_id, None)

    async def stop(self) -> None:
        for task in (self._task, self._sweeper, self._alive):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._read.close()

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() - self._refreshed_at < REFRESH_S:
            return
        self._refreshed_at = loop.time()

        # Two calls, not one pipeline: TIME names no key (a Redis Cluster pipeline refuses it).
        rows = await retry(lambda: self.redis.hgetall(self.keys.workers), what="steps_refresh")
        self.num_workers = len(rows)
        now_s, now_us = await retry(self.redis.time, what="steps_refresh_time")
        start = f"{max(0, now_s * 1000 + now_us // 1000 - LOOKBACK_MS)}-0"
        streams = {self.keys.steps(SCHEDULER_STEPS)}
        for wid, raw in rows.items():
            try:
                streams.add(json.loads(raw).get("steps") or self.keys.steps(wid.decode()))
            except (ValueError, AttributeError):
                continue
        for key in streams:
            self._cursors.setdefault(key, start)
        for key in [k for k in self._cursors if k not in streams]:  # gone: its worker left, or was fenced
            del self._cursors[key]

    async def _run(self) -> None:
        wanted = self._fields
        while True:
            try:
                await self._refresh()
                resp = await retry(lambda: self._read(self._cursors, READ_COUNT, int(REFRESH_S * 1000)), what="xread_steps")
                self.num_reads += 1
                for key, entries in resp:
                    for entry_id, fields in entries:
                        for i in range(0, len(fields), 2):
                            if fields[i] in wanted and fields[i + 1]:
                                try:
                                    self._dispatch(fields[i + 1])
                                except (ValueError, DecodeError) as e:  # a bad entry is skipped, not read again and again
                                    log.error("steps.bad_entry", stream=key, entry=entry_id, error=str(e))
                    if entries:
                        last = entries[-1][0]
                        self._cursors[key] = last.decode() if isinstance(last, bytes) else last
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop every relay: they fall back to their own streams
                log.exception("steps.read_failed")
                await asyncio.sleep(0.1)

    async def _keep_alive(self) -> None:
        """Keep this process's liveness key (``Keys.gateway``) set, every ``REFRESH_S``: the
        scheduler cancels the requests of gateway-chosen ids of a process whose key expired
        (nothing else would ever read or cancel them). A task of its own: a read that hangs (a
        half-open connection, until its watchdog) is no death."""
        key = self.keys.gateway(self.reply_to)
        while True:
            try:
                await self.redis.set(key, b"1", ex=GATEWAY_TTL_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: the next round tries again
                log.warning("gateway.alive_unset", error=str(e))
            await asyncio.sleep(REFRESH_S)

    async def _sweep(self) -> None:
        """End the waits past their time, every fifth of ``SILENCE_S`` (so a wait ends within
        1.2 times its time); apart from the read, so a Redis that does not answer delays none."""
        while True:
            await asyncio.sleep(SILENCE_S / 5)
            now = self._loop.time()
            for r in [r for r in self._waiting if r.wait_until <= now]:
                r.expire()

    def _dispatch(self, raw: bytes) -> None:
        relays = self.relays
        steps = cluster_pb2.StepOutputs.FromString(raw)
        if steps.column_request_ids:  # the step's rows, straight from its columns
            for rid, index, ids, text in row_fields(steps):
                r = relays.get(rid)
                if r is not None:
                    r.feed_row(index, ids, text)
        for o in steps.outputs:
            r = relays.get(o.request_id)
            if r is not None:
                r.feed(o)


async def relay_steps(redis, keys: Keys, r: StepRelay, num_prompt_tokens: int,
                      stream_interval: int = 1, on_silence=None) -> AsyncIterator[pb.GenerateResponse]:
    """Yield ``r``'s request's messages until (and including) its last one: what the reader
    fed it, merged into one message while its client was away; from the request's own output
    stream once detached or when it saw nothing for ``SILENCE_S`` while that stream holds more.
    ``stream_interval``: hold tokens back until that many are waiting (or the request ends).
    ``on_silence``: awaited after each ``SILENCE_S`` without a message (the gateway checks the
    request was not lost: a failover that rolls back its entry and its assignment may come after
    its first tokens were relayed, and its scheduler then withdraws it from its worker)."""
    r.wake_after = stream_interval
    while True:
        fed = await r.wait(SILENCE_S)
        if not fed and on_silence is not None:
            await on_silence()
        behind = r.detached or (not fed and await _stream_ahead(redis, keys, r.request_id, r.order))
        if behind or r.finished or r.num_tokens >= stream_interval:
            msg = r.take()
            if msg is not None:
                yield _finished(msg, r.order, num_prompt_tokens)
                if msg.finish_reason:
                    return
        if behind:
            if not r.detached:
                r.detach()  # from here on its own stream has it all: the reader feeds it no more
            log.info("relay.from_stream", request_id=r.request_id, next_index=r.order.next_index)
            async for msg in relay(redis, keys, r.request_id, num_prompt_tokens, r.order):
                yield msg
            return


async def _stream_ahead(redis, keys: Keys, request_id: str, order: Reorder) -> bool:
    """Whether this relay missed something: a gap it has waited on, or a finish it never saw."""
    if order.has_gap:
        return True
    return await retry(lambda: redis.hget(keys.owner(request_id), "done"), what="hget_done") == b"1"


def _merged(request_id: str, ms: list[OutEntry]) -> pb.GenerateResponse:
    """Consecutive messages as one response (the last one's finish reason, if any)."""
    m0 = ms[0]
    msg = pb.GenerateResponse(request_id=request_id, index=m0.index)
    for m in ms:
        msg.token_ids.extend(m.token_ids)
        msg.text += m.text
        if m.logprobs:
            msg.logprobs.extend(m.logprobs)
    last = ms[-1]
    if last.finish_reason:
        msg.finish_reason = FINISH.get(last.finish_reason, pb.FINISH_REASON_ERROR)
        msg.error = last.error
        if last.stop is not None:
            set_stop(msg, last.stop)
    return msg
