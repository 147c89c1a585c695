"""What the engine hands back: whole outputs and per-step deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.common.logprobs import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A finished (or aborted) request, as returned by ``Engine.generate``.

    ``logprobs``: one entry per token of ``token_ids`` if the request asked for them, else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token that ended it (vLLM's)


@dataclass(slots=True)
class TokenDelta:
    """The new tokens one step produced for one request (the streaming API).

    ``index`` is the position in the request's output of ``token_ids[0]``, so a
    consumer can place every delta exactly once. ``finish_reason`` is set on the
    request's last delta only. ``logprobs``: one entry per token of ``token_ids`` if the
    request asked for them, else None.
    """

    request_id: str
    token_ids: list[int]
    text: str
    index: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": why
    # With "stop": the stop string that ended it, or the stop token's id (SamplingParams.stop_token_ids);
    # None for the model's own end of sequence, as vLLM's ``stop_reason``.
    stop: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """A worker's engine at one moment: its pools, its queues, and counters since it started.

    The one shape of a worker's state: ``Engine.stats()`` returns it, the engine loop keeps
    the latest as its snapshot, and the worker converts it to its ``OccupancyReport`` in one
    place (``worker/report.py``). ``blocks_per_request`` counts device blocks (what admission
    and victim choice need); ``swap_blocks_per_request`` the swap pool's. Fields ending in
    ``_total`` are cumulative.
    """

    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_swap_blocks: int = 0
    num_free_swap_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0  # sequences whose K/V is in the swap pool
    blocks_per_request: dict[str, int] = field(default_factory=dict)
    swap_blocks_per_request: dict[str, int] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)  # every request the engine holds
    num_steps_total: int = 0
    num_generated_tokens_total: int = 0
    num_preemptions_total: int = 0  # the engine's own and directed ones
    num_recomputes_total: int = 0  # preemptions that dropped the K/V
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits_total: int = 0  # of those, tokens found cached
    # CPU seconds the stepping thread spent in a simulated model (--engine sim: its cost model
    # and token draw, what the forward pass and sampler are to a real engine); 0 on a real one.
    sim_model_cpu_seconds_total: float = 0.0

    @property
    def num_swapped_blocks(self) -> int:
        """Swap-pool blocks in use now."""
        return self.num_swap_blocks - self.num_free_swap_blocks

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks ``request_id`` holds in both pools."""
        return self.blocks_per_request.get(request_id, 0) + self.swap_blocks_per_request.get(request_id, 0)
