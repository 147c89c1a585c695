"""The global queue: requests the scheduler holds and has not placed, in placing order.

* ``fcfs``: arrival order.
* ``priority``: larger priority first; a request gains one level per ``aging_s`` seconds
  waited, so a low-priority request cannot starve.
* ``deadline``: earliest absolute deadline first (requests without one after all that
  have one, in arrival order). Expired requests are taken out by ``pop_expired``; the
  scheduler finishes them with an error.

A re-queued request (its worker died, or drained and handed it back) keeps its arrival
sequence, so it goes back near the front.

Cost: a binary heap ordered by the policy's key, so ``push`` and ``pop`` are O(log n) and
``peek`` is O(1) amortized; ``remove`` is O(1): the entry stays in the heap marked dead and
is dropped when it reaches the top (lazy deletion). A second heap, by deadline, lets
``pop_expired`` look only at the expired entries. When dead entries outnumber the live
ones, the heaps are rebuilt without them (O(n), amortized O(1)), so memory stays within
twice the live entries. ``ordered`` sorts a copy: O(n log n), for the read-only view.

Contract: a queued ``Pending``'s priority, deadline and ``enqueued_at`` must not change
while it is queued (its key is computed once, at ``push``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from pagefleet.common.sampling_params import DEFAULT_MAX_TOKENS
from pagefleet.protos import cluster_pb2

POLICIES = ("fcfs", "priority", "deadline")
_MIN_DEAD_BEFORE_REBUILD = 64


@dataclass(slots=True)
class Pending:
    """A request the scheduler knows: waiting here, or placed on a worker."""

    request_id: str
    entry_id: str
    assign: cluster_pb2.AssignRequest  # what a worker is sent (output_token_ids: resume point)
    seq: int  # arrival order at the scheduler
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def priority(self) -> int:
        return self.assign.priority

    @property
    def deadline_unix_ms(self) -> int:
        return self.assign.deadline_unix_ms

    @property
    def num_tokens(self) -> int:
        return len(self.assign.prompt_token_ids) + len(self.assign.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens it may still generate."""
        sampling = self.assign.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        return max(0, max_tokens - len(self.assign.output_token_ids))


@dataclass(slots=True, eq=False)
class _Entry:
    """One push of a request; in both heaps until it comes out of them."""

    key: tuple  # the policy's key, then the push order: unique, so no two entries tie
    pending: Pending | None  # None once removed, popped or expired (dead)

    def __lt__(self, other: _Entry) -> bool:
        return self.key < other.key


class GlobalQueue:
    """The requests waiting for a worker, in the order ``policy`` places them."""

    def __init__(self, policy: str = "fcfs", aging_s: float = 10.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if aging_s <= 0:
            raise ValueError(f"aging_s must be > 0, got {aging_s}")
        self.policy = policy
        self.aging_s = aging_s
        self._live: dict[str, _Entry] = {}  # request_id -> its one live entry
        self._heap: list[_Entry] = []  # by key; may hold dead entries
        self._by_deadline: list[tuple[int, int, _Entry]] = []  # (deadline_unix_ms, push order, entry)
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def key(self, p: Pending) -> tuple:
        """Smaller goes first.

        Priority with aging ranks by ``priority + (now - enqueued_at) / aging_s``, which
        grows with ``now``, but by the same amount for every entry: the order of two
        entries is the order of ``priority - enqueued_at / aging_s``, whatever ``now`` is.
        So the key is static and a heap keeps the order.
        """
        if self.policy == "priority":
            return (-(p.priority - p.enqueued_at / self.aging_s), p.seq)
        if self.policy == "deadline":
            return (p.deadline_unix_ms or math.inf, p.seq)
        return (p.seq,)

    def push(self, p: Pending) -> None:
        """Queue ``p``; if its request is queued already, ``p`` replaces it in its place."""
        old = self._live.get(p.request_id)
        order = old.key[-1] if old is not None else next(self._pushes)
        if old is not None:
            self._kill(old)
        e = _Entry((*self.key(p), order), p)
        self._live[p.request_id] = e
        heapq.heappush(self._heap, e)
        if p.deadline_unix_ms:
            heapq.heappush(self._by_deadline, (p.deadline_unix_ms, order, e))

    def get(self, request_id: str) -> Pending | None:
        """The queued request ``request_id``; None if it is not queued."""
        e = self._live.get(request_id)
        return e.pending if e is not None else None

    def remove(self, request_id: str) -> Pending | None:
        """Take ``request_id`` out; None if it is not queued."""
        e = self._live.get(request_id)
        if e is None:
            return None
        p = e.pending
        self._kill(e)
        return p

    def peek(self) -> Pending | None:
        """The request placed next; None if the queue is empty."""
        heap = self._heap
        while heap and heap[0].pending is None:
            heapq.heappop(heap)
        return heap[0].pending if heap else None

    def pop(self) -> Pending | None:
        """Take out the request placed next; None if the queue is empty."""
        p = self.peek()
        if p is not None:
            self._kill(heapq.heappop(self._heap))
        return p

    def ordered(self) -> list[Pending]:
        """Every queued request, in placing order."""
        return [e.pending for e in sorted(self._live.values())]

    def pop_expired(self, now_unix_ms: int) -> list[Pending]:
        """Take out every request whose deadline is at or before ``now_unix_ms``, in push order."""
        expired: list[_Entry] = []
        while self._by_deadline and self._by_deadline[0][0] <= now_unix_ms:
            _, _, e = heapq.heappop(self._by_deadline)
            if e.pending is not None:
                expired.append(e)
        expired.sort(key=lambda e: e.key[-1])
        gone = [e.pending for e in expired]
        for e in expired:
            self._kill(e)
        return gone

    def _kill(self, e: _Entry) -> None:
        """Mark ``e`` dead (it leaves the heaps when it reaches their top, or at a rebuild)."""
        del self._live[e.pending.request_id]
        e.pending = None
        limit = 2 * len(self._live) + _MIN_DEAD_BEFORE_REBUILD
        if len(self._heap) > limit:
            self._heap = [x for x in self._heap if x.pending is not None]
            heapq.heapify(self._heap)
        if len(self._by_deadline) > limit:
            self._by_deadline = [x for x in self._by_deadline if x[2].pending is not None]
            heapq.heapify(self._by_deadline)
