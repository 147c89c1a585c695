"""The layers decoder architectures share: norms, activations, attention over the paged
KV cache, the dense MLP.

Weights are held fused (``qkv_proj``, ``gate_up_proj``): a checkpoint's separate q/k/v and
gate/up matrices are concatenated at load (``decoder.fuse_projections``).
Every forward pass takes a flat batch of tokens (no padding dimension) plus the
attention metadata that says which sequence each token belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels import paged_attention, rms_norm, silu_and_mul, write_kv


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding row
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``offset=1.0`` Gemma's ``(1 + weight)``, applied in
    float32 before the cast back, as Gemma does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu": F.gelu}


def gated(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``: the gated MLP's middle."""
    return ACTIVATIONS[act](gate) * up


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One layer's attention: its shape and the options the architecture turns on."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": per head (Qwen3, Gemma 3); "full": whole width (OLMo 2)
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm is not None:
            head = spec.qk_norm == "head"
            eps, off = spec.norm_eps, spec.norm_offset
            self.q_norm = RMSNorm(spec.head_dim if head else self.q_size, eps, off)
            self.k_norm = RMSNorm(spec.head_dim if head else self.kv_size, eps, off)
        if spec.sinks:
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads))

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata):
        spec = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        if spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(n, spec.num_heads, spec.head_dim)
        k = k.reshape(n, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(n, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        o = paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, spec.scale,
            window=spec.window, soft_cap=spec.soft_cap, sinks=self.sinks.float() if spec.sinks else None,
        )
        return self.o_proj(o.reshape(n, self.q_size))


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(gated(self.act, *gate_up.chunk(2, dim=-1)))
