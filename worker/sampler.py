"""Token sampling for one step, on the logits' device: greedy, temperature, min-p, top-k, top-p, seeds.

Random choice is the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn
independently per vocabulary entry picks exactly from ``p``. A seeded request's ``q`` comes
from a counter-based generator, ``q = -log(u)`` with ``u`` a hash of (seed, the position the
new token takes, vocabulary index): its tokens depend on its seed and their positions only,
never on the rest of the batch, on preemption or recompute, or on which worker runs it.
Unseeded rows draw from the engine's generator. Every draw is above 0 (``u`` below 1, and
the draws clamped): a draw of 0 would make ``0 / 0`` NaN for each token of probability 0
(masked, filtered, or underflowed), and argmax takes NaN for the largest.

Before any of that, rows that ask for it are processed in place (``penalties.py``,
``token_masks.py``): penalties, the ``min_tokens`` mask, then token masks. Log-probabilities are ``log_softmax`` of those
processed logits (before temperature, top-k and top-p), computed on the device; the sampled
ids and the few log-probabilities asked for leave the device together, in one copy. A batch
where no row uses penalties, ``min_tokens`` or logprobs pays one list comprehension for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.sampling_params import GREEDY_TEMPERATURE

from .penalties import apply_penalties, mask_finish_tokens
from .request import Request
from .token_masks import apply_token_masks

_M32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny  # the smallest positive draw the race divides by


@dataclass(slots=True)
class SamplerOutput:
    """One step's sampled tokens, one per row; ``logprobs[i]`` is None for a row that did not
    ask for them, and ``logprobs`` is None when no row did."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


@torch.inference_mode()  # the logits are inference tensors: changed in place here
def sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> SamplerOutput:
    """One token per row of ``logits`` ``[len(reqs), vocab]`` (float32; rows that use penalties
    or ``min_tokens`` are changed in place); the step's one wait for the device."""
    extras = [i for i, r in enumerate(reqs) if r.processes_logits]
    if not extras:
        return SamplerOutput(choose(logits, reqs, generator).tolist())
    process_logits(logits, extras, [reqs[i] for i in extras])
    token_ids = choose(logits, reqs, generator)
    dead = _dead_rows(logits, extras, reqs)
    asked = [i for i in extras if reqs[i].params.logprobs is not None]
    if not asked:
        return SamplerOutput((token_ids if dead is None else torch.where(dead, NO_TOKEN, token_ids)).tolist())
    return _with_logprobs(logits, token_ids, reqs, asked, dead)


NO_TOKEN = -1  # a row whose masks left no token: the engine ends its request with why


def _dead_rows(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> torch.Tensor | None:
    """``[len(reqs)]`` bool on the device: the rows of ``rows`` whose token masks
    (``allowed_token_ids``, bad words; with ``min_tokens`` holding back the rest; a grammar gives
    its row its own back) left every logit -inf, so whatever was drawn there is a token they
    forbid (a bad word grown from its first tokens over ``allowed_token_ids``, say). None when no
    row has such masks (the common case: no work). ``min_tokens`` alone masks only the end
    tokens, which never empties a row."""
    masked = [i for i in rows if reqs[i].params.has_token_masks]
    if not masked:
        return None
    dev = logits.device
    idx = torch.tensor(masked, dtype=torch.int64).to(dev)
    dead = torch.zeros(len(reqs), dtype=torch.bool, device=dev)
    dead[idx] = torch.isneginf(logits.index_select(0, idx)).all(dim=-1)
    return dead


def process_logits(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Penalties, the ``min_tokens`` mask, then token masks (logit_bias, allowed_token_ids, bad
    words), on ``logits[rows[i]]`` for ``reqs[i]``, in place."""
    pen = [j for j, r in enumerate(reqs) if r.params.has_penalties]
    if pen:
        apply_penalties(logits, [rows[j] for j in pen], [reqs[j] for j in pen])
    short = [
        j for j, r in enumerate(reqs) if len(r.output_token_ids) < r.params.min_tokens and r.finish_token_ids
    ]
    if short:
        mask_finish_tokens(logits, [rows[j] for j in short], [reqs[j] for j in short])
    masked = [j for j, r in enumerate(reqs) if r.params.has_token_masks]
    if masked:
        apply_token_masks(logits, [rows[j] for j in masked], [reqs[j] for j in masked])


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, reqs: list[Request], asked: list[int],
    dead: torch.Tensor | None = None,
) -> SamplerOutput:
    """The sampled ids with the log-probabilities of rows ``asked``: everything is packed into
    one float64 tensor (exact for ids and float32 values) and read in one copy."""
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(asked, dtype=torch.int64).to(dev)
    x = logits.index_select(0, idx)
    # log_softmax without writing it out: logit - logsumexp, for the few entries returned.
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(1, token_ids.index_select(0, idx)[:, None]) - lse).squeeze(1)
    k = min(max(reqs[i].params.logprobs for i in asked), vocab)
    parts = [token_ids if dead is None else torch.where(dead, NO_TOKEN, token_ids), chosen]
    if k:
        top_values, top_ids = x.topk(k, dim=-1)
        parts += [(top_values - lse).flatten(), top_ids.flatten()]
    packed = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    n, m = len(reqs), len(asked)
    ids = [int(t) for t in packed[:n]]
    values, tops = packed[n + m : n + m + m * k], packed[n + m + m * k :]
    logprobs: list[TokenLogprobs | None] = [None] * n
    for j, i in enumerate(asked):
        num = min(reqs[i].params.logprobs, vocab)
        logprobs[i] = TokenLogprobs(
            packed[n + j], [int(t) for t in tops[j * k : j * k + num]], values[j * k : j * k + num]
        )
    return SamplerOutput(ids, logprobs)


def choose(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
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
    min_ps = [r.params.min_p for r in reqs]
    if any(min_ps):  # vLLM's order: min_p on the tempered distribution, then top-k and top-p
        x = _filter_min_p(x, min_ps)
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
    # A token of probability 0 must never win: 0 / 0 is NaN, which argmax takes for the largest.
    chosen = (probs / q.clamp_(min=_TINY)).argmax(dim=-1)
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
    # 23 bits, so that (v + 0.5) is exact in float32: u is in [2**-24, 1 - 2**-24], never 0 or 1.
    # (With 24 bits the top value rounded to 1.0, so one draw in 2**24 was -0.0, and a token of
    # probability 0 won the race as 0 / -0.0 = NaN.)
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
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


def _filter_min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """``x`` with every entry less likely than ``min_p`` times its row's most likely one at -inf."""
    probs = torch.softmax(x, dim=-1)
    floor = torch.tensor(min_ps, dtype=probs.dtype, device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(probs < floor, float("-inf"))


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
    # Only rows that ask for top-p: in float32 the running mass reaches 1.0 before the tail's
    # end, and a row with top_p 1 (batched with one that filters) lost its rarest tokens, so a
    # seeded request's draw depended on its neighbours.
    drop |= (mass_before >= ps[:, None]) & (ps[:, None] < 1.0)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
