"""Plain-torch references for the fused per-token operations of a decoder layer.

Each is the CPU path of the engine and the ground truth of its Triton kernel
(``fused_triton``). They compute exactly as Hugging Face's layers do, every intermediate
rounded to the activations' dtype where theirs is, so that a fused kernel that follows the
same roundings gives the same bits:

* ``rms_norm_ref``: ``weight * (x / rms(x))`` with the normalisation in float32 and cast back
  before the weight (Llama); with ``offset`` (Gemma's ``1 + weight``) the product is taken in
  float32 and cast after.
* ``silu_and_mul_ref``: ``silu(gate) * up`` of a ``[..., 2 * d]`` tensor's halves.
* ``rope_ref``: rotary embedding of the first ``rotary_dim`` features of every head, the
  non-interleaved halves of Hugging Face's Llama, cos/sin looked up per position in float32
  tables and cast to the activations' dtype first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(dtype)
    return weight * h.to(dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = gate_up.chunk(2, -1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[n, heads, head_dim]`` and ``k`` ``[n, kv_heads, head_dim]`` by the
    float32 tables ``cos``/``sin`` ``[num_positions, rotary_dim]`` at ``positions`` ``[n]``."""
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)
    d = cos.shape[-1]
    if d == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, k_rot = q[..., :d], k[..., :d]
    q = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., d:]), dim=-1)
    k = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., d:]), dim=-1)
    return q, k
