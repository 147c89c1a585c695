"""The prefix cache's keys as each occupancy stream learns them.

After every step the engine thread ``publish``es the keys the pool stored and evicted
(in order). Each stream (``subscribe``) keeps the *net* change since its previous report,
a key's last event winning, so ``take`` returns two disjoint lists, keys cached now and
keys no longer cached (possibly some it never reported: stored and evicted in between),
that a reader may apply in any order. A new stream starts with a
reset that carries every key cached; a stream whose changes outgrow its bound (a reader
that stopped reading) is reset the same way, so memory stays bounded.

The log mirrors the cached keys (from the events), so a stream can start on any thread
without touching the engine. One lock guards the mirror and every stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

# Net key changes one stream may hold before it is reset instead (at least twice the pool).
MAX_UNREPORTED_BLOCK_HASHES = 100_000


class KVEventStream:
    """One occupancy stream's pending key changes. ``take`` from any thread."""

    def __init__(self, lock: threading.Lock, keys: Iterable[bytes], limit: int) -> None:
        self._lock = lock
        self._limit = limit
        self._changes: dict[bytes, bool] = {}  # key -> cached now (True) or evicted (False)
        self._reset = True
        self._reset_to(keys)

    def take(self) -> tuple[list[bytes], list[bytes], bool]:
        """``(stored, evicted, reset)`` since the previous ``take``. ``reset``: forget every
        key known of this worker; ``stored`` is all it caches (``evicted`` is then empty)."""
        with self._lock:
            changes, reset = self._changes, self._reset
            self._changes, self._reset = {}, False
        stored = [k for k, cached in changes.items() if cached]
        evicted = [k for k, cached in changes.items() if not cached]
        return stored, evicted, reset

    # -- under the log's lock --------------------------------------------------------------
    def _push(self, events: list[tuple[bytes, bool]], mirror: dict[bytes, None]) -> None:
        changes = self._changes
        if self._reset:  # a reset lists what is cached, nothing else
            for key, stored in events:
                if stored:
                    changes[key] = True
                else:
                    changes.pop(key, None)
        else:
            for key, stored in events:
                changes[key] = stored
        if len(changes) > self._limit:
            self._reset_to(mirror)

    def _reset_to(self, keys: Iterable[bytes]) -> None:
        self._changes = dict.fromkeys(keys, True)
        self._reset = True


class KVEventLog:
    """The fan-out of the pool's key events to every stream (see the module docstring)."""

    def __init__(self, kv) -> None:
        """``kv``: the engine's ``KVCacheManager``; events it recorded before now are dropped."""
        kv.take_events()
        self._lock = threading.Lock()
        self._keys: dict[bytes, None] = dict.fromkeys(kv.cached_keys())
        self._streams: tuple[KVEventStream, ...] = ()
        self._limit = max(MAX_UNREPORTED_BLOCK_HASHES, 2 * kv.num_blocks)

    def publish(self, kv) -> None:
        """Hand ``kv``'s events since the last call to every stream (on the engine thread)."""
        events, lost = kv.take_events()
        if not events and not lost:
            return
        with self._lock:
            mirror = self._keys
            if lost:  # some events were dropped: start again from what is cached
                mirror = self._keys = dict.fromkeys(kv.cached_keys())
                for s in self._streams:
                    s._reset_to(mirror)
                return
            for key, stored in events:
                if stored:
                    mirror[key] = None
                else:
                    mirror.pop(key, None)
            for s in self._streams:
                s._push(events, mirror)

    def subscribe(self) -> KVEventStream:
        """A stream whose first ``take`` is a reset with every key cached now."""
        with self._lock:
            stream = KVEventStream(self._lock, self._keys, self._limit)
            self._streams = (*self._streams, stream)
        return stream

    def unsubscribe(self, stream: KVEventStream) -> None:
        with self._lock:
            self._streams = tuple(s for s in self._streams if s is not stream)
