"""What the engine hands back: whole outputs and per-step deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """A finished (or aborted) request, as returned by ``Engine.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"


@dataclass(slots=True)
class TokenDelta:
    """The new tokens one step produced for one request (the streaming API).

    ``index`` is the position in the request's output of ``token_ids[0]``, so a
    consumer can place every delta exactly once. ``finish_reason`` is set on the
    request's last delta only.
    """

    request_id: str
    token_ids: list[int]
    text: str
    index: int
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's pool and queues."""

    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    blocks_per_request: dict[str, int] = field(default_factory=dict)
    num_swap_blocks: int = 0
    num_free_swap_blocks: int = 0
    num_swapped: int = 0  # sequences whose K/V is in the swap pool
    num_swapped_out_blocks: int = 0  # cumulative
    num_swapped_in_blocks: int = 0  # cumulative
    num_recomputes: int = 0  # preemptions that dropped the K/V (cumulative)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(slots=True)
class Occupancy:
    """The worker's report of its pools and queues at one moment (``Engine.occupancy``).

    ``num_swapped_blocks`` are swap-pool blocks in use; ``blocks_per_request`` counts
    the blocks each live request holds in both pools.
    """

    num_blocks: int
    num_free_blocks: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    num_swapped_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_per_request: dict[str, int] = field(default_factory=dict)
