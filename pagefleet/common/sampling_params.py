"""Per-request sampling settings."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024
# Most alternatives a request may ask log-probabilities of, per token (OpenAI's limit too).
MAX_LOGPROBS = 20
# Presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (as OpenAI's).
MAX_PENALTY = 2.0
# Most tokens to generate when a request does not say (the proto's unset max_tokens too).
DEFAULT_MAX_TOKENS = 16
# logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 128
# allowed_token_ids: past the largest vocabularies served (Gemma's 262,144; ids may repeat), bounded
# before each is checked (1.5 million held a gateway's loop ~0.5 s).
MAX_ALLOWED_TOKEN_IDS = 262_144
MIN_REPETITION_PENALTY = 1e-6  # and at most its inverse


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on the whole output; exactly one of the fields is set (vLLM's names).

    ``json``: a JSON schema as JSON text; ``regex``; ``choice``: the output is one of these
    strings; ``grammar``: Lark (llguidance's syntax) or GBNF; ``json_object``: any JSON object.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def num_set(self) -> int:
        return sum((self.json is not None, self.regex is not None, bool(self.choice), self.grammar is not None,
                    self.json_object))


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those
    filters. A ``seed`` gives the request its own random stream, so its tokens do not
    depend on what else shares the batch.

    Penalties (vLLM's definitions) change the logits before anything else:
    ``repetition_penalty`` divides the positive (multiplies the negative) logits of every
    token of the prompt or the output, then ``frequency_penalty`` times a token's count in
    the output and ``presence_penalty`` once for a token present in the output are
    subtracted. ``min_tokens``: end-of-sequence and stop token ids cannot be sampled before
    that many output tokens. ``logprobs``: None for none, ``n`` for each token's
    log-probability and its ``n`` most likely alternatives (after penalties and the
    ``min_tokens`` mask, before temperature, top-k and top-p).

    Token masks (vLLM's): ``logit_bias`` adds to the logits of its token ids,
    ``allowed_token_ids`` masks every other id, ``bad_words_token_ids`` masks the last token
    of each sequence wherever the output ends with the ones before it, ``structured_outputs``
    masks every token that would leave the constraint. ``include_stop_str_in_output`` sends
    the stop string that ended the output; ``skip_special_tokens`` leaves special tokens out
    of the text.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputs | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(self.stop or ())
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's off, as 0 is here
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: treat it as greedy (as vLLM does).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Any of presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """True when sampling needs more than temperature, top-k and top-p (the sampler's slower path)."""
        return (self.has_penalties or self.min_tokens > 0 or self.logprobs is not None or self.has_token_masks)

    @property
    def has_token_masks(self) -> bool:
        """Any of logit_bias, allowed_token_ids, bad words or structured output is set."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.structured_outputs is not None)

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
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**32:
            raise ValueError(f"top_k must be an integer in [0, 2^32) (0 or -1 disables it), got {self.top_k!r}")
        m = self.min_p
        if not isinstance(m, int | float) or math.isnan(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {m!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):
            # vLLM's int64 seeds and the proto's uint64: the gateway's range, not wrapped silently
            raise ValueError(f"seed must be an integer in [-2^63, 2^64) or None, got {self.seed!r}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        r = self.repetition_penalty
        # Bounded where float32 logits stay finite once divided or multiplied by it (1e-300 was
        # 0 in float32: every logit inf or NaN).
        if not _is_number(r) or not MIN_REPETITION_PENALTY <= r <= 1 / MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{1 / MIN_REPETITION_PENALTY:g}] (1 is off), got {r!r}")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {m!r}")
        if m > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {m}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        self._validate_masks()

    def _validate_masks(self) -> None:
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for t_id, v in bias.items():
            if not isinstance(t_id, int) or t_id < 0:
                raise ValueError(f"logit_bias: keys must be token ids >= 0, got {t_id!r}")
            if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r}")
        for t_id in self.allowed_token_ids or ():
            if not isinstance(t_id, int) or t_id < 0:
                raise ValueError(f"allowed_token_ids must be token ids >= 0, got {t_id!r}")
        words = self.bad_words_token_ids or ()
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} token sequences, got {len(words)}")
        if any(not w for w in words):
            raise ValueError("bad_words: a word tokenizes to nothing")
        for w in words:
            if not isinstance(w, list | tuple) or not all(isinstance(t, int) and t >= 0 for t in w):
                raise ValueError(f"bad_words: each word must be a list of token ids >= 0, got {w!r}")
        if self.allowed_token_ids and words and set(self.allowed_token_ids) <= _one_token_words(words):
            raise ValueError("bad_words: every one of allowed_token_ids is a one-token bad word, so no token could "
                             "ever be drawn: allow another token or drop the bad word")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {type(so).__name__}")
        if so is not None and so.num_set != 1:
            raise ValueError(f"structured_outputs: exactly one of json, regex, choice, grammar, json_object, "
                             f"got {so.num_set}")


def _is_number(v) -> bool:
    """A real number (int or float, not bool), not NaN."""
    return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)


def only_finish_tokens_allowed(params: SamplingParams, finish_token_ids: Iterable[int]) -> str:
    """Why ``params`` leave nothing to sample before ``min_tokens`` ("" if they do not): every id
    ``allowed_token_ids`` keeps ends the output (``finish_token_ids``: end-of-sequence and stop
    tokens), and ``min_tokens`` holds each of them back."""
    if not params.min_tokens or not params.allowed_token_ids:
        return ""
    finish = set(finish_token_ids)
    # A one-token bad word is never drawn: what is left of the allowed ids is what counts.
    if finish and set(params.allowed_token_ids) - _one_token_words(params.bad_words_token_ids or ()) <= finish:
        return (f"allowed_token_ids: every allowed token (less one-token bad words) ends the output "
                f"(end-of-sequence or a stop token), which min_tokens {params.min_tokens} holds back: allow "
                "another token or drop min_tokens")
    return ""


def _one_token_words(words) -> set[int]:
    """The ids banned at every step: the bad words of one token."""
    return {w[0] for w in words if len(w) == 1}
