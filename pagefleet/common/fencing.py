"""Who may write a request's output, and what of it is durable when: decided in Redis, atomically.

**The steps stream is the output.** A worker writes each step's messages, for all its requests,
as **one** ``XADD`` to its own steps stream (``<ns>:steps:<worker>:<incarnation>``, field
``o``: a ``StepOutputs``), encoded where the tokens are (``step_write.StepWrite``) and sent on
a connection of the writer's own where it has one (``redis_lane``). A message is durable once
that entry is in Redis, and a client sees a token only after that (gateways relay from these
streams). So a step costs Redis one command, whatever the number of requests in it.

**Fencing a worker.** A worker's stream is closed for good by appending an entry with the
largest possible id (``fence_stream``): every later ``XADD *`` to it fails ("exhausted the
last possible ID"), while everything appended before stays readable. A request leaves its
worker with its tokens only that way: to resume it elsewhere, the scheduler fences the
stream of the request's last worker (``take_over``), then reads the request's messages from
it: nothing can be added behind that read, so the request continues after exactly the
tokens that any client could have seen. A fenced worker finds its next write refused,
drops every request it holds, and writes on in a new incarnation's stream.

**Owner records** (``<ns>:own:<request_id>``, a hash: ``epoch``, ``worker``, ``t``, ``steps``,
``done``, and the request's record ``out``, ``fin``): the scheduler takes a new epoch for each
assignment (``assign_many``: one script for a round's assignments, that also refuses a
scheduler whose own epoch is no longer the current one, and stamps ``t``, the assignment's
time on Redis's clock, from which the request's messages are read back). The
epoch fences finishes: a request's **final** write goes through ``FINISH`` (one script for
all the requests a write finishes): its final message is appended with the step only if
the writer's epoch is still the request's and it is not done, and in the same atomic step
the owner record is marked done and takes the request's record of everything it wrote
(``fin``), its entry in the requests stream is acknowledged and a record goes to
``<ns>:done`` (where the scheduler learns of finishes; one entry for all the requests of a
write). A request is finished exactly when its last message is durable.

**The request's own record** (fields ``out`` and ``fin`` of its owner record, each a
``StepOutputs``) holds only what a later reader needs that the steps streams may no longer
hold: the tokens a request had when it was last resumed (``out``, written by ``take_over``)
and, at its finish, everything its last worker wrote (``fin``: a retry replays the whole
output from the two for ``DONE_TTL_S``).

Lifetimes: the owner record lives ``REQUEST_TTL_S`` from its assignment (refreshed by the
worker every few hundred messages), ``DONE_TTL_S`` after the finish, with the idempotency
key; after it, a retry with the same id is a new request. A steps stream
keeps ``STEPS_KEEP_MS`` of entries (``MINID``, on one write every ``STEPS_TRIM_EVERY_MS``; a
gateway that falls further behind reads the request's own record) and expires ``STEPS_TTL_S``
after its writer's last write.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import hiredis

from pagefleet.protos import cluster_pb2

from .redis import GROUP, SCHEDULER_STEPS, Keys, OutEntry, execute_pipeline, retry
from .redis_lane import BlockingLane, pack
from .scripts import ASSIGN, FINISH
from .step_write import Final, StepEncoder, StepWrite, messages, piece, set_output, stop_of

# A running request's owner record lives this long after its assignment (or the worker's refresh).
REQUEST_TTL_S = 3600
# A finished request's output (and its idempotency key) stays this long for late or repeated readers.
DONE_TTL_S = 300
# The done stream keeps about this many records (the scheduler reads it as they come).
DONE_STREAM_MAXLEN = 100_000
# A steps stream keeps about this long of entries (gateways read them as they come).
STEPS_KEEP_MS = 60_000
# A writer's steps entries carry the trim clause (MINID) at most this often: on every write it
# was about a quarter of an XADD's own time in Redis, for a floor that moves a step's length at a time.
STEPS_TRIM_EVERY_MS = 1_000
# A steps stream outlives its writer's last write by this long.
STEPS_TTL_S = 600
# The id of the entry that closes a steps stream: nothing can be appended after it.
FENCE_ID = "18446744073709551615-18446744073709551615"

class Fenced(Exception):
    """This writer's steps stream was fenced (it was declared dead): nothing it holds is its own."""


