"""Scheduling policy: the order of the waiting queue and the choice of preemption victims.

Kept apart from the mechanism (blocks, tensors) so it can be read and tested alone.
Priorities: a larger ``priority`` is more important; ties go to the earlier arrival.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from .request import Request


def queue_key(req: Request) -> tuple[int, int]:
    """Waiting order: higher priority first, then first come first served."""
    return (-req.priority, req.arrival_seq)


def victim_key(req: Request) -> tuple[int, int]:
    """Preemption order (smallest first): lowest priority, then the most recently admitted."""
    return (req.priority, -req.admit_seq)


def pick_victim(candidates: Iterable[Request]) -> Request | None:
    return min(candidates, key=victim_key, default=None)


class WaitingQueue:
    """Requests waiting for blocks, ordered by ``queue_key``.

    A preempted request keeps its arrival number, so it goes back ahead of everything
    that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (queue_key(req), req))

    def peek(self) -> Request | None:
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> bool:
        for i, (_, r) in enumerate(self._heap):
            if r is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap, key=lambda e: e[0]))
