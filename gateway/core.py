"""One path behind both doors: check, queue and relay ``pb.GenerateRequest``s.

The gRPC servicer and the HTTP app only convert their encodings to ``pb.GenerateRequest``
and back. Everything between happens here, once: validation (``check``), shedding when
the queue is past ``--max-queue``, idempotency of client-chosen ids, the XADD into the
requests stream, the relay of the output stream, and the cancel entry when a caller
stops reading before the end (so the worker frees the request's blocks).

Refusals are exceptions the doors translate: ``BadField`` (validate.py), ``Shed`` and
``QueueUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import time
import uuid
import zlib
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagefleet.common.blocks import block_hashes
from pagefleet.common.fencing import REQUEST_TTL_S
from pagefleet.common.metrics import GatewayMetrics
from pagefleet.common.model_config import ModelSpec
from pagefleet.common.redis import (
    Keys,
    encode_cancel_entry,
    encode_request_entry,
    retry,
)
from pagefleet.common.scripts import ADMIT_AND_QUEUE
from pagefleet.protos import cluster_pb2
from pagefleet.protos import generation_pb2 as pb

from .admission import Admissions
from .limits import Limits
from .observe import enqueue_span
from .relay import StepReader, relay, relay_steps
from .validate import check

# The error text of a request finished for its deadline (the scheduler writes it): the gRPC
# door ends such a call with DEADLINE_EXCEEDED.
DEADLINE_ERROR = "deadline exceeded"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
# Redis calls that decide whether a request is queued: a few quick tries, then the caller hears of it.
_ATTEMPTS = 5
CANCEL_BATCH = 256  # cancels sent in one pipeline
# A client's own id whose caller went away is cancelled this much later, unless a retry came.
RETRY_GRACE_S = 1.0
_GRACE_ROUNDS = 5  # claim lookups at most, while Redis answers them late

log = structlog.get_logger("gateway")


class Shed(Exception):
    """The queue is past its limit; the caller should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueUnavailable(Exception):
    """The request queue (Redis) did not answer, or refused (full, a failed snapshot) past every
    retry: nothing was queued, or a relay could not go on (the client may retry by its id)."""

    @classmethod
    def of(cls, e: BaseException) -> QueueUnavailable:
        """The refusal for Redis's error ``e``: unreachable, or reachable and refusing, with why
        (a full Redis was reported as unreachable, and its operator looked at the network)."""
        if isinstance(e, RedisError) and not isinstance(e, OSError | RedisConnectionError | RedisTimeoutError):
            return cls(f"the request queue (Redis) refused: {e}")
        return cls("the request queue (Redis) is unreachable")


class IdInUse(Exception):
    """A client's request id is another request's (another prompt or sampling, or another
    model's) while that one's claim lasts: nothing was queued, and nothing of the other is
    relayed to this caller."""

    def __init__(self, request_id: str, model: str | None = None) -> None:
        other = (f"a request of model {model!r}" if model else
                 "another request (another prompt or sampling, or a request whose id the gateway chose)")
        super().__init__(f"request_id {request_id!r} is already the id of {other}; a retry must repeat its "
                         "request exactly: give a new request a new id")
        self.request_id = request_id


def fingerprint(prompt_ids: Sequence[int], sampling: pb.SamplingParams) -> str:
    """What makes two calls with one client id the same request (a retry): its prompt's tokens
    and its sampling as the client gave them (not its priority or deadline, which a retry may
    change). The value of its claim in Redis (``ADMIT_AND_QUEUE``)."""
    h = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12)
    h.update(sampling.SerializeToString(deterministic=True))
    return h.hexdigest()


@dataclass(slots=True)
class Queued:
    """A request in the requests stream (``fresh`` False: a client-chosen id queued before,
    whose output is relayed rather than generated again). ``entry_id`` and ``fields``: its
    entry, queued again if a Redis failover loses it (``GatewayCore.requeue_if_lost``)."""

    request_id: str
    num_prompt_tokens: int
    fresh: bool
    entry_id: str = ""
    fields: dict | None = None
    client_id: bool = False  # the id is the client's own: its retry (through any gateway) is relayed