@dataclass(slots=True)
class Write:
    """One message for a request's output, written under ``epoch``.

    A final message (``entry.finish_reason`` set) finishes the request: ``entry_id`` is its
    entry in the requests stream, to acknowledge; ``record``: everything this writer wrote
    for it (default: the message), kept for a retry's replay. ``refresh_ttl``: renew the
    owner record's TTL with it (every few hundred messages)."""

    request_id: str
    epoch: int
    entry: OutEntry
    entry_id: str = ""
    refresh_ttl: bool = False
    record: OutEntry | None = None
    field: str = "o"  # the steps entry's field it goes to: its gateway's (``steps_field``)

    @property
    def final(self) -> bool:
        return bool(self.entry.finish_reason)


def steps_field(reply_to: str) -> str:
    """The field of a steps entry that carries the messages of the requests relayed by gateway
    process ``reply_to`` (``AssignRequest.reply_to``); ``o`` for those of no gateway."""
    return f"o:{reply_to}" if reply_to else "o"


def outputs_of(fields: dict, only: Iterable[bytes] | None = None):
    """Every message of one entry of a steps stream, field after field (``only``: just those
    fields; default every field of messages): a ``StepOutput``, or a ``Row`` of the columns,
    which reads as one."""
    for name, raw in fields.items():
        if raw and (name in only if only is not None else name[:1] == b"o"):
            yield from messages(cluster_pb2.StepOutputs.FromString(raw))


def add_step_output(steps, request_id: str, e: OutEntry):
    """Append ``e`` to ``steps`` (a ``StepOutputs``), built in place; the new ``StepOutput``."""
    o = steps.outputs.add()
    set_output(o, request_id, e.index, e.token_ids, e.text, e.finish_reason, e.error, e.logprobs, e.text_lengths,
               e.stop)
    return o


def step_piece(request_id: str, e: OutEntry) -> bytes:
    """``e`` as a one-message ``StepOutputs`` (pieces concatenated: the StepOutputs of all)."""
    return piece(request_id, e.index, e.token_ids, e.text, e.finish_reason, e.error, e.logprobs, e.text_lengths,
                 e.stop)


def entry_of(o) -> OutEntry:
    """A ``StepOutput`` as an ``OutEntry`` (its logprobs kept as protobuf messages)."""
    return OutEntry(o.index, list(o.token_ids), o.text, o.finish_reason, o.error, list(o.logprobs) or None,
                    list(getattr(o, "text_lengths", ())) or None, stop_of(o))  # a Row (one step's) has none


