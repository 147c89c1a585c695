"""Fenced request ownership: who may write a request's output, decided in Redis, atomically.

Every request has an owner record ``<ns>:own:<request_id>`` (a hash: ``epoch``, ``worker``,
``done``). The scheduler takes a new epoch for each assignment (``Fencing.assign``: one Lua
script that also refuses a scheduler whose own epoch is no longer the current one). Every
write to the request's output stream goes through ``Fencing.write`` (one Lua script per
message, pipelined per step): it appends only if the writer's epoch is still the request's
epoch and the request is not done, so a worker that was declared dead (or whose request
was cancelled or moved) can never splice tokens into a stream that someone else now owns;
its writes are refused and it drops the request. The final write of a request, its
acknowledgement in the requests stream, the owner record's ``done`` flag and a record in
``<ns>:done`` (the stream the scheduler learns finishes from) are one atomic step: a
request is finished exactly when its last message is durable.

Lifetimes: the output stream, the owner record and the idempotency key of a request share
one lifetime (``REQUEST_TTL_S`` while it runs, ``DONE_TTL_S`` after it finished); after it a
retry with the same id is a new request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .redis import GROUP, Keys, OutEntry

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

# KEYS: own, out stream, requests stream, done stream, idempotency key.
# ARGV: epoch, final (0/1), entry id ('' for none), request id, finish reason, n, then n
# field/value pairs of the message. Returns 1 if written, 0 if refused (stale epoch or done).
_WRITE = """
local own = KEYS[1]
local cur = redis.call('HGET', own, 'epoch') or '0'
if cur ~= ARGV[1] or redis.call('HGET', own, 'done') == '1' then return 0 end
local n = tonumber(ARGV[6])
local fields = {}
for i = 1, 2 * n do fields[i] = ARGV[6 + i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
local ttl = tonumber(ARGV[7 + 2 * n])
if ARGV[2] == '1' then
  local done_ttl = tonumber(ARGV[8 + 2 * n])
  redis.call('HSET', own, 'done', '1')
  redis.call('EXPIRE', own, done_ttl)
  redis.call('EXPIRE', KEYS[2], done_ttl)
  if redis.call('EXISTS', KEYS[5]) == 1 then redis.call('EXPIRE', KEYS[5], done_ttl) end
  if ARGV[3] ~= '' then
    redis.call('XACK', KEYS[3], ARGV[9 + 2 * n], ARGV[3])
    redis.call('XDEL', KEYS[3], ARGV[3])
  end
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[10 + 2 * n], '*', 'rid', ARGV[4], 'epoch', ARGV[1], 'f', ARGV[5])
else
  redis.call('EXPIRE', own, ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return 1
"""

# KEYS: own. ARGV: epoch. Returns 1 when the epoch is still the request's and it is not done.
_OWNS = """
local cur = redis.call('HGET', KEYS[1], 'epoch') or '0'
if cur ~= ARGV[1] or redis.call('HGET', KEYS[1], 'done') == '1' then return 0 end
return 1
"""


@dataclass(frozen=True, slots=True)
class Write:
    """One message for a request's output stream, written under ``epoch``."""

    request_id: str
    epoch: int
    entry: OutEntry
    entry_id: str = ""  # with a final message: the requests-stream entry to acknowledge

    @property
    def final(self) -> bool:
        return bool(self.entry.finish_reason)


class Fencing:
    """The Lua scripts, registered once per Redis client (``register_script``: EVALSHA, with
    a fallback to EVAL when the server lost its script cache, e.g. after a restart)."""

    def __init__(self, redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._assign = redis.register_script(_ASSIGN)
        self._write = redis.register_script(_WRITE)
        self._owns = redis.register_script(_OWNS)

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

    async def queue_write(self, pipe, w: Write) -> None:
        """Add ``w`` to a pipeline (nothing is sent yet); its result is 1 (written) or 0
        (refused: not the owner)."""
        fields = w.entry.encode()
        args: list = [w.epoch, 1 if w.final else 0, w.entry_id, w.request_id, w.entry.finish_reason,
                      len(fields)]
        for k, v in fields.items():
            args += [k, v]
        args += [REQUEST_TTL_S, DONE_TTL_S, GROUP, DONE_STREAM_MAXLEN]
        keys = [self.keys.owner(w.request_id), self.keys.out(w.request_id), self.keys.requests,
                self.keys.done, self.keys.idempotency(w.request_id)]
        await self._write(keys=keys, args=args, client=pipe)

    async def write(self, writes: list[Write]) -> list[bool]:
        """Write every message in one round trip; for each, whether it was accepted."""
        if not writes:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for w in writes:
            await self.queue_write(pipe, w)
        return [bool(r) for r in await pipe.execute()]

    async def owns(self, request_id: str, epoch: int) -> bool:
        return bool(await self._owns(keys=[self.keys.owner(request_id)], args=[epoch]))
