"""Fenced request ownership: who may write a request's output, decided in Redis, atomically.

Every request has an owner record ``<ns>:own:<request_id>`` (a hash: ``epoch``, ``worker``,
``done``). The scheduler takes a new epoch for each assignment (``Fencing.assign``: one Lua
script that also refuses a scheduler whose own epoch is no longer the current one). Every
write to the request's output stream goes through ``Fencing.write`` (one Lua script per
step of a worker, for all its requests): it appends only if the writer's epoch is still the request's
epoch and the request is not done, so a worker that was declared dead (or whose request
was cancelled or moved) can never splice tokens into a stream that someone else now owns;
its writes are refused and it drops the request. The final write of a request, its
acknowledgement in the requests stream, the owner record's ``done`` flag and a record in
``<ns>:done`` (the stream the scheduler learns finishes from) are one atomic step: a
request is finished exactly when its last message is durable.

Every accepted message also goes into the writer's steps stream (``<ns>:steps:<writer>``), one
entry per write: the gateways relay from those, one blocking read for all their requests. A
refused message goes into neither, so what a gateway relays is always what the request's own
output stream holds.

Lifetimes: the output stream, the owner record and the idempotency key of a request share
one lifetime (``REQUEST_TTL_S`` while it runs, set by its first message on a worker and
refreshed every few hundred messages after; ``DONE_TTL_S`` after it finished); after it a
retry with the same id is a new request. A steps stream keeps ``STEPS_KEEP_MS`` of entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .redis import GROUP, SCHEDULER_STEPS, Keys, OutEntry

# A running request's keys live this long after its latest write.
REQUEST_TTL_S = 3600
# A finished request's output (and its idempotency key) stays this long for late or repeated readers.
DONE_TTL_S = 300
# The done stream keeps about this many records (the scheduler reads it as they come).
DONE_STREAM_MAXLEN = 100_000

# KEYS: own, scheduler epoch key. ARGV: scheduler epoch, worker id, ttl.
# Returns the new epoch; 0 if the request is done already; -1 if this scheduler is stale.
_ASSIGN = """
if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'done') == '1' then return 0 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'worker', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return epoch
"""

# One round trip for every message of a write (a step of one worker, or the steps it fell
# behind by), whatever the number of requests: each message is checked against its request's
# owner record (one HMGET) and appended to the request's output stream; the accepted ones also
# go, joined, into one entry of the writer's steps stream (what gateways relay from). TTLs are
# set where the worker asks (a request's first message of an assignment, then now and then),
# and at the finish, not at every write.
# KEYS: steps stream, requests stream, done stream, then for each message: own, out, idempotency key.
# ARGV: n, group, done stream maxlen, request ttl, done ttl, steps stream MINID (ms), steps
# stream ttl (0: leave it), then for each message: epoch, final (0/1), entry id ('' for none),
# request id, finish reason, refresh ttl (0/1), step piece, k, then k field/value pairs.
# Returns, per message, 1 if written, 0 if refused (stale epoch or done).
_WRITE = """
local n = tonumber(ARGV[1])
local ttl, done_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local res, pieces = {}, {}
local a = 8
for i = 1, n do
  local own, out, idem = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local epoch, final, entry_id, rid, finish, refresh, piece =
    ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local f0 = a + 8
  a = f0 + 2 * tonumber(ARGV[a + 7])
  local cur = redis.call('HMGET', own, 'epoch', 'done')
  if (cur[1] or '0') ~= epoch or cur[2] == '1' then
    res[i] = 0
  else
    redis.call('XADD', out, '*', unpack(ARGV, f0, a - 1))
    pieces[#pieces + 1] = piece
    if final == '1' then
      redis.call('HSET', own, 'done', '1')
      redis.call('EXPIRE', own, done_ttl)
      redis.call('EXPIRE', out, done_ttl)
      if redis.call('EXISTS', idem) == 1 then redis.call('EXPIRE', idem, done_ttl) end
      if entry_id ~= '' then
        redis.call('XACK', KEYS[2], ARGV[2], entry_id)
        redis.call('XDEL', KEYS[2], entry_id)
      end
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'rid', rid, 'epoch', epoch, 'f', finish)
    elseif refresh == '1' then
      redis.call('EXPIRE', own, ttl)
      redis.call('EXPIRE', out, ttl)
    end
    res[i] = 1
  end
end
if #pieces > 0 then
  redis.call('XADD', KEYS[1], 'MINID', '~', ARGV[6], '*', 'o', table.concat(pieces))
  if ARGV[7] ~= '0' then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[7])) end