class Fencing:
    """The scripts and the writes of one writer (a worker, or the scheduler for its own final
    messages), registered once per Redis client (EVALSHA, falling back to EVAL after a restart)."""

    def __init__(self, redis, keys: Keys, writer_id: str = SCHEDULER_STEPS,
                 stream_of: Callable[[str], str] = lambda worker_id: "", mux=None) -> None:
        """``stream_of``: a worker's steps stream, as its row names it (recorded with each
        assignment: the stream a resume reads the request back from). ``mux``: a ``RedisMux``
        the assignments go through (default: the client)."""
        self.redis = redis
        self.mux = mux
        self.keys = keys
        self.writer_id = writer_id
        self.stream_of = stream_of
        self.steps_key = ""
        self.new_incarnation()
        self._assign = redis.register_script(ASSIGN)
        self._finish = redis.register_script(FINISH)

    def new_incarnation(self) -> str:
        """A fresh steps stream for this writer (after its last one was fenced)."""
        tail = "" if self.writer_id == SCHEDULER_STEPS else f":{secrets.token_hex(4)}"
        self.steps_key = self.keys.steps(self.writer_id) + tail
        self._steps_ttl_at = 0.0
        self._trimmed_ms = 0  # when a write last carried the trim clause
        self._first_ms: dict[str, int] = {}  # request id -> its first entry's time in this stream
        return self.steps_key

    async def publish_stream(self) -> None:
        """Name this writer's steps stream where the scheduler finds it to fence it (``steps_of``)."""
        await retry(lambda: self.redis.set(self.keys.steps_of(self.writer_id), self.steps_key, ex=STEPS_TTL_S * 144),
                    what="publish_stream")

    async def assign(self, request_id: str, scheduler_epoch: int, worker_id: str) -> int:
        """A new epoch for ``request_id`` on ``worker_id``; 0 if it finished already, -1 if
        ``scheduler_epoch`` is no longer the current scheduler's (stop placing)."""
        return (await self.assign_many([(request_id, worker_id)], scheduler_epoch))[0]

    async def assign_many(self, owners: list[tuple[str, str]], scheduler_epoch: int) -> list[int]:
        """``assign`` for each ``(request_id, worker_id)`` of ``owners``: one script for all."""
        if not owners:
            return []
        keys = [self.keys.scheduler_epoch]
        args: list = [scheduler_epoch, REQUEST_TTL_S]
        for request_id, worker_id in owners:
            keys.append(self.keys.owner(request_id))
            args += [worker_id, self.stream_of(worker_id) if worker_id else ""]
        if self.mux is not None:
            return [int(e) for e in await self.mux.script(self._assign, keys, args)]
        return [int(e) for e in await self._assign(keys=keys, args=args)]

    def _steps_ttl(self) -> int:
        now = time.monotonic()
        if now - self._steps_ttl_at > STEPS_TTL_S / 4:
            self._steps_ttl_at = now
            return STEPS_TTL_S
        return 0

    def _trim_floor(self, live: Iterable[str] | Callable[[], Iterable[str]] | None) -> int | None:
        """Entries older than this (ms) may go: ``STEPS_KEEP_MS`` ago, and never an entry of a
        request still running here (``live``: those the writer holds, or a function that gives
        them, called only when a trim is due; the others are forgotten), which a resume
        elsewhere would read back. None: no trim is due (the last write that trimmed was less
        than ``STEPS_TRIM_EVERY_MS`` ago)."""
        now_ms = int(time.time() * 1000)
        if now_ms - self._trimmed_ms < STEPS_TRIM_EVERY_MS:
            return None
        self._trimmed_ms = now_ms
        if callable(live):
            live = set(live())
        if live is not None:
            for rid in [r for r in self._first_ms if r not in live]:
                del self._first_ms[rid]
        return min([now_ms - STEPS_KEEP_MS, *self._first_ms.values()])

    def _entered(self, step: StepWrite, entry_id) -> None:
        ms = int((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).split("-")[0])
        first_ms = self._first_ms
        for rid in step.first:
            first_ms.setdefault(rid, ms)
        for f in step.finals:
            first_ms.pop(f.request_id, None)

    async def write(self, writes: list[Write], live: Iterable[str] | None = None) -> list[bool]:
        """Write every message in one round trip; for each, whether it was accepted (a
        message that finishes nothing is always accepted: only finishes are checked).
        ``Fenced`` when this writer's stream was fenced (nothing was written). ``live``: the
        requests this writer holds (the stream is trimmed, never past their first entries)."""
        if not writes:
            return []
        accepted = iter(await self.write_step(encode(writes), live))
        return [next(accepted) if w.final else True for w in writes]

    async def write_step(self, step: StepWrite,
                         live: Iterable[str] | Callable[[], Iterable[str]] | None = None) -> list[bool]:
        """``step`` in one round trip; for each of its finals, whether it was accepted (its
        other messages always are). ``Fenced`` when this writer's stream was fenced (nothing
        was written). ``live``: as ``write``, or a function that gives them (called only when
        a trim is due). A step that finishes nothing and renews no TTL
        is one ``XADD``; otherwise the TTLs' ``EXPIRE``s, then the ``XADD`` (or the finish
        script, with the finals) in one pipeline."""
        commands, main = self.step_commands(step, live)
        return self.step_outcome(step, await self._send(commands), main)

    def write_step_blocking(self, step: StepWrite, lane: BlockingLane,
                            live: Iterable[str] | Callable[[], Iterable[str]] | None = None) -> list[bool]:
        """``write_step`` on ``lane``, a blocking connection of a writer thread's own (one load of
        the finish script where Redis lost it, as ``_send``)."""
        commands, main = self.step_commands(step, live)
        replies = [_error(r) for r in lane.call(commands)]
        if step.finals and _noscript(replies[main]):
            lane.call([("SCRIPT", "LOAD", FINISH)])
            replies = [_error(r) for r in lane.call(commands)]
        return self.step_outcome(step, replies, main)

    def step_packed(self, step: StepWrite, live: Iterable[str] | Callable[[], Iterable[str]] | None = None,
                    ) -> tuple[bytes, int, int]:
        """``step_commands`` packed for a lane's ``send_nowait``: the bytes, how many replies
        they are owed, and the index of the one that appends the step (read the replies with
        ``lane_replies``, then ``step_outcome``)."""
        commands, main = self.step_commands(step, live)
        return pack(commands), len(commands), main

    def step_commands(self, step: StepWrite,
                      live: Iterable[str] | Callable[[], Iterable[str]] | None = None) -> tuple[list[tuple], int]:
        """``step``'s commands (see ``write_step``) and the index of the one that appends it."""
        minid = self._trim_floor(live)
        ttl = self._steps_ttl()
        refresh = [self.keys.owner(rid) for rid in step.refresh]
        if step.finals:
            keys = [self.steps_key, self.keys.requests, self.keys.done]
            args: list = [GROUP, DONE_STREAM_MAXLEN, DONE_TTL_S, "" if minid is None else minid, ttl,
                          len(step.fields)]
            for field, raw in step.fields.items():
                args += [field, raw]
            args.append(len(step.finals))
            for f in step.finals:
                keys += [self.keys.owner(f.request_id), self.keys.idempotency(f.request_id)]
                args += [f.epoch, f.entry_id, f.request_id, f.finish_reason, f.field, f.piece, f.record]
            main: tuple = ("EVALSHA", self._finish.sha, len(keys), *keys, *args)
        else:
            trim = () if minid is None else ("MINID", "~", minid)
            main = ("XADD", self.steps_key, *trim, "*", *(x for field, raw in step.fields.items() for x in (field, raw)))
        commands = [*(("EXPIRE", key, REQUEST_TTL_S) for key in refresh), main]
        if ttl and not step.finals:
            commands.append(("EXPIRE", self.steps_key, ttl))
        return commands, len(refresh)

    def step_outcome(self, step: StepWrite, replies: list, main: int) -> list[bool]:
        """What ``step``'s ``replies`` say (errors as values): each final accepted or not;
        ``Fenced`` if the stream was, any other error raised."""
        for r in replies:
            if isinstance(r, Exception):
                if "exhausted the last possible ID" in str(r):
                    raise Fenced(self.steps_key) from r
                raise r
        reply = replies[main]
        if not step.finals:
            self._entered(step, reply)
            return []
        entry_id, oks = reply
        self._entered(step, entry_id)
        return [bool(int(x)) for x in oks]

    async def _send(self, commands: list[tuple]) -> list:
        """Every reply of ``commands``, errors as values, through the client (a script Redis
        lost is loaded and the pipeline's refused calls sent again, ``execute_pipeline``)."""
        import redis.exceptions as rx

        def build(pipe) -> None:
            for c in commands:
                pipe.execute_command(*c)

        if len(commands) == 1 and commands[0][0] == "XADD":  # most steps: no pipeline's cost
            try:
                return [await self.redis.execute_command(*commands[0])]
            except rx.ResponseError as e:
                return [e]
        return await execute_pipeline(self.redis, build, [self._finish])


