"""Llama, and the models that are Llama with a flag or two: Mistral (a sliding window on
every layer), Qwen2 (q/k/v biases)."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    # Qwen2 has q/k/v biases (attention_bias is set for it) but none on o_proj.
    return DecoderSpec(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias and cfg.model_type != "qwen2",
                       mlp_bias=cfg.mlp_bias)
