"""One decoder network for every architecture: a ``DecoderSpec`` says which of the shared
layers (``layers``, ``moe``, ``rope``) each layer uses and where its norms sit.

An architecture file (``llama.py``, ``gemma2.py``, ...) is a function from ``ModelConfig``
to ``DecoderSpec`` and, where its checkpoint's names differ from these, a function that
renames a state dict; ``registry.py`` maps ``model_type`` to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagefleet.common.model_config import ModelConfig

from .layers import MLP, Attention, AttentionMetadata, AttentionSpec, RMSNorm
from .moe import MoESpec, SparseMoE
from .rope import RotaryEmbedding

# Where a layer's norms sit. "pre": norm -> sublayer -> residual (Llama). "sandwich": also a
# norm on each sublayer's output (Gemma 2/3). "post": only the norm on the output (OLMo 2).
NORM_PLACEMENTS = ("pre", "sandwich", "post")


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    norm: str = "pre"
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + weight)
    qk_norm: str | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    sinks: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite's residual_multiplier
    logits_scale: float = 1.0  # Granite: 1 / logits_scaling
    partial_rotary_factor: float = 1.0
    # The rope of sliding layers where it differs from the global one (Gemma 3): (theta, scaling).
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    moe: MoESpec | None = None
    moe_layers: tuple[int, ...] | None = None  # None: every layer (when ``moe`` is set)

    def __post_init__(self) -> None:
        if self.norm not in NORM_PLACEMENTS:
            raise ValueError(f"norm must be one of {NORM_PLACEMENTS}, got {self.norm!r}")

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and (self.moe_layers is None or layer in self.moe_layers)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.spec = spec
        self.sliding = cfg.window_of(index) is not None
        self.self_attn = Attention(AttentionSpec(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, scale=spec.attn_scale or cfg.head_dim**-0.5, qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias, qk_norm=spec.qk_norm, norm_eps=cfg.rms_norm_eps, norm_offset=spec.norm_offset,
            window=cfg.window_of(index), soft_cap=spec.attn_soft_cap, sinks=spec.sinks,
        ))
        if spec.is_moe(index):
            self.mlp = SparseMoE(cfg.hidden_size, spec.moe)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, spec.mlp_bias)
        norm = [] if spec.norm == "post" else ["input_layernorm"]
        norm += ["post_attention_layernorm"]
        norm += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if spec.norm == "sandwich" else []
        norm += ["post_feedforward_layernorm"] if spec.norm == "post" else []
        for name in norm:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset))

    def forward(self, x, positions, rope, kv_cache, meta):
        spec, r = self.spec, self.spec.residual_scale
        if spec.norm == "pre":
            x = x + r * self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
            return x + r * self.mlp(self.post_attention_layernorm(x))
        if spec.norm == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, positions, rope, kv_cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        h = self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)


class CausalLM(nn.Module):
    """The network of one checkpoint; module names follow the Hugging Face layout (with q/k/v
    and gate/up fused), so a converted state dict loads as it is."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.model = DecoderModel(cfg, spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n = max_positions or cfg.max_position_embeddings
        self.rope = RotaryEmbedding(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, n,
                                    cfg.max_position_embeddings, spec.partial_rotary_factor)
        self.rope_local = None
        if spec.local_rope is not None:
            theta, scaling = spec.local_rope
            self.rope_local = RotaryEmbedding(theta, scaling, cfg.head_dim, n, cfg.max_position_embeddings,
                                              spec.partial_rotary_factor)

    def ropes(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rope, self.rope_local) if r is not None]

    def extend_positions(self, num_positions: int) -> None:
        """Make the RoPE tables cover ``num_positions`` positions (float32)."""
        for rope in self.ropes():
            if rope.num_positions < num_positions:
                rope.extend(num_positions)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        spec = self.spec
        x = self.model.embed_tokens(input_ids)
        if spec.embed_scale != 1.0:
            x = x * torch.tensor(spec.embed_scale, dtype=x.dtype)
        local = self.rope_local or self.rope
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, positions, local if layer.sliding else self.rope, kv, meta)
        x = self.model.norm(x.index_select(0, logits_indices))
        logits = self.lm_head(x).float()
        if spec.logits_scale != 1.0:
            logits = logits * spec.logits_scale
        if spec.final_soft_cap is not None:
            logits = torch.tanh(logits / spec.final_soft_cap) * spec.final_soft_cap
        return logits


_FUSE = (
    (re.compile(r"(.*\.self_attn)\.q_proj\.(weight|bias)$"), ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (re.compile(r"(.*\.mlp)\.gate_proj\.(weight|bias)$"), ("gate_proj", "up_proj"), "gate_up_proj"),
)


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, in place."""
    for key in list(state):
        for pattern, parts, fused in _FUSE:
            m = pattern.match(key)
            if m:
                owner, kind = m.groups()
                state[f"{owner}.{fused}.{kind}"] = torch.cat([state.pop(f"{owner}.{p}.{kind}") for p in parts])
    return state
