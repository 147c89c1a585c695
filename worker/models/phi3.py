"""Phi-3 and Phi-4-mini: Llama with q/k/v and gate/up stored fused (as this network holds
them), a partial rotary factor and longrope scaling."""

from __future__ import annotations

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    rope = cfg.hf.get("rope_parameters") or {}
    factor = cfg.hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return DecoderSpec(partial_rotary_factor=factor, qkv_bias=cfg.attention_bias)