def traceparent_or_new(value: str | None) -> str:
    """``value`` if it is a W3C ``traceparent``, else a new root one."""
    if value and _TRACEPARENT.match(value):
        return value
    # ``random``'s own generator (reseeded in a forked child), as OpenTelemetry's ids are: a
    # trace id is not a secret, and ``secrets`` costs two ``getrandom`` calls a request.
    return f"00-{random.getrandbits(128) or 1:032x}-{random.getrandbits(64) or 1:016x}-01"


class GatewayCore:
    """What a gateway does for a request, whichever door it came through."""

    def __init__(self, redis, keys: Keys | Sequence[Keys], model: ModelSpec, args, limits: Limits | None = None,
                 *, name: str | None = None, metrics: GatewayMetrics | None = None) -> None:
        """``keys``: the shard (or shards: requests spread over them by id) of this model;
        ``name``: the model's name in requests (default: ``model.name``)."""
        self.redis = redis
        self.shards = [keys] if isinstance(keys, Keys) else list(keys)
        if not self.shards:
            raise ValueError("a model is served by at least one shard")
        self.keys = self.shards[0]
        self.model = model
        self.name = name or model.name
        # --max-model-len caps every model's context (several models' contexts differ; one
        # model's above it was refused by the gateway's flags)
        cap = args.max_model_len
        self.max_model_len = model.max_model_len(None if cap is None else min(cap, model.context_limit))
        self.args = args
        self.limits = limits or Limits()
        self.metrics = metrics or GatewayMetrics()
        self._admit_and_queue = Admissions(redis, redis.register_script(ADMIT_AND_QUEUE))
        # Cancels of streams whose callers went away, sent by one task in pipelines: a burst of
        # dropped streams (hundreds at once) is a few round trips on one connection, not a
        # connection each, and reaches the scheduler in order.
        self._cancel_queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._graced: dict[asyncio.TimerHandle, str] = {}  # cancels waiting out RETRY_GRACE_S
        self._cancel_sender: asyncio.Task | None = None
        # One read of every worker's steps for all relays, per shard (a shard's streams share a slot).
        self.readers = {k.shard: StepReader(redis, k) for k in self.shards}
        self.reader = self.readers[self.keys.shard]
        self.stream_interval = max(1, getattr(args, "stream_interval", 1) or 1)
        # The other models' cores of this gateway (``Router``): a client's id is one model's at a time.
        self.siblings: list[GatewayCore] = []
        # Set as the process shuts down (SIGTERM: a rolling restart): the streams it cuts did not
        # lose their clients, who retry elsewhere; requests with the client's own id run on.
        self.stopping = False

    def shard_of(self, request_id: str) -> Keys:
        """The shard of ``request_id``: its hash picks one of the model's shards, the same in
        every gateway (a retry with a client's id lands where its claim is)."""
        if len(self.shards) == 1:
            return self.keys
        return self.shards[zlib.crc32(request_id.encode()) % len(self.shards)]

    def new_id(self, prefix: str = "", num_choices: int = 1) -> str:
        """A request id of the gateway's choosing (``prefix`` and a uuid), drawn so that it, or
        each of its choices' ``<id>-<k>``, lands in a shard with workers when the model has
        several shards and some have none now (a shard's workers down: its requests would wait
        there while the others are idle). A client's own id keeps its shard: its retries and
        Cancel find it by the id."""
        for _ in range(32):
            base = f"{prefix}{uuid.uuid4().hex}"
            if len(self.shards) == 1:
                return base
            ids = [base] if num_choices == 1 else [f"{base}-{k}" for k in range(num_choices)]
            if all(self.readers[self.shard_of(i).shard].num_workers != 0 for i in ids):
                return base
        return base

    async def claimed(self, request_id: str) -> bool:
        """Whether ``request_id`` is claimed (queued before, its claim not expired);
        ``QueueUnavailable`` when Redis does not answer."""
        keys = self.shard_of(request_id)
        try:
            return bool(await retry(lambda: self.redis.exists(keys.idempotency(request_id)), what="exists_claim"))
        except Exception as e:
            raise QueueUnavailable.of(e) from e

    def relaying(self, request_id: str) -> bool:
        """Whether this process relays ``request_id``."""
        return request_id in self.readers[self.shard_of(request_id).shard].relays

    async def stop(self) -> None:
        self.stopping = True
        for handle, request_id in list(self._graced.items()):  # left for their retries, as ``leave`` leaves them now
            handle.cancel()
            log.info("request.left_for_retry", request_id=request_id)
        self._graced.clear()
        if self._cancel_sender is not None:  # the cancels of streams cut at shutdown go out before Redis closes
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cancel_queue.join(), 5.0)
            self._cancel_sender.cancel()
        for r in self.readers.values():
            await r.stop()
        await self._admit_and_queue.aclose()

    def leave(self, q: Queued) -> None:
        """``q``'s caller went away: cancel its request, unless another call relays it. Not when
        this process is shutting down and the id is the client's own (the client retries it
        through another gateway, which relays it: a cancel would end it as aborted); not for a
        call that relayed a request queued before (a retry: the call that queued it, or another
        retry, may be reading it); and the first caller's cancel of a client's id is dropped
        when a retry of that id came meanwhile (the claim counts them)."""
        if (self.stopping and q.client_id) or not q.fresh:
            log.info("request.left_for_retry" if q.fresh else "request.retry_gone", request_id=q.request_id)
            self.readers[self.shard_of(q.request_id).shard].close(q.request_id)
            return
        log.info("request.client_gone", request_id=q.request_id)
        self.cancel_soon(q.request_id, unless_retried=q.client_id)

    def check(self, request: pb.GenerateRequest, *, choice_id: bool = False) -> list[int]:
        """The prompt's token ids; ``BadField`` naming what is wrong (``choice_id``: see ``validate.check``)."""
        return check(request, self.model, self.max_model_len, self.limits, choice_id=choice_id)

    async def enqueue(self, requests: Sequence[tuple[pb.GenerateRequest, list[int]]], traceparent: str,
                      *, client_ids: bool) -> list[Queued]:
        """Queue every checked ``(request, prompt_ids)`` (each with its ``request_id`` set), or none.

        ``client_ids``: the ids are the client's idempotency keys (an id queued before is
        relayed, not queued again). Raises ``Shed`` when the queue is full and
        ``QueueUnavailable`` when Redis does not answer (cancelling the ones already queued).
        """
        queued: list[Queued] = []
        for request, prompt_ids in requests:
            try:
                queued.append(await self._enqueue_one(request, prompt_ids, traceparent, client_ids))
            except BaseException as e:
                for q in queued:
                    if q.fresh:
                        self.cancel_soon(q.request_id)
                if isinstance(e, Exception) and not isinstance(e, (Shed, IdInUse)):
                    raise QueueUnavailable.of(e) from e
                raise
        return queued

    async def _enqueue_one(self, request: pb.GenerateRequest, prompt_ids: list[int], traceparent: str,
                           client_id: bool) -> Queued:
        rid = request.request_id
        keys = self.shard_of(rid)
        reader = self.readers[keys.shard]
        if client_id and self.siblings:
            await self._refuse_if_another_models(rid)
        deadline = int(time.time() * 1000) + request.deadline_ms if request.HasField("deadline_ms") else 0
        size = self.args.block_size
        sampling = pb.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if not sampling.HasField("seed"):
            # Every request gets a seed here, so one resumed elsewhere or recomputed after a
            # preemption continues its random draws instead of rolling new ones.
            sampling.seed = random.getrandbits(63)
        msg = cluster_pb2.AssignRequest(
            request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
            priority=request.priority, traceparent=traceparent, deadline_unix_ms=deadline,
            block_hashes=block_hashes(prompt_ids, size), hash_block_size=size, reply_to=reader.reply_to,
            model=self.name, gateway_chosen_id=not client_id,
        )
        with enqueue_span(msg, keys.requests, self.name, keys.shard):  # sets msg.traceparent when tracing
            # Never trimmed (no MAXLEN): the stream is a work queue whose entries leave when their
            # requests finish; trimming would drop requests no one has read. ``ADMIT_AND_QUEUE`` bounds it.
            fields = encode_request_entry(msg, int(time.time() * 1000))
            script_keys = [keys.requests, keys.num_waiting]
            # Every id is claimed in its shard (``req:<id>``), the gateway's own too, for the
            # lifetime of the request's output stream (the final write shortens both; past it, a
            # retry with this id is a new request): a client that sends an id the gateway chose
            # for a request still running is refused (its claim's fingerprint is empty), not
            # queued a second time to share the first call's relay (a review found one call
            # given the other's tokens); and a gateway serving several models finds a
            # request's shard by it (Cancel).
            script_keys.append(keys.idempotency(rid))
            fp = fingerprint(prompt_ids, request.sampling) if client_id else ""
            args = [self.args.max_stream_len, self.args.max_queue, REQUEST_TTL_S, fp,
                    *(x for kv in fields.items() for x in kv)]
            # Its relay is open before it is queued: its first tokens can come right after.
            opened = rid not in reader.relays
            reader.open(rid)
            try:
                answer = await retry(lambda: self._admit_and_queue(script_keys, args), what="enqueue",
                                     attempts=_ATTEMPTS)
            except BaseException:
                if opened:
                    reader.close(rid)
                # Its script may have run (the reply lost, or the caller gone while it ran): a
                # request queued so would run for no one, and no one can cancel an id the gateway
                # chose (one never queued ends as a done abort). Not a client's own id: its retry
                # with that id is relayed (a cancel would end it as aborted), and another call with
                # it may be relaying here.
                if not client_id:
                    self.cancel_soon(rid)
                raise
            if answer[0] == 0 and not client_id:
                # An id the gateway drew is claimed only by this call: queued "before" is this
                # call's own first attempt, whose reply was lost (``retry`` sent the script again).
                # It is this call's request, fresh, relayed from the steps as any other.
                answer = [1, ""]
            if answer[0] != 1 and opened:  # not queued now: nothing of ours relays it from the steps
                reader.close(rid)
            if answer[0] == -2:
                raise IdInUse(rid)
            if answer[0] == -1:
                _, waiting, length = answer
                raise Shed(f"queue is full ({waiting} waiting to be placed, {length} requests in the system); "
                           "retry later", self.args.retry_after)
            if answer[0] == 0:
                return Queued(rid, len(prompt_ids), fresh=False, client_id=client_id)
        self.metrics.queued_to(self.name, keys.shard)
        log.info("request.enqueued", request_id=rid, num_prompt_tokens=len(prompt_ids),
                 priority=request.priority, traceparent=msg.traceparent, model=self.name, shard=keys.shard)
        entry_id = answer[1].decode() if isinstance(answer[1], bytes) else str(answer[1])
        return Queued(rid, len(prompt_ids), fresh=True, entry_id=entry_id, fields=fields, client_id=client_id)

    async def _refuse_if_another_models(self, rid: str) -> None:
        """``IdInUse`` if another model served here holds a request of client id ``rid``: an id is
        claimed in its model's shard, and a Cancel by the id stops the requests of every model.
        (Looked up before this model claims it: two first calls of one id to two models at the
        same moment may both pass.)"""
        for other in self.siblings:
            for keys in other.shards:
                if await retry(lambda k=keys, o=other: o.redis.exists(k.idempotency(rid)), what="exists_claim"):
                    raise IdInUse(rid, other.name)

    async def requeue_if_lost(self, q: Queued) -> None:
        """Queue ``q``'s entry again if Redis lost it: neither its entry nor an owner record is
        there (a failover rolled back the write that queued it, before its scheduler read it).
        Called by a relay that has heard nothing of its request for a while. A request the
        scheduler took in has an owner record from its assignment until after its finish, and
        its entry until its finish; one queued twice is taken once (the scheduler knows its id)."""
        if not q.fresh or q.fields is None:
            return
        keys = self.shard_of(q.request_id)
        if await retry(lambda: self.redis.exists(keys.owner(q.request_id)), what="exists_own"):
            return
        # (No entry id: the reply that named it was lost. Queued again unlooked-for, the request
        # is taken once: the scheduler knows its id.)
        if q.entry_id and await retry(lambda: self.redis.xrange(keys.requests, q.entry_id, q.entry_id),
                                      what="xrange_entry"):
            return
        entry_id = await retry(lambda: self.redis.xadd(keys.requests, q.fields), what="requeue")
        log.warning("request.requeued_lost", request_id=q.request_id, entry_id=q.entry_id, shard=keys.shard)
        q.entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def relay(self, queued: Queued) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages, in order, to the last one; closing it early (the caller
        went away) queues a cancel so the worker frees the request's blocks."""
        finished = False
        rid = queued.request_id
        keys = self.shard_of(rid)
        reader = self.readers[keys.shard]
        step_relay = reader.relays.get(rid) if queued.fresh else None
        if step_relay is not None:
            messages = relay_steps(self.redis, keys, step_relay, queued.num_prompt_tokens, self.stream_interval,
                                   on_silence=lambda: self.requeue_if_lost(queued))
        else:  # queued before (a retry): replayed from its own output stream
            messages = relay(self.redis, keys, rid, queued.num_prompt_tokens)
        try:
            async for msg in messages:
                finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield msg
        except (RedisError, OSError) as e:  # past every retry: a status that says so, not UNKNOWN
            log.warning("request.relay_failed", request_id=rid, error=f"{type(e).__name__}: {e}")
            raise QueueUnavailable.of(e) from e
        finally:
            if step_relay is not None:
                reader.close(rid)
            if not finished:
                self.leave(queued)

    def relay_all(self, queued: Sequence[Queued]) -> Relays:
        """The messages of several requests as they come (see ``Relays``)."""
        return Relays(self, queued)

    def cancel_soon(self, request_id: str, unless_retried: bool = False) -> None:
        """Queue a cancel entry in the background (the caller may be gone already); nothing
        relays the request from here on. ``unless_retried``: not if its claim counts a retry
        (another call relays it)."""
        self.readers[self.shard_of(request_id).shard].close(request_id)
        if unless_retried:
            # A client that gave up on a stalled stream retries the id at once, often through
            # another gateway: its claim is looked up ``RETRY_GRACE_S`` later, so that a retry
            # sent meanwhile has counted itself first (Redis runs the two in the order sent,
            # even when both waited for it: a Redis frozen a while, and the stall is the reason).
            def graced():
                del self._graced[handle]
                self._queue_cancel(request_id, True)

            handle = asyncio.get_running_loop().call_later(RETRY_GRACE_S, graced)
            self._graced[handle] = request_id
            return
        self._queue_cancel(request_id, False)

    def _queue_cancel(self, request_id: str, unless_retried: bool) -> None:
        self._cancel_queue.put_nowait((request_id, unless_retried))
        if self._cancel_sender is None or self._cancel_sender.done():
            self._cancel_sender = asyncio.ensure_future(self._send_cancels())

    async def _send_cancels(self) -> None:
        """Send the queued cancels, up to ``CANCEL_BATCH`` a round trip (and one for the claims
        of those that go only while no retry relays them)."""
        queue = self._cancel_queue
        while True:
            batch = [await queue.get()]
            while len(batch) < CANCEL_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._send_cancel_batch(batch)
            except Exception as e:  # Redis gone past every retry: these run on to their end
                log.warning("request.cancels_lost", num_requests=len(batch), error=str(e))
            finally:
                for _ in batch:
                    queue.task_done()

    async def _send_cancel_batch(self, batch: list[tuple[str, bool]]) -> None:
        checked = [rid for rid, unless_retried in batch if unless_retried]
        retried: set[str] = set()
        if checked:
            async def claims():
                pipe = self.redis.pipeline(transaction=False)
                for rid in checked:
                    pipe.get(self.shard_of(rid).idempotency(rid))
                return await pipe.execute()

            for _ in range(_GRACE_ROUNDS):
                asked = time.monotonic()
                counts = await retry(claims, what="get_claims")
                if time.monotonic() - asked < RETRY_GRACE_S / 2:
                    break
                # Redis answered late (frozen, or away): a retry sent meanwhile may still be
                # waiting behind it (on a connection of its own, opened as Redis woke); the
                # grace counts from a prompt answer, so look again one grace later.
                await asyncio.sleep(RETRY_GRACE_S)
            # A claim is the request's fingerprint, and a '+' for each retry (``ADMIT_AND_QUEUE``);
            # a gateway's from before fingerprints, a count.
            retried = {rid for rid, held in zip(checked, counts, strict=True) if held is not None and (
                held[-1:] in (b"+", "+") or (held.isdigit() and int(held) > 1))}
            for rid in retried:
                log.info("request.left_to_its_retry", request_id=rid)
        send = [rid for rid, _ in batch if rid not in retried]
        if not send:
            return

        async def xadds():
            pipe = self.redis.pipeline(transaction=False)
            for rid in send:
                pipe.xadd(self.shard_of(rid).requests, encode_cancel_entry(rid))
            return await pipe.execute()

        await retry(xadds, what="xadd_cancels", attempts=20)

    async def cancel(self, request_id: str, attempts: int = _ATTEMPTS, keys: Keys | None = None) -> None:
        """Queue a cancel entry for ``request_id`` in its shard (``keys``: this one; Redis
        errors propagate)."""
        keys = keys or self.shard_of(request_id)
        await retry(lambda: self.redis.xadd(keys.requests, encode_cancel_entry(request_id)),
                    what="xadd_cancel", attempts=attempts)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """Whether Redis answers now."""
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), timeout_s))
        except Exception:
            return False


