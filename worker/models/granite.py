"""Granite: Llama with multipliers on the embeddings, the attention scores, each residual
branch, and a divisor on the logits."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    hf = cfg.hf
    return DecoderSpec(
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        attn_scale=hf.get("attention_multiplier"),
        embed_scale=hf.get("embedding_multiplier", 1.0),
        residual_scale=hf.get("residual_multiplier", 1.0),
        logits_scale=1.0 / hf.get("logits_scaling", 1.0),
    )