def _error(reply):
    """A lane's reply with an error reply as redis-py's ``ResponseError`` (a value, not raised)."""
    if not isinstance(reply, hiredis.ReplyError):
        return reply
    import redis.exceptions as rx

    return rx.ResponseError(str(reply))


def lane_replies(replies: list) -> list:
    """A lane's replies with its error replies as redis-py's ``ResponseError`` values."""
    return [_error(r) for r in replies]


def _noscript(reply) -> bool:
    return isinstance(reply, Exception) and str(reply).startswith("NOSCRIPT")


def encode(writes: list[Write]) -> StepWrite:
    """``writes`` as one ``StepWrite`` (each request's first message in it counted as its first)."""
    enc = StepEncoder()
    for w in writes:
        e = w.entry
        if e.finish_reason:
            enc.finish(Final(w.request_id, w.epoch, w.entry_id, e.finish_reason, w.field,
                             step_piece(w.request_id, e), step_piece(w.request_id, w.record or e)))
            continue
        enc.add(w.field, w.request_id, e.index, e.token_ids, e.text, e.logprobs)
        if w.refresh_ttl:
            enc.refresh.append(w.request_id)
        enc.first.append(w.request_id)
    return enc.build() or StepWrite()


# -- reading back ------------------------------------------------------------------------------
async def is_fenced(redis, key: str) -> bool:
    """Whether steps stream ``key`` was fenced (its writer was declared dead)."""
    last = await retry(lambda: redis.xrevrange(key, count=1), what="xrevrange_steps")
    if not last:
        return False
    entry_id = last[0][0]
    return (entry_id.decode() if isinstance(entry_id, bytes) else entry_id) == FENCE_ID


