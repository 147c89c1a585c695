"""Gemma 2: scaled embeddings, (1 + w) RMSNorms around each sublayer, GeGLU (tanh), queries
scaled by ``query_pre_attn_scalar``, attention and final logit soft-caps, sliding and full
layers alternating."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig, **more) -> DecoderSpec:
    hf = cfg.hf
    return DecoderSpec(
        norm="sandwich",
        norm_offset=1.0,
        attn_scale=hf.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5,
        attn_soft_cap=hf.get("attn_logit_softcapping"),
        final_soft_cap=hf.get("final_logit_softcapping"),
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        embed_scale=cfg.hidden_size**0.5,
        **more,
    )
