"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds.

Random choice uses the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which
draws from ``p`` exactly; each seeded request draws its ``q`` row from its own
generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from .request import Request
from .sampling_params import GREEDY_TEMPERATURE


def sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> list[int]:
    """One token id per row of ``logits`` ``[len(reqs), vocab]`` (float32)."""
    argmax = logits.argmax(dim=-1)
    greedy = [r.params.temperature < GREEDY_TEMPERATURE for r in reqs]
    if all(greedy):
        return argmax.tolist()
    temps = torch.tensor(
        [1.0 if g else r.params.temperature for g, r in zip(greedy, reqs, strict=True)],
        dtype=logits.dtype,
    )
    x = logits / temps[:, None]
    top_ks = [r.params.top_k for r in reqs]
    top_ps = [r.params.top_p for r in reqs]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        x = _filter_top_k_top_p(x, top_ks, top_ps)
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs)
    q.exponential_(generator=generator)
    for i, r in enumerate(reqs):
        if r.generator is not None:
            q[i].exponential_(generator=r.generator)
    chosen = (probs / q).argmax(dim=-1)
    out = torch.where(torch.tensor(greedy), argmax, chosen)
    return out.tolist()


def _filter_top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks])
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= ks[:, None]
    ps = torch.tensor(top_ps, dtype=x.dtype)
    sorted_probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= ps[:, None]
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
