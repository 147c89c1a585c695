"""gpt-oss: attention with biases and a learned sink per head, sliding and full layers
alternating, yarn RoPE; experts with biases and a clamped SwiGLU, routed by top-k then
softmax. MXFP4 expert weights are dequantized at load (``mxfp4``)."""

from __future__ import annotations

import torch

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec
from .moe import MoESpec
from .mxfp4 import dequantize_state


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    hf = cfg.hf
    moe = MoESpec(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                  intermediate_size=cfg.intermediate_size, routing="topk_softmax", router_bias=True,
                  expert_bias=True, activation="swiglu_oai", swiglu_alpha=hf.get("swiglu_alpha", 1.702),
                  swiglu_limit=hf.get("swiglu_limit", 7.0))
    return DecoderSpec(sinks=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, moe=moe)


def convert(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Stacked experts as this network holds them: gate then up rows (the checkpoint
    interleaves them, gate at even columns), ``[experts, out, in]``."""
    dequantize_state(state)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp"
        gate_up = state.pop(f"{p}.experts.gate_up_proj")  # [E, hidden, 2 * inter]
        bias = state.pop(f"{p}.experts.gate_up_proj_bias")  # [E, 2 * inter]
        state[f"{p}.w13"] = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        state[f"{p}.w13_bias"] = torch.cat([bias[..., ::2], bias[..., 1::2]], dim=-1)
        state[f"{p}.w2"] = state.pop(f"{p}.experts.down_proj").transpose(1, 2).contiguous()  # [E, hidden, inter]
        state[f"{p}.w2_bias"] = state.pop(f"{p}.experts.down_proj_bias")
    return state
