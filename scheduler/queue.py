"""The global waiting queue and its policies.

* ``fcfs``: arrival order.
* ``priority``: larger priority first; a request gains one level per ``aging_s`` seconds
  waited, so a low-priority request cannot starve.
* ``deadline``: earliest absolute deadline first (requests without one after all that
  have one, in arrival order). Expired requests are taken out by ``pop_expired``; the
  scheduler finishes them with an error.

A re-queued request (its worker died, or it was handed back) keeps its arrival
sequence, so it goes back near the front. The queue is a plain list scanned per pick:
thousands of waiting requests cost microseconds, and every policy stays one key function.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pagefleet.protos import cluster_pb2

POLICIES = ("fcfs", "priority", "deadline")


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
        max_tokens = self.assign.sampling.max_tokens if self.assign.sampling.HasField("max_tokens") else 16
        return max(0, max_tokens - len(self.assign.output_token_ids))


class WaitingQueue:
    def __init__(self, policy: str = "fcfs", aging_s: float = 10.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if aging_s <= 0:
            raise ValueError(f"aging_s must be > 0, got {aging_s}")
        self.policy = policy
        self.aging_s = aging_s
        self._items: dict[str, Pending] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def push(self, p: Pending) -> None:
        self._items[p.request_id] = p

    def remove(self, request_id: str) -> Pending | None:
        return self._items.pop(request_id, None)

    def key(self, p: Pending, now: float) -> tuple:
        """Smaller goes first."""
        if self.policy == "priority":
            return (-(p.priority + (now - p.enqueued_at) / self.aging_s), p.seq)
        if self.policy == "deadline":
            return (p.deadline_unix_ms or math.inf, p.seq)
        return (p.seq,)

    def peek(self) -> Pending | None:
        if not self._items:
            return None
        now = time.monotonic()
        return min(self._items.values(), key=lambda p: self.key(p, now))

    def ordered(self) -> list[Pending]:
        now = time.monotonic()
        return sorted(self._items.values(), key=lambda p: self.key(p, now))

    def pop_expired(self, now_unix_ms: int) -> list[Pending]:
        """Take out every request whose deadline has passed."""
        gone = [p for p in self._items.values() if p.deadline_unix_ms and p.deadline_unix_ms <= now_unix_ms]
        for p in gone:
            del self._items[p.request_id]
        return gone
