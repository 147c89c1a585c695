"""Qwen3: Llama with an RMSNorm on each head's query and key before RoPE."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return DecoderSpec(qk_norm="head", qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
