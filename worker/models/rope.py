"""Rotary position embeddings: default, linear, llama3, yarn and longrope, partial rotary.

Each variant is a table of inverse frequencies (and, for yarn and longrope, a factor on
cos/sin), computed as ``transformers``' ``modeling_rope_utils`` does. Longrope picks its
short factors for positions below ``original_max_position_embeddings`` and its long factors
from there on, per position, so a token's rotation never depends on what it is batched with.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagefleet.kernels import rope


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_factor(s: dict[str, Any], max_positions: int) -> float:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_tables(theta: float, scaling: dict[str, Any] | None, rotary_dim: int, num_positions: int,
                max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[num_positions, rotary_dim]`` float32."""
    kind = (scaling or {}).get("rope_type", "default")
    t = torch.arange(num_positions, dtype=torch.float32)
    attention_factor = 1.0
    if kind in ("default", "linear", "llama3"):
        inv_freq = _default_inv_freq(theta, rotary_dim)
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        freqs = torch.outer(t, inv_freq)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(theta, rotary_dim, scaling, max_position_embeddings)
        freqs = torch.outer(t, inv_freq)
    elif kind == "longrope":
        attention_factor = _longrope_factor(scaling, max_position_embeddings)
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
        is_long = (t >= scaling["original_max_position_embeddings"])[:, None]
        freqs = torch.where(is_long, torch.outer(t, long), torch.outer(t, short))
    else:
        raise ValueError(f"rope scaling type {kind!r} is not supported")
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position (non-interleaved halves, as in Hugging Face Llama),
    applied to the first ``rotary_dim`` features of each head."""

    def __init__(self, theta: float, scaling: dict[str, Any] | None, head_dim: int, max_positions: int,
                 max_position_embeddings: int, partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.args = (theta, scaling, self.rotary_dim, max_position_embeddings)
        cos, sin = rope_tables(theta, scaling, self.rotary_dim, max_positions, max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def extend(self, num_positions: int) -> None:
        """Rebuild the tables for ``num_positions`` positions (float32, on their device)."""
        theta, scaling, dim, max_pe = self.args
        cos, sin = rope_tables(theta, scaling, dim, num_positions, max_pe)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def forward(self, positions, q, k):
        return rope(positions, q, k, self.cos, self.sin)