end
return res
"""

# KEYS: own. ARGV: epoch. Returns 1 when the epoch is still the request's and it is not done.
_OWNS = """
local cur = redis.call('HGET', KEYS[1], 'epoch') or '0'
if cur ~= ARGV[1] or redis.call('HGET', KEYS[1], 'done') == '1' then return 0 end
return 1
"""


# A steps stream keeps about this long of entries (gateways read them as they come; a relay
# that falls further behind reads the request's own output stream instead).
STEPS_KEEP_MS = 60_000
# A steps stream outlives its writer's last write by this long.
STEPS_TTL_S = 600


@dataclass(frozen=True, slots=True)
class Write:
    """One message for a request's output stream, written under ``epoch``.

    ``refresh_ttl``: (re)set the request's TTLs with it (its first message of an assignment,
    and now and then after: a write does not touch them otherwise)."""

    request_id: str
    epoch: int
    entry: OutEntry
    entry_id: str = ""  # with a final message: the requests-stream entry to acknowledge
    refresh_ttl: bool = True

    @property
    def final(self) -> bool:
        return bool(self.entry.finish_reason)


def step_piece(request_id: str, e: OutEntry) -> bytes:
    """``e`` as a one-message ``StepOutputs`` (pieces concatenated: the StepOutputs of all)."""
    from pagefleet.protos import cluster_pb2, generation_pb2

    o = cluster_pb2.StepOutput(request_id=request_id, index=e.index, token_ids=e.token_ids, text=e.text,
                               finish_reason=e.finish_reason, error=e.error)
    if e.logprobs:
        o.logprobs.extend(generation_pb2.TokenLogprobs(
            logprob=x.logprob,
            top_logprobs=[generation_pb2.TopLogprob(token_id=t, logprob=v)
                          for t, v in zip(x.top_token_ids, x.top_logprobs, strict=True)])
            for x in e.logprobs)
    return cluster_pb2.StepOutputs(outputs=[o]).SerializeToString()


class Fencing:
    """The Lua scripts, registered once per Redis client (``register_script``: EVALSHA, with
    a fallback to EVAL when the server lost its script cache, e.g. after a restart).

    ``writer_id``: whose steps stream ``write`` appends to (a worker's id, or the scheduler's)."""

    def __init__(self, redis, keys: Keys, writer_id: str = SCHEDULER_STEPS) -> None:
        self.redis = redis
        self.keys = keys
        self.steps_key = keys.steps(writer_id)
        self._assign = redis.register_script(_ASSIGN)
        self._write = redis.register_script(_WRITE)
        self._owns = redis.register_script(_OWNS)
        self._steps_ttl_at = 0.0  # when the steps stream's TTL was last set (monotonic)

    async def assign(self, request_id: str, scheduler_epoch: int, worker_id: str) -> int:
        """A new epoch for ``request_id`` on ``worker_id``; 0 if it finished already, -1 if
        ``scheduler_epoch`` is no longer the current scheduler's (stop placing)."""
        keys = [self.keys.owner(request_id), self.keys.scheduler_epoch]
        return int(await self._assign(keys=keys, args=[scheduler_epoch, worker_id, REQUEST_TTL_S]))

    async def assign_many(self, owners: list[tuple[str, str]], scheduler_epoch: int) -> list[int]:
        """``assign`` for each ``(request_id, worker_id)`` of ``owners``, in one round trip."""
        if not owners:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for request_id, worker_id in owners:
            await self._assign(keys=[self.keys.owner(request_id), self.keys.scheduler_epoch],
                               args=[scheduler_epoch, worker_id, REQUEST_TTL_S], client=pipe)
        return [int(e) for e in await pipe.execute()]

    def _write_call(self, writes: list[Write]) -> tuple[list[str], list]:
        """The keys and arguments of one ``_WRITE`` call for ``writes``."""
        now = time.monotonic()
        steps_ttl = 0
        if now - self._steps_ttl_at > STEPS_TTL_S / 4:
            self._steps_ttl_at, steps_ttl = now, STEPS_TTL_S
        keys = [self.steps_key, self.keys.requests, self.keys.done]
        args: list = [len(writes), GROUP, DONE_STREAM_MAXLEN, REQUEST_TTL_S, DONE_TTL_S,
                      int(time.time() * 1000) - STEPS_KEEP_MS, steps_ttl]
        for w in writes:
            rid = w.request_id
            keys += [self.keys.owner(rid), self.keys.out(rid), self.keys.idempotency(rid)]
            fields = w.entry.encode()
            args += [w.epoch, 1 if w.final else 0, w.entry_id, rid, w.entry.finish_reason,
                     1 if w.refresh_ttl else 0, step_piece(rid, w.entry), len(fields)]
            for k, v in fields.items():
                args += [k, v]
        return keys, args

    async def write(self, writes: list[Write]) -> list[bool]:
        """Write every message in one round trip (one script call); for each, whether it was accepted."""
        if not writes:
            return []
        keys, args = self._write_call(writes)
        return [bool(r) for r in await self._write(keys=keys, args=args)]

    async def owns(self, request_id: str, epoch: int) -> bool:
        return bool(await self._owns(keys=[self.keys.owner(request_id)], args=[epoch]))
