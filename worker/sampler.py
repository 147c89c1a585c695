"""Token sampling for one step, on the logits' device: greedy, temperature, top-k, top-p, seeds.

Random choice is the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn
independently per vocabulary entry picks exactly from ``p``. A seeded request's ``q`` comes
from a counter-based generator, ``q = -log(u)`` with ``u`` a hash of (seed, the position the
new token takes, vocabulary index): its tokens depend on its seed and their positions only,
never on the rest of the batch, on preemption or recompute, or on which worker runs it.
Unseeded rows draw from the engine's generator. Only the sampled ids leave the device.
"""

from __future__ import annotations

import torch

from pagefleet.common.sampling_params import GREEDY_TEMPERATURE

from .request import Request

_M32 = 0xFFFFFFFF


def sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
    """One token id per row of ``logits`` ``[len(reqs), vocab]``, as an int64 tensor on its device."""
    argmax = logits.argmax(dim=-1)
    greedy = [r.params.temperature < GREEDY_TEMPERATURE for r in reqs]
    if all(greedy):
        return argmax
    dev = logits.device
    temps = torch.tensor(
        [1.0 if g else r.params.temperature for g, r in zip(greedy, reqs, strict=True)],
        dtype=torch.float32, device=dev,
    )
    x = logits.float() / temps[:, None]
    top_ks = [r.params.top_k for r in reqs]
    top_ps = [r.params.top_p for r in reqs]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        x = _filter_top_k_top_p(x, top_ks, top_ps)
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs)
    q.exponential_(generator=generator)
    seeded = [i for i, (g, r) in enumerate(zip(greedy, reqs, strict=True)) if not g and r.params.seed is not None]
    if seeded:
        rows = [reqs[i] for i in seeded]
        q[seeded] = seeded_exponentials(
            [r.params.seed for r in rows], [len(r.all_token_ids) for r in rows], probs.shape[-1], dev
        )
    chosen = (probs / q).argmax(dim=-1)
    return torch.where(torch.tensor(greedy, device=dev), argmax, chosen)


def seeded_exponentials(seeds: list[int], positions: list[int], vocab: int, device) -> torch.Tensor:
    """``[len(seeds), vocab]`` Exp(1) draws, a pure function of (seed, position, column)."""
    seeds = [s & 0xFFFFFFFFFFFFFFFF for s in seeds]
    lo = torch.tensor([s & _M32 for s in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([s >> 32 for s in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor([p & _M32 for p in positions], dtype=torch.int64, device=device)
    k1 = _mix32(_mix32(_mix32(pos) ^ lo) ^ hi)[:, None]
    k2 = _mix32(k1 ^ 0x85EBCA6B)
    col = _mul32(torch.arange(vocab, dtype=torch.int64, device=device), 0x9E3779B1)
    h = _mix32(_mix32(col ^ k1) ^ k2)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0
    return -torch.log(u)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)``, in int64 without overflow."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (the "lowbias32" finalizer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _filter_top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab, dev = x.shape[-1], x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= ks[:, None]
    ps = torch.tensor(top_ps, dtype=x.dtype, device=dev)
    sorted_probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= ps[:, None]
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
