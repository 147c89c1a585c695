"""Log-probabilities of generated tokens: the one shape from the sampler to the client.

Each generated token gets one ``TokenLogprobs``: the log-probability of the token that
was generated and those of the most likely tokens at its position, most likely first
(``SamplingParams.logprobs`` of them). The distribution is the one after penalties and
the ``min_tokens`` mask, before temperature, top-k and top-p. ``pack_logprobs`` / ``unpack_logprobs`` are
the output stream's compact encoding (packed float32 and uint32 arrays).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """One generated token's log-probability and its alternatives (``top_token_ids[i]``
    has log-probability ``top_logprobs[i]``)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def pack_logprobs(entries: list[TokenLogprobs]) -> dict[str, bytes | int]:
    """Stream fields for ``entries``; every entry must have the same number of alternatives."""
    num_top = len(entries[0].top_token_ids) if entries else 0
    if any(len(e.top_token_ids) != num_top or len(e.top_logprobs) != num_top for e in entries):
        raise ValueError("logprobs: every token needs the same number of alternatives")
    return {
        "lp": array("f", [e.logprob for e in entries]).tobytes(),
        "lk": num_top,
        "li": array("I", [t for e in entries for t in e.top_token_ids]).tobytes(),
        "lv": array("f", [v for e in entries for v in e.top_logprobs]).tobytes(),
    }


def unpack_logprobs(fields: dict[bytes, bytes]) -> list[TokenLogprobs] | None:
    """The entries ``pack_logprobs`` wrote, or None where the fields are absent (no logprobs asked for)."""
    raw = fields.get(b"lp")
    if raw is None:
        return None
    lps, ids, vals = array("f"), array("I"), array("f")
    lps.frombytes(raw)
    ids.frombytes(fields.get(b"li", b""))
    vals.frombytes(fields.get(b"lv", b""))
    k = int(fields.get(b"lk", 0))
    ids_list, vals_list = ids.tolist(), vals.tolist()
    return [
        TokenLogprobs(lp, ids_list[i * k : (i + 1) * k], vals_list[i * k : (i + 1) * k])
        for i, lp in enumerate(lps.tolist())
    ]
