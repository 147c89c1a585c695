"""One request's state inside the engine.

There is no separate "prefill phase": every request has ``num_computed_tokens``
catching up with ``num_tokens`` (prompt plus output so far). A step schedules some
of the missing tokens; when it reaches the end, the step samples a new token.
"""

from __future__ import annotations

import enum

from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3  # K/V in the swap pool only
    SWAPPING_IN = 4  # K/V being copied back: blocks in both pools until the next step
    # Everything from here on is finished: `status >= FINISHED_STOPPED`.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13  # it cannot go on (its structured output does not compile for this model)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_NONE: frozenset[int] = frozenset()


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "params",
        "status",
        "priority",
        "arrival_seq",
        "admit_seq",
        "detokenizer",
        "num_emitted_tokens",
        "num_preemptions",
        "resumed_at_step",
        "eos_token_ids",
        "stop_token_ids",
        "finish_token_ids",
        "max_tokens",
        "processes_logits",
        "penalty_state",
        "output_logprobs",
        "block_hashes",
        "grammar",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_seq: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenizer: IncrementalDetokenizer | None = None,
        output_token_ids: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids = prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        self.params = params
        self.status = RequestStatus.WAITING
        self.priority = priority  # larger is more important
        self.arrival_seq = arrival_seq
        self.admit_seq = -1
        self.detokenizer = detokenizer
        # Tokens already handed out (resumed requests start past their earlier output).
        self.num_emitted_tokens = len(self.output_token_ids)
        self.num_preemptions = 0
        self.resumed_at_step = -1
        self.eos_token_ids = _NONE if params.ignore_eos else frozenset(eos_token_ids)  # a frozenset: itself
        self.stop_token_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NONE
        # Checked for every token: the union, and the budget, as plain attributes. Without stop
        # tokens it is the engine's own set, shared by its requests (one object, not one each).
        self.finish_token_ids = (self.eos_token_ids | self.stop_token_ids if self.stop_token_ids
                                 else self.eos_token_ids)
        self.max_tokens = params.max_tokens
        # Keys of its full blocks (prefix caching), extended as blocks fill: see kv_cache_manager.
        self.block_hashes: list[bytes] = []
        # The sampler's slower path (penalties, min_tokens, logprobs), and its state (see penalties.py).
        self.processes_logits = params.processes_logits
        self.penalty_state = None
        # Log-probabilities of the tokens generated here (the last len(output_logprobs) outputs).
        self.output_logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        # With structured output: its matcher (structured.RequestGrammar), set by the engine.
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self, token_id: int) -> RequestStatus | None:
        """The finished status the new token puts the request in, if any (strings are checked later)."""
        if token_id in self.finish_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens})"
        )
