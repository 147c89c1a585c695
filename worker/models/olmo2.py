"""OLMo 2: RMSNorm after each sublayer (not before), q/k norms over the whole projection."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    return DecoderSpec(norm="post", qk_norm="full", qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
