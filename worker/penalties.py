"""Logits processing before sampling: penalties and the ``min_tokens`` mask, batched, in place.

Both work on the rows that use them only; a step where nobody does never calls them.

Penalties follow vLLM (and, for ``repetition_penalty``, transformers'
``RepetitionPenaltyLogitsProcessor``), in this order::

    seen = token in the prompt or the output
    x = where(seen, where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    x = x - frequency_penalty * counts - presence_penalty * (counts > 0)   # counts: in the output

A request's ``PenaltyState`` (``Request.penalty_state``, made at its first penalized step)
keeps its prompt's distinct ids on the device and its output counts on the host, brought up
to date from ``output_token_ids`` at every step, so a step costs the new tokens and the
distinct output tokens, not the whole sequence again. Only the (row, token) pairs those
name are touched: nothing here is rows x vocabulary.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .request import Request


class PenaltyState:
    """One request's tokens as its penalties see them.

    ``prompt_ids``: the prompt's distinct token ids on the device (None without a repetition
    penalty). ``output_counts``: token id -> occurrences among the first ``num_counted`` outputs.
    """

    __slots__ = ("prompt_ids", "output_counts", "num_counted")

    def __init__(self, req: Request, device: torch.device) -> None:
        self.prompt_ids = None
        if req.params.repetition_penalty != 1:
            ids = sorted(set(req.prompt_token_ids))
            self.prompt_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        self.output_counts: dict[int, int] = {}
        self.num_counted = 0

    def sync(self, output_token_ids: list[int]) -> None:
        """Count the outputs appended since the last call."""
        counts = self.output_counts
        for t in output_token_ids[self.num_counted :]:
            counts[t] = counts.get(t, 0) + 1
        self.num_counted = len(output_token_ids)


def _state(req: Request, device: torch.device) -> PenaltyState:
    state = req.penalty_state
    if state is None:
        state = req.penalty_state = PenaltyState(req, device)
    state.sync(req.output_token_ids)
    return state


def apply_penalties(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Penalize ``logits[rows[i]]`` (``logits``: ``[num_rows, vocab]``, float) for ``reqs[i]``, in place.

    Sparse: only the (row, token) pairs of each prompt and output are read and written, so a
    step costs the distinct tokens of the penalized rows, never rows x vocabulary.
    """
    dev = logits.device
    states = [_state(r, dev) for r in reqs]
    factors = torch.tensor(
        [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in reqs],
        dtype=logits.dtype,
    ).to(dev)
    repeating = [j for j, s in enumerate(states) if s.prompt_ids is not None]
    prompt_ids = [states[j].prompt_ids for j in repeating]
    num_prompt_ids = [p.numel() for p in prompt_ids]
    sizes = [len(s.output_counts) for s in states]
    total = sum(sizes)
    out_tokens = itertools.chain.from_iterable(s.output_counts for s in states)
    out_counts = itertools.chain.from_iterable(s.output_counts.values() for s in states)
    rows_d, rep_j, rep_len, out_j, out_tok, out_count = _to_device(
        [rows, repeating, num_prompt_ids, np.repeat(np.arange(len(reqs)), sizes),
         np.fromiter(out_tokens, np.int64, total), np.fromiter(out_counts, np.int64, total)],
        dev,
    )
    if repeating:
        # Prompt and output pairs together; a token in both is listed twice and gets the same
        # value twice. Rows whose penalty is 1 (here for their output pairs) are unchanged.
        j = torch.cat([rep_j.repeat_interleave(rep_len, output_size=sum(num_prompt_ids)), out_j])
        tok = torch.cat([*prompt_ids, out_tok])
        at, f = (rows_d[j], tok), factors[j, 0]
        v = logits[at]
        logits[at] = torch.where(v > 0, v / f, v * f)
    if total and any(r.params.frequency_penalty or r.params.presence_penalty for r in reqs):
        at = (rows_d[out_j], out_tok)
        logits[at] = logits[at] - factors[out_j, 1] * out_count.to(logits.dtype) - factors[out_j, 2]


def _to_device(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Integer sequences as int64 tensors on ``device``, in one copy."""
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    flat = torch.from_numpy(np.concatenate(arrays)).to(device)
    return list(flat.split([len(a) for a in arrays]))


def mask_finish_tokens(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every end-of-sequence or stop token id ``t`` of
    ``reqs[i]`` (ids outside the vocabulary are skipped): rows still short of ``min_tokens``."""
    vocab = logits.shape[-1]
    pairs = [(i, t) for i, r in zip(rows, reqs, strict=True) for t in r.finish_token_ids if t < vocab]
    if pairs:
        at = torch.tensor(pairs, dtype=torch.int64).to(logits.device)
        logits[at[:, 0], at[:, 1]] = float("-inf")
