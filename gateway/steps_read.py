"""The steps reader's blocking ``XREAD``, on a Redis connection of its own.

The reader (``relay.StepReader``) wakes for every write of any worker, so its ``XREAD`` is the
gateway's most frequent Redis call. Through redis-py's client each call takes a connection
from the pool and gives it back, runs retry and telemetry hooks, and turns every entry into a
dict, and a send with a timeout costs a task of its own; on a connection held for this read
alone (a ``RedisMux`` of its own: hiredis packs the command and parses the reply, no task a
call) the read costs a write, the wake-up on its reply and the parse. With a Redis Cluster
client (no single connection to hold; all of a shard's steps streams share one slot) the read
goes through the client.

Either way a read returns ``[(stream, [(entry_id, [field, value, field, value, ...]), ...]), ...]``
(pairs as lists or tuples; streams as ``str``, the rest as ``bytes``); errors propagate
(``retry`` sends it again); a connection that failed is dropped, never reused, and the reply
of a read whose caller went away is read and dropped, never taken for the next read's.
"""

from __future__ import annotations

from pagefleet.common.redis_mux import mux_for


class StepsRead:
    """``await read(cursors, count, block_ms)``: ``XREAD COUNT count BLOCK block_ms STREAMS ...``."""

    def __init__(self, redis) -> None:
        self.redis = redis
        self._mux = mux_for(redis)  # None: a cluster client, read through it

    async def __call__(self, cursors: dict[str, str], count: int, block_ms: int) -> list:
        if self._mux is None:
            resp = await self.redis.xread(cursors, count=count, block=block_ms)
            return [(_str(key), [(eid, [x for kv in fields.items() for x in kv]) for eid, fields in entries])
                    for key, entries in resp or ()]
        resp = await self._mux.call("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", *cursors, *cursors.values())
        return [(_str(key), entries) for key, entries in resp] if resp else []

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.aclose()


def _str(key) -> str:
    return key.decode() if isinstance(key, bytes) else key
