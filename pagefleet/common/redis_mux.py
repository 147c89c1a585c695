"""Many callers' non-blocking Redis commands on one connection, pipelined: a command costs a
pack, a write and a future, not a client round.

redis-py's asyncio client spends ~100 µs of CPU on each command here (a connection from its
pool and back, its retry wrapper, a task for the send's timeout, the parser's timeout context,
response callbacks); a gateway queues each request with one script call, and a scheduler
fences each round with one. ``RedisMux`` holds one connection, opened by the client's own
connection class with the client's arguments (TLS, AUTH, the database, as configured), and
writes each call's commands to it at once; one reader task parses the replies with hiredis as
they come and hands each to its caller, in the order sent (Redis answers a connection's
commands in order). Callers never wait for each other: a second call goes out while the
first waits for its reply.

Contract: ``call`` sends one command and returns its reply (an error reply raised as redis-py
raises it: ``ResponseError``, ``NoScriptError``, ...); ``pipeline`` sends several at once and
returns every reply, errors as values. Replies come as hiredis gives them (bytes, ints, lists:
RESP2). A broken connection, or one with a reply owed for longer than ``timeout_s``, fails
every call waiting on it with ``redis.exceptions.ConnectionError`` (their replies may be lost:
callers' ``retry`` sends them again, as after any lost connection); the next call reconnects.
A caller that is cancelled leaves its reply to be read and dropped. Blocking commands
(``BLPOP``, ``XREAD ... BLOCK``) must not come here: they would hold every later caller.

Only a standalone client has one (``mux_for``); with a Redis Cluster client callers use the
client.
"""

from __future__ import annotations

import asyncio
import collections
import time

import hiredis

from .redis_lane import TIMEOUT_S, pack

# Bytes waiting to be written past which a call waits for the socket to drain.
MAX_UNSENT = 1 << 20


class _Link:
    """One open connection: its writer, and the calls that wait for its replies, in order
    (each ``[future, replies owed, replies, sent at]``)."""

    __slots__ = ("conn", "writer", "pending", "timed_out")

    def __init__(self, conn) -> None:
        self.conn, self.writer = conn, conn._writer
        self.pending: collections.deque = collections.deque()
        self.timed_out = False

    @property
    def open(self) -> bool:
        return not self.writer.transport.is_closing()


