"""What a step is (``SchedulerOutput``) and what the engine asks of a scheduler (``BatchScheduler``).

Two schedulers implement it: ``ContinuousScheduler`` (iteration-level batching, chunked
prefill, preemption) and ``StaticScheduler`` (the padded baseline it is measured against).
The engine only ever talks to this interface.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request import Request

if TYPE_CHECKING:
    from .swap import SwapAllocator


@dataclass(slots=True)
class SchedulerOutput:
    """One step. ``requests[i]`` computes ``num_scheduled_tokens[i]`` of its missing tokens.

    ``num_padding_tokens[i]`` (static batching only) extra rows follow them: computed,
    never written to the cache, their outputs dropped.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_padding_tokens: list[int] | None = None
    # Block copies to run before the model, in this order: (device block, swap block)
    # pairs out, then (swap block, device block) pairs in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests or self.blocks_to_swap_out or self.blocks_to_swap_in)


class BatchScheduler(abc.ABC):
    """Decides, step by step, which requests compute which tokens.

    Counters ending in ``_total`` are cumulative since the scheduler was made. ``swap`` is
    the swap pool's allocator, ``None`` when the scheduler never swaps. ``running`` are the
    requests on the device; ``waiting`` the queue of requests not admitted yet.
    """

    swap: SwapAllocator | None = None
    running: Sequence[Request]
    waiting: Sized

    def __init__(self) -> None:
        self.num_steps_total = 0
        self.num_preemptions_total = 0  # every preemption, by the scheduler or directed
        self.num_recomputes_total = 0  # preemptions that dropped the K/V
        self.num_swapped_out_blocks_total = 0
        self.num_swapped_in_blocks_total = 0

    @abc.abstractmethod
    def add(self, req: Request) -> None:
        """Queue a new request."""

    @abc.abstractmethod
    def remove(self, req: Request) -> None:
        """Take ``req`` out of every queue and free its blocks (it finished or was aborted)."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """The next step; an empty output when nothing can run."""

    @abc.abstractmethod
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request past the tokens ``out`` computed."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        """Sequences whose K/V is in the swap pool."""
        return 0

    def preempt(self, req: Request, mode: str | None = None) -> bool:
        """Directed preemption: take ``req`` off the device now. False if it is not on the
        device or this scheduler does not preempt."""
        return False