class Relays:
    """``(i, message)`` for every ``queued[i]``, as the messages come, until all have finished.

    Messages are pulled from the requests' relays as the caller asks for them, never ahead:
    at most one message a request waits here (a relay's own bound, ``MAX_BUFFERED``, then keeps
    a client that does not read from costing the gateway memory: its backlog stays in Redis).
    One request's relay is read straight; several are read by a pull each, whichever answers
    first.

    Whoever holds it must ``aclose()`` it: that cancels every request still running, whether
    or not a message was read (a caller can be gone before the first one). Idempotent.
    """

    def __init__(self, core: GatewayCore, queued: Sequence[Queued]) -> None:
        self._core = core
        self._queued = list(queued)
        self._relays: list[AsyncIterator[pb.GenerateResponse]] | None = None  # None until the first read
        self._pulls: dict[asyncio.Future, int] = {}  # several requests: the pull in flight of each

    def __aiter__(self) -> Relays:
        return self

    async def __anext__(self) -> tuple[int, pb.GenerateResponse]:
        relays = self._relays
        if relays is None:
            relays = self._relays = [self._core.relay(q) for q in self._queued]
            if len(relays) > 1:
                self._pulls = {asyncio.ensure_future(r.__anext__()): i for i, r in enumerate(relays)}
        if len(relays) == 1:  # the common case: no task, no queue
            return 0, await relays[0].__anext__()
        pulls = self._pulls
        while pulls:
            done = [f for f in pulls if f.done()]
            if not done:
                done, _ = await asyncio.wait(pulls, return_when=asyncio.FIRST_COMPLETED)
            f = min(done, key=pulls.__getitem__)  # the lowest choice first among those ready
            i = pulls.pop(f)
            try:
                msg = f.result()
            except StopAsyncIteration:  # that request is through
                continue
            if msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED:  # its next message, pulled once this one is taken
                pulls[asyncio.ensure_future(relays[i].__anext__())] = i
            return i, msg
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._relays is None:  # never read: nothing relays them, so nothing else cancels them
            self._relays = []
            for q in self._queued:
                self._core.leave(q)
        pulls, self._pulls = list(self._pulls), {}
        for f in pulls:
            f.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        for r in self._relays:  # a relay that did not finish queues its request's cancel as it closes
            with contextlib.suppress(Exception):
                await r.aclose()