class RedisMux:
    def __init__(self, client, timeout_s: float = TIMEOUT_S) -> None:
        """``client``: a standalone redis-py asyncio client (``mux_for`` checks)."""
        self.client = client
        self.timeout_s = timeout_s
        self._link: _Link | None = None
        self._readers: set[asyncio.Task] = set()
        self._connecting: asyncio.Lock | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._closing = object()  # a new one each ``aclose``: a connect that spans one is dropped
        self.num_connects = 0

    async def call(self, *args):
        """One command's reply (an error reply raised)."""
        reply = (await self._send([args]))[0]
        if isinstance(reply, hiredis.ReplyError):
            raise _error(reply)
        return reply

    async def script(self, script, keys: list, args: list):
        """``script``'s answer (``script``: from ``register_script``): by its sha, by its text
        where Redis lost it (``EVAL`` caches it again)."""
        import redis.exceptions as rx

        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except rx.NoScriptError:
            return await self.call("EVAL", script.script, len(keys), *keys, *args)

    async def pipeline(self, commands: list[tuple]) -> list:
        """Every reply of ``commands``, sent at once, in order; error replies as redis-py's
        exceptions (values, not raised)."""
        if not commands:
            return []
        return [_error(r) if isinstance(r, hiredis.ReplyError) else r for r in await self._send(commands)]

    async def _send(self, commands: list[tuple]) -> list:
        # Packed before anything is owed: a command that cannot be sent (an argument that is
        # not bytes, str or a number; no command at all, which Redis never answers) fails its
        # caller alone and leaves no reply owed that would shift every later caller's.
        if not all(commands):
            raise ValueError("a Redis command needs at least its name")
        data = pack(commands)
        link = self._link
        if link is None or not link.open:
            link = await self._connect()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        link.pending.append([fut, len(commands), [], time.monotonic()])  # and written, with no await between
        link.writer.write(data)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self.timeout_s, self._watch)
        if link.writer.transport.get_write_buffer_size() > MAX_UNSENT:
            await link.writer.drain()
        return await fut

    async def _connect(self) -> _Link:
        import redis.exceptions as rx

        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._link is not None and self._link.open:
                return self._link
            pool = self.client.connection_pool
            conn = pool.connection_class(**{**pool.connection_kwargs, "protocol": 2})
            closing = self._closing
            try:
                await conn.connect()
                if conn._reader is None or conn._writer is None:
                    raise rx.ConnectionError(f"{type(conn).__name__} exposes no stream")
                if self._closing is not closing:  # ``aclose`` ran meanwhile: nothing may outlive it
                    raise rx.ConnectionError("the connection was closed")
            except BaseException:
                await conn.disconnect()
                raise
            link = self._link = _Link(conn)
            self.num_connects += 1
            task = asyncio.get_running_loop().create_task(self._read(link))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)
            return link

    async def _read(self, link: _Link) -> None:
        """Hand each reply to its caller, in order; at the end, fail every call still waiting."""
        import redis.exceptions as rx

        parser, pending, reader = hiredis.Reader(), link.pending, link.conn._reader
        error: BaseException = rx.ConnectionError("Redis closed the connection")
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    if link.timed_out:
                        error = rx.ConnectionError(f"no reply from Redis for {self.timeout_s:g} s")
                    return
                parser.feed(data)
                while (r := parser.gets()) is not False:
                    waiting = pending[0]
                    waiting[2].append(r)
                    if len(waiting[2]) == waiting[1]:
                        pending.popleft()
                        if not waiting[0].done():
                            waiting[0].set_result(waiting[2])
        except (OSError, hiredis.ProtocolError, IndexError) as e:  # IndexError: a reply no call was owed
            error = rx.ConnectionError(f"Redis connection: {e or type(e).__name__}")
        except asyncio.CancelledError:
            error = rx.ConnectionError("the connection was closed")
            raise
        finally:
            if self._link is link:
                self._link = None
            link.writer.close()
            link.conn._reader = link.conn._writer = None  # closed: as redis-py's own close leaves it
            for fut, *_ in pending:
                if not fut.done():
                    fut.set_exception(error)
            pending.clear()

    def _watch(self) -> None:
        """Close the connection if its oldest call has waited ``timeout_s`` for its reply; else
        look again when that call would have (one timer a connection, not one a call)."""
        self._watchdog = None
        link = self._link
        if link is None or not link.pending:
            return
        late = link.pending[0][3] + self.timeout_s - time.monotonic()
        if late <= 0:
            link.timed_out = True
            link.writer.transport.abort()  # its reader sees the end and fails every call
            return
        self._watchdog = asyncio.get_running_loop().call_later(late, self._watch)

    async def aclose(self) -> None:
        """Close the connection (its waiting calls fail with a connection error). A later call
        opens a new one; a connection being opened as this runs is closed once open."""
        self._closing = object()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        readers = list(self._readers)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


def _error(reply: hiredis.ReplyError):
    """An error reply as redis-py raises it (``NoScriptError`` for NOSCRIPT, ...)."""
    from redis._parsers.base import BaseParser

    return BaseParser.parse_error(str(reply))


def stream_entries(reply) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """An ``XREAD``/``XREADGROUP`` reply as ``[(stream, [(entry id, {field: value}), ...]), ...]``:
    each entry as redis-py's client gives it (an entry deleted since it was delivered: ``{}``),
    the stream's name as ``str``."""
    return [(key.decode() if isinstance(key, bytes) else key,
             [(eid, dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}) for eid, flat in entries])
            for key, entries in reply or ()]


def mux_for(client) -> RedisMux | None:
    """A ``RedisMux`` to the server of ``client`` (a standalone redis-py asyncio client); None
    for any other client."""
    import redis.asyncio as aioredis

    if type(client) is not aioredis.Redis:
        return None
    pool = client.connection_pool
    if not hasattr(pool, "connection_class") or not hasattr(pool, "connection_kwargs"):
        return None
    return RedisMux(client)
