"""A worker's threads carry their names where the OS shows them (``/proc/<pid>/task/<tid>/comm``,
``top -H``, ``perf``, ``bench token-path``'s CPU by thread): Python's thread names are its own."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time

import pytest

from pagefleet.common.redis import Keys, connect
from pagefleet.common.service import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def _os_name(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/comm") as f:
        return f.read().strip()


def _os_names() -> set[str]:
    return {_os_name(t.native_id) for t in threading.enumerate() if t.native_id is not None}


def test_a_thread_names_itself_for_the_os_in_at_most_15_bytes():
    seen = []

    def run(name):
        name_os_thread(name)
        seen.append(_os_name(threading.get_native_id()))

    for name in ("engine", "a-name-longer-than-fifteen"):
        t = threading.Thread(target=run, args=(name,))
        t.start()
        t.join()
    assert seen == ["engine", "a-name-longer-t"]


def test_the_engine_loop_and_the_output_writer_threads_are_named():
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.redis_io import OutputWriter
    from pagefleet.worker.sim import SimEngine

    loop = EngineLoop(SimEngine(time_scale=math.inf), emit=lambda step: None, notify=lambda: None)
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while _os_name(loop._thread.native_id) != "engine" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _os_name(loop._thread.native_id) == "engine"
    finally:
        loop.stop()

    async def writer_names() -> set[str]:
        redis = connect("redis://127.0.0.1:9/0")  # never written to here: the thread only starts
        writer = OutputWriter(redis, Keys("names"), writer_id="w")
        task = asyncio.create_task(writer.run())
        try:
            for _ in range(500):
                await asyncio.sleep(0.01)
                if "output-writer" in _os_names():
                    break
            return _os_names()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await redis.aclose()

    assert "output-writer" in asyncio.run(writer_names())
