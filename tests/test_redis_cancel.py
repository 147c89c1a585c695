"""A cancel of a task blocked in a Redis call always ends it, in a real Redis.

redis-py sends each command through ``asyncio.wait_for``; on Python 3.11 a cancel that lands
as the send completes was dropped, and the task went on reading. A relay whose client had
gone kept reading to the request's end, so the request was never cancelled (found as a flaky
HTTP disconnect test under CPU load). ``retry`` runs every command so that the cancel holds.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from pagefleet.common.redis import RedisServer, connect, retry


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def test_a_cancelled_reader_always_stops(redis_url):
    async def go() -> list[int]:
        reader_redis, writer_redis = connect(redis_url), connect(redis_url)
        stop = asyncio.Event()

        async def write() -> None:  # a stream that always has news, so reads return at once
            i = 0
            while not stop.is_set():
                await writer_redis.xadd("busy", {"i": i}, maxlen=1000, approximate=True)
                i += 1
                await asyncio.sleep(0.001)

        async def read() -> None:
            last = "$"
            while True:
                resp = await retry(lambda s=last: reader_redis.xread({"busy": s}, count=256, block=5000),
                                   what="xread")
                for _, entries in resp or ():
                    last = entries[-1][0]

        writer = asyncio.ensure_future(write())
        kept_running = []
        rng = random.Random(0)
        try:
            for trial in range(150):
                reader = asyncio.ensure_future(read())
                await asyncio.sleep(rng.uniform(0.002, 0.02))
                reader.cancel()
                done, _ = await asyncio.wait({reader}, timeout=2.0)
                if not done:
                    kept_running.append(trial)
                    reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        finally:
            stop.set()
            await writer
            await reader_redis.aclose()
            await writer_redis.aclose()
        return kept_running

    assert asyncio.run(go()) == [], "these trials' readers went on reading after their cancel"


def test_idle_connections_past_the_bound_are_closed(redis_url):
    """A burst of concurrent commands opens a connection each, and redis-py kept them all: a
    gateway held hundreds (of Redis's maxclients) long after the streams that made them went.
    ``trim_idle_connections`` closes the idle ones past its bound, least recently used first."""
    from pagefleet.common.redis import trim_idle_connections

    async def go() -> tuple[int, int, int]:
        redis = connect(redis_url)
        watcher = connect(redis_url)
        await asyncio.gather(*(redis.blpop([f"nothing-{i}"], timeout=0.2) for i in range(120)))
        burst = len(await watcher.client_list())
        trim = asyncio.create_task(trim_idle_connections(redis, keep=8, every_s=0.05))
        await asyncio.sleep(0.5)
        after = len(await watcher.client_list())
        assert await redis.ping()  # the client still works, on a kept or a new connection
        trim.cancel()
        idle = len(redis.connection_pool._available_connections)
        await redis.aclose()
        await watcher.aclose()
        return burst, after, idle

    burst, after, idle = asyncio.run(go())
    assert burst > 100 and after <= 8 + 1 + 1, (burst, after)  # the kept ones, the watcher's
    assert idle <= 8
