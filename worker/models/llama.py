"""Llama-family decoder (Llama, Qwen2, Mistral) running over the paged KV cache.

Module names follow the Hugging Face layout so a checkpoint's state dict loads
as it is; ``fuse()`` then merges q/k/v and gate/up into single matmuls.
Every forward pass takes a flat batch of tokens (no padding dimension) plus the
attention metadata that says which sequence each token belongs to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.common.model_config import ModelConfig
from pagefleet.kernels import paged_attention, write_kv


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding row
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position (non-interleaved halves, as in Hugging Face Llama)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions, q, k):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.qkv_weight = _frozen(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        if self.q_proj.bias is not None:
            self.qkv_bias = _frozen(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata):
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        o = paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(o.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight = _frozen(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        if self.gate_proj.bias is not None:
            self.gate_up_bias = _frozen(torch.cat([self.gate_proj.bias, self.up_proj.bias]))
        del self.gate_proj, self.up_proj

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab_size]`` (float32) for the rows asked for."""
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, kv, meta)
        x = self.model.norm(x.index_select(0, logits_indices))
        return self.lm_head(x).float()