async def fence_stream(redis, key: str) -> None:
    """Close ``key`` for good: every later ``XADD *`` to it fails (idempotent). A stream its
    worker never wrote is made by the fence: it expires as a written one does (``STEPS_TTL_S``),
    where it would have stayed for ever."""
    import redis.exceptions as rx

    try:
        await retry(lambda: redis.xadd(key, {"fence": 1}, id=FENCE_ID), what="fence_stream")
    except rx.ResponseError as e:
        if "exhausted" not in str(e) and "equal or smaller" not in str(e):
            raise
    if await retry(lambda: redis.ttl(key), what="fence_stream_ttl") == -1:
        await retry(lambda: redis.expire(key, STEPS_TTL_S), what="fence_stream_ttl")


async def messages_in(redis, key: str, request_id: str, since: str = "0-0", until: str = "+"):
    """Every message of ``request_id`` in steps stream ``key`` from id ``since``, oldest first."""
    out = []
    start = since
    while True:
        entries = await retry(lambda s=start: redis.xrange(key, s, until, count=1000), what="xrange_steps")
        for _, fields in entries:
            out.extend(entry_of(o) for o in outputs_of(fields) if o.request_id == request_id)
        if len(entries) < 1000:
            return out
        last = entries[-1][0]
        last = last.decode() if isinstance(last, bytes) else last
        start = "(" + last


async def read_record(redis, keys: Keys, request_id: str) -> list[OutEntry]:
    """The messages of the request's own record in its owner record: what it had when it was
    last resumed (``out``), then everything its last worker wrote (``fin``, at its finish)."""
    raw = await retry(lambda: redis.hmget(keys.owner(request_id), "out", "fin"), what="hmget_record")
    return [entry_of(o) for piece in raw if piece for o in cluster_pb2.StepOutputs.FromString(piece).outputs]


