"""A dedicated Redis connection for one writer's hot path, on a thread of its own: commands
packed by hiredis, sent in one socket write, replies parsed by hiredis; none of the client's
per-call machinery, and no event loop.

redis-py's asyncio client spends ~100 µs of CPU on a bare ``XADD`` of a 2.7 kB step here
(its pool, retry wrapper, timeouts, parser and response callbacks), and a worker's event loop
as much again to hand each step to it and wake on its reply. ``BlockingLane`` is a blocking
socket opened by redis-py's synchronous connection class of the client's kind, with the
client's own arguments (TLS, AUTH, the database, as configured), which it then writes and
reads directly: ~40-50 µs of a thread's CPU a step's write on this machine, nearly all of it
the send and the wake-up on the reply, with the GIL released while it waits. Replies come back
as hiredis gives them (bytes, ints, lists, and ``hiredis.ReplyError`` for an error reply,
returned, not raised). It speaks RESP2: no push frame can come between a command and its reply.

Contract: ``call`` sends its commands in order as one pipeline and returns every reply; a
broken, slow (``timeout_s``) or interrupted exchange closes the connection (its replies may
be lost) and raises ``redis.exceptions.ConnectionError`` (callers back off and call again; the
next call reconnects). Only a standalone client has one (``blocking_lane_for``); with a Redis
Cluster client callers use the client, as they do after ``LaneUnavailable``.

Without waiting: once open over a plain socket (TCP or unix, not TLS), ``send_nowait`` writes
what the socket takes now and ``reply_nowait`` parses a reply if one has come, each one system
call on the socket's non-blocking descriptor; ``reply`` waits for the next (as ``call`` does,
up to ``timeout_s``) and ``send_rest`` sends what ``send_nowait`` left. Replies owed that way
are the caller's to read before its next ``call``. A caller holds the lane alone (one lock).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import ssl

import hiredis

# No reply for this long: the connection is given up (the client's own socket timeout).
TIMEOUT_S = 30.0


def pack(commands: list[tuple]) -> bytes:
    """``commands`` in Redis's protocol, one pipeline (hiredis packs each)."""
    return b"".join([hiredis.pack_command(c) for c in commands])


class LaneUnavailable(Exception):
    """This client's connections expose no socket to use directly: use the client."""


# The asyncio pool's connection arguments that are objects of the asyncio client (its retry,
# hooks and notification handlers): a synchronous connection makes its own.
_ASYNC_ONLY = ("retry", "redis_connect_func", "event_dispatcher", "parser_class", "command_packer",
               "himport_registry", "credential_provider")


class BlockingLane:
    def __init__(self, connection_class, connection_kwargs: dict, timeout_s: float = TIMEOUT_S) -> None:
        """``connection_class``: redis-py's synchronous connection class (``redis.connection``)."""
        self._connection_class = connection_class
        self._kwargs = connection_kwargs
        self.timeout_s = timeout_s
        self._conn = None
        self._sock = None
        self._parser = hiredis.Reader()

    def _open(self) -> None:
        conn = self._connection_class(**self._kwargs)
        conn.connect()
        sock = getattr(conn, "_sock", None)
        if sock is None:
            conn.disconnect()
            raise LaneUnavailable(f"{type(conn).__name__} exposes no socket")
        sock.settimeout(self.timeout_s)
        self._conn, self._sock, self._parser = conn, sock, hiredis.Reader()

    @property
    def direct(self) -> bool:
        """Whether ``send_nowait`` and ``reply_nowait`` can be used now: open, over a plain socket."""
        sock = self._sock
        return sock is not None and not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() is not None

    def send_nowait(self, data: bytes) -> int:
        """Write what the socket takes of ``data`` now (the lane is ``direct``); the bytes written.
        A broken connection is closed and raised (``redis.exceptions.ConnectionError``)."""
        try:
            return os.write(self._sock.fileno(), data)  # the descriptor of a socket with a timeout is non-blocking
        except BlockingIOError:
            return 0
        except OSError as e:
            self._broken(e)

    def send_rest(self, data: bytes) -> None:
        """Send ``data`` whole, waiting up to ``timeout_s`` (what ``send_nowait`` left)."""
        try:
            self._sock.sendall(data)
        except OSError as e:
            self._broken(e)

    def reply_nowait(self):
        """The next reply if it has come (at most one read of the socket), else ``False``."""
        try:
            r = self._parser.gets()
            if r is not False:
                return r
            try:
                data = os.read(self._sock.fileno(), 65536)
            except BlockingIOError:
                return False
            if not data:
                raise EOFError("Redis closed the connection")
            self._parser.feed(data)
            return self._parser.gets()
        except (OSError, EOFError, hiredis.ProtocolError) as e:
            self._broken(e)

    def reply(self):
        """The next reply, waiting up to ``timeout_s`` for it."""
        import redis.exceptions as rx

        try:
            while (r := self._parser.gets()) is False:
                data = self._sock.recv(65536)
                if not data:
                    raise EOFError("Redis closed the connection")
                self._parser.feed(data)
            return r
        except (OSError, EOFError, hiredis.ProtocolError, rx.TimeoutError) as e:
            self._broken(e)

    def _broken(self, e: BaseException):
        import redis.exceptions as rx

        self.close()
        raise rx.ConnectionError(f"steps connection: {e or type(e).__name__}") from e

    def close(self) -> None:
        conn, self._conn, self._sock = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing to save
                conn.disconnect()

    def call(self, commands: list[tuple]) -> list:
        """Every reply of ``commands`` (sent as one pipeline), in order."""
        import redis.exceptions as rx

        try:
            if self._sock is None:
                self._open()
            self._sock.sendall(pack(commands))
            parser, sock, out = self._parser, self._sock, []
            while len(out) < len(commands):
                r = parser.gets()
                if r is False:
                    data = sock.recv(65536)
                    if not data:
                        raise EOFError("Redis closed the connection")
                    parser.feed(data)
                    continue
                out.append(r)
            return out
        except LaneUnavailable:
            raise
        except (OSError, EOFError, hiredis.ProtocolError, rx.ConnectionError, rx.TimeoutError) as e:
            self.close()
            raise rx.ConnectionError(f"steps connection: {e or type(e).__name__}") from e
        except BaseException:  # interrupted mid-exchange: its replies would answer the next call
            self.close()
            raise


def blocking_lane_for(client) -> BlockingLane | None:
    """A ``BlockingLane`` to the server of ``client`` (a standalone redis-py asyncio client),
    opened with its connection arguments; None for any other client."""
    import redis.asyncio as aioredis
    import redis.connection as sync_connection

    if type(client) is not aioredis.Redis:
        return None
    pool = client.connection_pool
    if not hasattr(pool, "connection_class") or not hasattr(pool, "connection_kwargs"):
        return None
    cls = getattr(sync_connection, pool.connection_class.__name__, None)
    if cls is None:
        return None
    accepted = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            accepted |= set(inspect.signature(klass.__init__).parameters)
    kwargs = {k: v for k, v in pool.connection_kwargs.items()
              if k in accepted and k not in _ASYNC_ONLY and not k.startswith(("maint_", "orig_"))}
    kwargs["protocol"] = 2  # RESP2: no push frame can come between a command and its reply
    return BlockingLane(cls, kwargs)
