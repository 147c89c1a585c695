"""Scheduling policy: the order of the waiting queue, the choice of preemption victims,
and how to preempt them (swap or recompute) and when a swapped one comes back.

Kept apart from the mechanism (blocks, tensors) so it can be read and tested alone.
Priorities: a larger ``priority`` is more important; ties go to the earlier arrival.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .request import Request

if TYPE_CHECKING:
    from .cost_model import CostModel


def queue_key(req: Request) -> tuple[int, int]:
    """Waiting order: higher priority first, then first come first served."""
    return (-req.priority, req.arrival_seq)


def victim_key(req: Request) -> tuple[int, int]:
    """Preemption order (smallest first): lowest priority, then the most recently admitted."""
    return (req.priority, -req.admit_seq)


def pick_victim(
    candidates: Iterable[Request], *, step: int = 0, min_resident_steps: int = 0
) -> Request | None:
    """The request to preempt, or ``None`` if every candidate is protected.

    A request that was preempted before and resumed less than ``min_resident_steps``
    steps ago is protected: preempting it again at once would let it starve.
    """
    eligible = (r for r in candidates if not is_protected(r, step, min_resident_steps))
    return min(eligible, key=victim_key, default=None)


def is_protected(req: Request, step: int, min_resident_steps: int) -> bool:
    return req.num_preemptions > 0 and step - req.resumed_at_step < min_resident_steps


@dataclass(frozen=True, slots=True)
class PreemptionPolicy:
    """How to preempt, and when a swapped sequence may come back.

    ``mode``: ``"swap"`` (recompute only when the swap pool is full), ``"recompute"``,
    or ``"auto"`` (per victim, whichever the cost model says is cheaper).
    ``watermark``: the fraction of the device pool kept free when swapping in (vLLM
    found a 2 % reserve halved preemptions). ``min_resident_steps``: a resumed
    sequence is not preempted again within this many steps.
    """

    mode: str = "recompute"
    watermark: float = 0.02
    min_resident_steps: int = 4

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")

    def watermark_blocks(self, num_blocks: int) -> int:
        return math.ceil(self.watermark * num_blocks)

    def choose(self, num_blocks: int, num_tokens: int, *, swap_has_room: bool,
               cost_model: CostModel | None) -> str:
        """``"swap"`` or ``"recompute"`` for a victim holding ``num_blocks`` blocks of ``num_tokens`` tokens."""
        if self.mode == "recompute" or not swap_has_room or num_blocks == 0:
            return "recompute"
        if self.mode == "swap" or cost_model is None:
            return "swap"
        return "swap" if cost_model.prefers_swap(num_blocks, num_tokens) else "recompute"

    def can_swap_in(self, num_free_blocks: int, num_needed: int, num_blocks: int, *,
                    idle: bool) -> bool:
        """Whether a swapped sequence needing ``num_needed`` blocks may come back now.

        Keep a watermark of free blocks so the sequence does not push another one out
        at once; when nothing else runs the watermark is waived (or it would never return).
        """
        if idle:
            return num_needed <= num_free_blocks
        return num_free_blocks - num_needed >= self.watermark_blocks(num_blocks)


PREEMPTION_MODES = ("swap", "recompute", "auto")


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
