"""Many callers' commands on one pipelined connection (``redis_mux.RedisMux``) against a real
redis-server: replies to their callers in order whatever the interleaving, error replies as
redis-py raises them, a cancelled caller's reply dropped without shifting the others', AUTH as
the client is configured, a broken or silent connection failing its waiting calls as a
connection error and the next call reconnecting."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from unittest import mock

import pytest
import redis.exceptions as rx

from pagefleet.common.redis import RedisServer, connect
from pagefleet.common.redis_mux import mux_for


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def _with_mux(url: str, body):
    """``await body(client, mux)`` on a fresh client of ``url`` and its mux, both closed after."""
    async def go():
        r = connect(url)
        mux = mux_for(r)
        try:
            return await body(r, mux)
        finally:
            await mux.aclose()
            await r.aclose()

    return asyncio.run(go())


def test_concurrent_callers_each_get_their_own_replies(redis_url):
    async def body(r, mux):

        async def caller(i: int) -> list:
            got = []
            for j in range(50):
                got.append(await mux.call("INCR", f"mx:{i}"))
                if j % 7 == 0:
                    got.append(await mux.pipeline([("INCRBY", f"mx:{i}", 10), ("GET", f"mx:{i}")]))
            return got

        results = await asyncio.gather(*(caller(i) for i in range(20)))
        for got in results:
            n, expect = 0, []
            for j in range(50):
                n += 1
                expect.append(n)
                if j % 7 == 0:
                    n += 10
                    expect.append([n, str(n).encode()])
            assert got == expect
        assert mux.num_connects == 1
        big = b"z" * 300_000
        assert await mux.pipeline([("SET", "mx:big", big), ("GET", "mx:big")]) == [b"OK", big]

    _with_mux(redis_url, body)


def test_error_replies_are_raised_by_call_and_returned_by_pipeline(redis_url):
    async def body(r, mux):
        await mux.call("SET", "mx:s", "v")
        with pytest.raises(rx.ResponseError, match="WRONGTYPE"):
            await mux.call("HGET", "mx:s", "f")
        with pytest.raises(rx.NoScriptError):
            await mux.call("EVALSHA", "0" * 40, 0)
        replies = await mux.pipeline([("GET", "mx:s"), ("LPUSH", "mx:s", 1), ("GET", "mx:s")])
        assert replies[0] == b"v" and replies[2] == b"v"
        assert isinstance(replies[1], rx.ResponseError) and "WRONGTYPE" in str(replies[1])
        assert await mux.call("PING") == b"PONG"  # still in step

    _with_mux(redis_url, body)


def test_a_cancelled_caller_leaves_the_others_replies_in_place(redis_url):
    async def body(r, mux):
        await mux.call("DEL", "mx:list")
        # BLPOP with a timeout holds the connection's replies behind it: cancel its caller.
        blocked = asyncio.create_task(mux.call("BLPOP", "mx:list", 0.3))
        await asyncio.sleep(0.05)
        after = asyncio.create_task(mux.call("ECHO", "after"))
        await asyncio.sleep(0.05)
        blocked.cancel()
        assert await after == b"after"  # its own reply, not BLPOP's nil
        assert await mux.call("ECHO", "again") == b"again"

    _with_mux(redis_url, body)


def test_a_broken_connection_fails_its_calls_and_the_next_call_reconnects(redis_url):
    async def body(r, mux):
        client_id = await mux.call("CLIENT", "ID")
        waiting = asyncio.create_task(mux.call("BLPOP", "mx:never", 5))
        await asyncio.sleep(0.05)
        await r.execute_command("CLIENT", "KILL", "ID", client_id)
        with pytest.raises(rx.ConnectionError):
            await waiting
        assert await mux.call("PING") == b"PONG"
        assert mux.num_connects == 2

    _with_mux(redis_url, body)


def test_a_mux_authenticates_as_its_client_does():
    async def ping(r, mux):
        return await mux.call("PING")

    with RedisServer(password="s3cret") as server:
        with pytest.raises(rx.AuthenticationError):
            _with_mux(server.url, ping)
        assert _with_mux(server.url.replace("redis://", "redis://:s3cret@"), ping) == b"PONG"


def test_a_mux_gives_up_on_a_server_that_stops_answering():
    """A server that stops answering (SIGSTOP) fails the waiting calls within the timeout, as
    a connection error; once it answers again, a new connection serves the next call."""
    async def body(r, mux):
        mux.timeout_s = 0.3
        assert await mux.call("PING") == b"PONG"
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(rx.ConnectionError, match="no reply"):
                await mux.call("ECHO", "while-stopped")
            assert time.monotonic() - started < 5
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await mux.call("ECHO", "after") == b"after"
        assert mux.num_connects == 2

    with RedisServer() as server:
        _with_mux(server.url, body)


def test_only_a_standalone_client_has_a_mux():
    assert mux_for(object()) is None


def test_stream_reads_come_back_as_the_clients_do(redis_url):
    """``stream_entries``: the entries of an XREADGROUP read through a mux are what redis-py's
    client gives (fields as a dict), and an entry deleted after delivery reads as ``{}``."""
    from pagefleet.common.redis_mux import stream_entries

    async def body(r, mux):
        await r.xgroup_create("mx:req", "g", id="0", mkstream=True)
        a = await r.xadd("mx:req", {"kind": "generate", "rid": "a"})
        b = await r.xadd("mx:req", {"kind": "cancel", "rid": "b"})
        got = stream_entries(await mux.call("XREADGROUP", "GROUP", "g", "c", "COUNT", 10, "STREAMS", "mx:req", ">"))
        assert got == [("mx:req", [(a, {b"kind": b"generate", b"rid": b"a"}), (b, {b"kind": b"cancel", b"rid": b"b"})])]
        assert got[0][1] == (await r.xreadgroup("g", "c", {"mx:req": "0"}))[0][1]
        await r.xdel("mx:req", a)
        pending = stream_entries(await mux.call("XREADGROUP", "GROUP", "g", "c", "STREAMS", "mx:req", "0"))
        assert pending == [("mx:req", [(a, {}), (b, {b"kind": b"cancel", b"rid": b"b"})])]
        assert stream_entries(await mux.call("XREAD", "BLOCK", 10, "STREAMS", "mx:req", "$")) == []

    _with_mux(redis_url, body)


def test_a_command_that_cannot_be_sent_fails_alone(redis_url):
    """A call whose arguments do not pack (or with no command at all) fails its caller alone:
    no reply is owed for it, so every later caller still gets its own."""
    async def body(r, mux):
        with pytest.raises(TypeError):
            await mux.pipeline([("ECHO", "sent"), ("SET", "mx:k", None)])
        with pytest.raises(ValueError):
            await mux.call()
        for i in range(3):
            got = await asyncio.wait_for(asyncio.gather(*(mux.call("ECHO", f"c{i}-{j}") for j in range(3))), 5)
            assert got == [f"c{i}-{j}".encode() for j in range(3)]

    _with_mux(redis_url, body)


def test_a_closed_mux_leaves_no_connection_open_and_opens_one_when_called_again(redis_url):
    async def body(r, mux):
        assert await mux.call("PING") == b"PONG"
        conn = mux._link.conn
        await mux.aclose()
        assert conn._writer is None and mux._link is None
        assert await mux.call("ECHO", "again") == b"again" and mux.num_connects == 2
        # A connect under way when the mux is closed does not outlive the close.
        await mux.aclose()
        connecting = asyncio.create_task(mux.call("ECHO", "late"))
        await asyncio.sleep(0)
        assert mux._connecting.locked()  # opening its connection
        await mux.aclose()
        with pytest.raises(rx.ConnectionError, match="closed"):
            await connecting
        assert mux._link is None and mux.num_connects == 2

    _with_mux(redis_url, body)


def test_a_unix_socket_url_serves_the_client_its_mux_and_its_lane(tmp_path):
    """``connect("unix:///...")``: the client, its mux and a writer's blocking lane all reach a
    Redis that listens on a unix socket (TCP's keepalive option is not passed to it)."""
    from pagefleet.common.redis_lane import blocking_lane_for

    path = str(tmp_path / "redis.sock")
    with RedisServer(extra_args=["--unixsocket", path, "--unixsocketperm", "700"]):
        async def body(r, mux):
            assert await r.ping() is True
            assert await mux.call("ECHO", "mux") == b"mux"
            lane = blocking_lane_for(r)
            assert lane.call([("ECHO", "lane")]) == [b"lane"]
            lane.close()

        _with_mux(f"unix://{path}", body)


def test_a_redis_servers_socket_url_names_its_path_whatever_its_characters():
    """``socket_url`` percent-encodes the path (a temp dir may hold ``#``, ``%`` or ``?``)."""
    import shutil
    import tempfile

    import redis

    parent = tempfile.mkdtemp(prefix="pf#%41?", dir="/tmp")
    try:
        with mock.patch.object(tempfile, "tempdir", parent):
            server = RedisServer(unix_socket=True)
        with server:
            assert server.socket_path.startswith(parent)
            redis.Redis.from_url(server.socket_url).set("k", "v")
            assert redis.Redis.from_url(server.url).get("k") == b"v"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_redis_server_whose_directory_cannot_hold_its_socket_starts_on_tcp_alone():
    """Redis exits when it cannot make its unix socket: it is started again without one."""
    import os

    import redis

    server = RedisServer(unix_socket=True)
    os.mkdir(server.socket_path)  # a directory where the socket would go: the bind fails
    with server:
        assert server.socket_url is None
        assert redis.Redis.from_url(server.url).ping() is True
    assert not RedisServer().socket_url  # and without asking for one, none
