"""Token masks before sampling (vLLM's): ``logit_bias``, ``allowed_token_ids``, bad words,
and structured output's grammar (structured.py).

Applied in place to the rows that use them, after penalties and the ``min_tokens`` mask;
a step where no row sets one never calls this. Only the named (row, token) pairs are
written, except ``allowed_token_ids``, which masks its row's whole vocabulary but the ids.
Bad words follow vLLM: a word's last token is masked wherever the output ends with the
word's other tokens (a one-token word always).
"""

from __future__ import annotations

import torch

from .request import Request


def apply_token_masks(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Bias and mask ``logits[rows[i]]`` for ``reqs[i]``, in place; structured output last."""
    dev, vocab = logits.device, logits.shape[-1]
    neg_inf = float("-inf")
    for row, r in zip(rows, reqs, strict=True):
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.int64, device=dev)
            kept = logits[row].index_select(0, keep)
            logits[row].fill_(neg_inf)
            logits[row].index_copy_(0, keep, kept)
        if p.bad_words_token_ids:
            banned = [t for t in banned_token_ids(r.output_token_ids, p.bad_words_token_ids) if t < vocab]
            if banned:
                logits[row, torch.tensor(banned, dtype=torch.int64, device=dev)] = neg_inf
        if p.logit_bias:
            bias = [(t, v) for t, v in p.logit_bias.items() if t < vocab]
            ids = torch.tensor([t for t, _ in bias], dtype=torch.int64, device=dev)
            values = torch.tensor([v for _, v in bias], dtype=logits.dtype, device=dev)
            logits[row].index_add_(0, ids, values)
    constrained = [j for j, r in enumerate(reqs) if r.grammar is not None]
    if constrained:
        from .structured import apply_grammar_masks

        apply_grammar_masks(logits, [rows[j] for j in constrained], [reqs[j] for j in constrained])


def banned_token_ids(output_token_ids: list[int], bad_words: list[list[int]]) -> list[int]:
    """The last token of every bad word whose other tokens end the output."""
    banned = []
    n = len(output_token_ids)
    for word in bad_words:
        prefix = word[:-1]
        k = len(prefix)
        if k == 0 or (k <= n and output_token_ids[n - k:] == prefix):
            banned.append(word[-1])
    return banned