def merged(messages: list[OutEntry]) -> tuple[list[int], str, OutEntry | None]:
    """The tokens ``messages`` hold in index order (repeats dropped), the finish reason, and
    the messages past index 0 as one (with the text each token brought: ``text_lengths``)."""
    tokens: list[int] = []
    finish, text, logprobs, lengths = "", [], [], []
    for e in sorted(messages, key=lambda m: (m.index, not m.finish_reason)):
        if e.index <= len(tokens) < e.index + len(e.token_ids):
            skip = len(tokens) - e.index
            tokens.extend(e.token_ids[skip:])
            piece, kept = e.text_from(skip), e.lengths()[skip:]
            kept[-1] += len(piece) - sum(kept)  # text after its last token (a finish's) goes with that token
            text.append(piece)
            lengths.extend(kept)
            if e.logprobs:
                logprobs.extend(e.logprobs[skip:])
        if e.finish_reason:
            finish = e.finish_reason
    return tokens, finish, OutEntry(0, tokens, "".join(text), "", "", logprobs or None, lengths or None)


async def take_over(redis, keys: Keys, request_id: str, fence: bool | str | None = None) -> tuple[list[int], str]:
    """Every token ``request_id`` has emitted, and its finish reason, made final, and recorded
    in the request's own record (``out`` of its owner record), where the next reader starts.

    Its last worker's stream is read from the assignment on, fenced first where ``fence`` (the
    worker was declared dead: nothing can be added behind this read); ``None``: fenced if that
    worker has no row in the workers hash (it is gone). A live worker is not fenced: it no
    longer holds the request (it dropped it, or never got it), so it writes no more of it.
    A worker id: the worker declared dead, fenced if the request is still its own (``None``'s
    rule if it moved on to another worker meanwhile: a migration's handover)."""
    worker, since, steps = await retry(lambda: redis.hmget(keys.owner(request_id), "worker", "t", "steps"),
                                       what="hmget_own")
    record = await read_record(redis, keys, request_id)
    found: list[OutEntry] = []
    if worker and worker not in (b"", b"scheduler"):
        wid = worker.decode()
        key = steps or await retry(lambda: redis.get(keys.steps_of(wid)), what="get_steps_of")
        if key:
            key = key.decode()
            if isinstance(fence, str):
                fence = True if wid == fence else None
            if fence is None:
                fence = not await retry(lambda: redis.hexists(keys.workers, wid), what="hexists_worker")
            if fence:
                await fence_stream(redis, key)
            found = await messages_in(redis, key, request_id, f"{int(since or 0)}-0")
    return await _recorded(redis, keys, request_id, record, found)


async def record_emitted(redis, keys: Keys, request_id: str, piece: bytes) -> tuple[list[int], str]:
    """As ``take_over``, with what its worker wrote for ``request_id`` given (``piece``: the
    worker's own record of it, handed over as it let the request go) instead of read back from
    its steps stream: every token it has emitted, and its finish reason, recorded."""
    found = [entry_of(o) for o in cluster_pb2.StepOutputs.FromString(piece).outputs] if piece else []
    return await _recorded(redis, keys, request_id, await read_record(redis, keys, request_id), found)


async def _recorded(redis, keys: Keys, request_id: str, record: list[OutEntry],
                    found: list[OutEntry]) -> tuple[list[int], str]:
    """The tokens and finish of ``record`` (the request's own record) with ``found`` (its last
    worker's messages), the record grown to hold them."""
    tokens, finish, whole = merged(record + found)
    before = len(merged(record)[0])
    if len(tokens) > before and whole is not None:
        piece = step_piece(request_id, whole)
        pipe = redis.pipeline(transaction=False)
        pipe.hset(keys.owner(request_id), "out", piece)
        pipe.expire(keys.owner(request_id), REQUEST_TTL_S)
        await retry(pipe.execute, what="record_taken_over")
    return tokens, finish
