"""A writer's own blocking Redis connection (``redis_lane.BlockingLane``) against a real
redis-server: replies in order, error replies returned, AUTH as the client is configured, a
broken connection raised as a connection error and reopened by the next call, and the finish
script reloaded where Redis lost it."""

from __future__ import annotations

import asyncio

import hiredis
import pytest
import redis.exceptions as rx

from pagefleet.common.fencing import Fencing, Write
from pagefleet.common.redis import GROUP, Keys, OutEntry, RedisServer, connect
from pagefleet.common.redis_lane import blocking_lane_for


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


# -- the blocking lane (a worker's output writer thread) -------------------------------------
def _blocking(url: str):
    async def make():
        r = connect(url)
        lane = blocking_lane_for(r)
        await r.aclose()
        return lane

    return asyncio.run(make())


def test_a_blocking_lane_answers_in_order_with_errors_as_values(redis_url):
    lane = _blocking(redis_url)
    replies = lane.call([("SET", "bk", 5), ("INCR", "bk"), ("HGET", "bk", "f"), ("GET", "bk")])
    assert replies[:2] == [b"OK", 6] and replies[3] == b"6"
    assert isinstance(replies[2], hiredis.ReplyError) and "WRONGTYPE" in str(replies[2])
    big = b"y" * 300_000
    assert lane.call([("SET", "bbig", big), ("GET", "bbig")]) == [b"OK", big]
    lane.close()


def test_a_blocking_lane_reconnects_after_a_broken_connection(redis_url):
    import socket

    import redis

    lane = _blocking(redis_url)
    assert lane.call([("PING",)]) == [b"PONG"]
    lane._sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(rx.ConnectionError):
        lane.call([("PING",)])
    client_id = lane.call([("CLIENT", "ID")])[0]
    redis.Redis.from_url(redis_url).execute_command("CLIENT", "KILL", "ID", client_id)  # Redis closes it
    with pytest.raises(rx.ConnectionError):
        lane.call([("PING",)])
    assert lane.call([("PING",)]) == [b"PONG"]
    lane.close()


def test_a_blocking_lane_authenticates_as_its_client_does():
    with RedisServer(password="s3cret") as server:
        with pytest.raises(rx.ConnectionError):
            _blocking(server.url).call([("PING",)])
        lane = _blocking(server.url.replace("redis://", "redis://:s3cret@"))
        assert lane.call([("PING",)]) == [b"PONG"]
        lane.close()


def test_a_blocking_finish_loads_the_script_where_redis_lost_it(redis_url):
    from pagefleet.common.fencing import encode

    lane = _blocking(redis_url)

    async def go():
        r = connect(redis_url)
        keys = Keys("blane-noscript")
        await r.set(keys.scheduler_epoch, 7)
        await r.xgroup_create(keys.requests, GROUP, id="0", mkstream=True)
        f = Fencing(r, keys, "w1")
        epoch = await f.assign("a", 7, "w1")
        await r.script_flush()
        step = encode([Write("a", epoch, OutEntry(0, [1], "x")), Write("a", epoch, OutEntry(1, [], "", "stop"))])
        assert f.write_step_blocking(step, lane) == [True]
        assert await r.hget(keys.owner("a"), "done") == b"1"
        again = encode([Write("a", epoch, OutEntry(1, [], "", "stop"))])
        assert f.write_step_blocking(again, lane) == [False]  # done: refused
        await r.aclose()

    asyncio.run(go())
    lane.close()


def test_only_a_standalone_client_has_a_blocking_lane():
    assert blocking_lane_for(object()) is None


def test_a_blocking_lane_gives_up_on_a_server_that_stops_answering():
    """A server that stops answering (SIGSTOP) fails the call within the lane's timeout, as a
    connection error, and the lane answers again once the server does."""
    import os
    import signal
    import time

    with RedisServer() as server:
        lane = _blocking(server.url)
        assert lane.call([("PING",)]) == [b"PONG"]  # connected with the default timeout
        lane.timeout_s = 0.3  # the open socket's timeout
        lane._sock.settimeout(lane.timeout_s)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(rx.ConnectionError):
                lane.call([("ECHO", "while-stopped")])
            assert time.monotonic() - started < 5
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        lane.timeout_s = 30.0
        assert lane.call([("ECHO", "after")]) == [b"after"]  # a new connection: no stale reply read
        lane.close()
