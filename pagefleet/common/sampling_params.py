"""Per-request sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024
# Most tokens to generate when a request does not say (the proto's unset max_tokens too).
DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. A ``seed`` gives the request its own random stream, so its tokens do not
    depend on what else shares the batch.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(self.stop or ())

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: treat it as greedy (as vLLM does).
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field that is out of range."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        t = self.temperature
        if not isinstance(t, int | float) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, int | float) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop must be a list of non-empty strings")
        # Every stop string is searched for at every token: bound the work one request adds.
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}")
        if any(len(s) > MAX_STOP_STRING_LEN for s in self.stop_strings):
            raise ValueError(f"stop: each string at most {MAX_STOP_STRING_LEN} characters")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        for t_id in self.stop_token_ids or ():
            if not isinstance(t_id, int) or t_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t_id!r}")
