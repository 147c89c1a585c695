"""Log-probabilities of generated tokens: the one shape from the sampler to the client.

Each generated token gets one ``TokenLogprobs``: the log-probability of the token that
was generated and those of the most likely tokens at its position, most likely first
(``SamplingParams.logprobs`` of them). The distribution is the one after penalties and
the ``min_tokens`` mask, before temperature, top-k and top-p. In Redis they travel as
``TokenLogprobs`` messages of the steps' ``StepOutput`` (``protos/``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """One generated token's log-probability and its alternatives (``top_token_ids[i]``
    has log-probability ``top_logprobs[i]``)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
