"""The steps reader's blocking ``XREAD``, on a Redis connection of its own.

The reader (``relay.StepReader``) wakes for every write of any worker, so its ``XREAD`` is the
gateway's most frequent Redis call. Through redis-py's client each call takes a connection
from the pool and gives it back, runs retry and telemetry hooks, and turns every entry into a
dict; on a connection held for this read alone, the command is sent and its reply read as it
comes (~40 µs of CPU less a read). With a Redis Cluster client (no single connection to
hold; all of a shard's steps streams share one slot) the read goes through the client.

Either way a read returns ``[(stream, [(entry_id, [field, value, field, value, ...]), ...]), ...]``
(pairs as lists or tuples; streams as ``str``, the rest as ``bytes``); errors propagate (``retry`` sends it again), and a
connection that failed or was interrupted mid-reply is dropped, never reused.
"""

from __future__ import annotations


class StepsRead:
    """``await read(cursors, count, block_ms)``: ``XREAD COUNT count BLOCK block_ms STREAMS ...``."""

    def __init__(self, redis) -> None:
        import redis.asyncio as aioredis

        self.redis = redis
        self._own = isinstance(redis, aioredis.Redis)  # else a cluster client: through it
        self._conn = None

    async def __call__(self, cursors: dict[str, str], count: int, block_ms: int) -> list:
        if not self._own:
            resp = await self.redis.xread(cursors, count=count, block=block_ms)
            return [(_str(key), [(eid, [x for kv in fields.items() for x in kv]) for eid, fields in entries])
                    for key, entries in resp or ()]
        conn = self._conn
        if conn is None:
            conn = self.redis.connection_pool.make_connection()
            await conn.connect()
            self._conn = conn
        try:
            await conn.send_command("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", *cursors, *cursors.values())
            resp = await conn.read_response()
        except BaseException:
            self._conn = None
            await conn.disconnect()
            raise
        if not resp:
            return []
        pairs = resp.items() if isinstance(resp, dict) else resp  # RESP3: a map; RESP2: [stream, entries] pairs
        return [(_str(key), entries) for key, entries in pairs]

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()


def _str(key) -> str:
    return key.decode() if isinstance(key, bytes) else key
