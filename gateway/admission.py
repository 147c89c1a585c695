"""The admission script of every request queued in one turn of the event loop, in one round trip.

A gateway under load takes up many calls per turn of its event loop, and each queues its
request with one ``ADMIT_AND_QUEUE`` (common/scripts.py). Sent one by one, each costs a
Redis client round of its own (a connection from the pool, a send, a parse: ~100 µs of the
gateway's CPU with redis-py); ``Admissions`` sends every call made in the same turn as one
non-transactional pipeline, so that cost is shared, on a connection of its own shared by every
round (``RedisMux``: a round is one write and one future, and a round goes out while earlier
ones wait for their replies; a cluster client's rounds go through the client). Nothing waits
for company: the batch goes at the end of the turn in which its first call came, alone if it
is alone.

Each script stays one atomic step on its own keys (one slot), in the order the calls came;
a pipeline is not a transaction and needs none. A call's answer is its script's, or the error
its own script met: a script Redis did not have (``NOSCRIPT``, nothing of it ran) is loaded and
only those calls run again; a lost connection fails every call of the batch, and each
caller's ``retry`` sends it again (the script answers 0 to a request it queued already when
the id is claimed, as for a lost reply before).
"""

from __future__ import annotations

import asyncio

from pagefleet.common.redis import queue_script
from pagefleet.common.redis_mux import mux_for


class Admissions:
    """``await admissions(keys, args)``: ``script(keys=keys, args=args)``'s answer, sent with
    the other calls of the same event-loop turn in one pipeline."""

    def __init__(self, redis, script) -> None:
        """``script``: from ``redis.register_script``. A standalone client's rounds go on a
        connection shared by every round (``RedisMux``: a round is a write and a future,
        not a client's call), a cluster client's through the client."""
        self.redis = redis
        self.script = script
        self.mux = mux_for(redis)
        self._batch: list[tuple[list, list, asyncio.Future]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_rounds = 0  # round trips sent (a script Redis lost adds one)

    def __call__(self, keys: list, args: list) -> asyncio.Future:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        fut = self._loop.create_future()
        if not self._batch:
            self._loop.call_soon(self._send)
        self._batch.append((keys, args, fut))
        return fut

    def _send(self) -> None:
        batch, self._batch = self._batch, []
        self._loop.create_task(self._run(batch))

    async def _run(self, batch: list[tuple[list, list, asyncio.Future]]) -> None:
        import redis.exceptions as rx

        try:
            if self.mux is None and len(batch) == 1:  # alone: the client's plain call is cheaper than a pipeline of one
                keys, args, fut = batch[0]
                self.num_rounds += 1
                _answer(fut, await self.script(keys=keys, args=args))
                return
            todo = batch
            for attempt in range(2):
                self.num_rounds += 1
                results = await self._round(todo)
                again = []
                for item, result in zip(todo, results, strict=True):
                    if attempt == 0 and isinstance(result, rx.NoScriptError):
                        again.append(item)
                    else:
                        _answer(item[2], result)
                if not again:
                    return
                if self.mux is not None:
                    await self.mux.call("SCRIPT", "LOAD", self.script.script)
                else:
                    await self.redis.script_load(self.script.script)
                todo = again
        except BaseException as e:
            for _, _, fut in batch:
                _answer(fut, e)
            if not isinstance(e, Exception):
                raise

    async def _round(self, todo: list[tuple[list, list, asyncio.Future]]) -> list:
        """Every call's script answer (errors as values), in one round trip."""
        if self.mux is not None:
            sha = self.script.sha
            return await self.mux.pipeline([("EVALSHA", sha, len(keys), *keys, *args) for keys, args, _ in todo])
        pipe = self.redis.pipeline(transaction=False)
        for keys, args, _ in todo:
            queue_script(pipe, self.script, keys, args)
        return await pipe.execute(raise_on_error=False)

    async def aclose(self) -> None:
        if self.mux is not None:
            await self.mux.aclose()


def _answer(fut: asyncio.Future, result) -> None:
    if fut.done():  # its caller went away
        return
    if isinstance(result, Exception):
        fut.set_exception(result)
    elif isinstance(result, BaseException):
        fut.cancel()
    else:
        fut.set_result(result)
