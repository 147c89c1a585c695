"""Qwen3-MoE: Qwen3's attention; experts on the layers ``decoder_sparse_step`` picks (less
``mlp_only_layers``), routed by softmax then top-k, renormalized if ``norm_topk_prob``."""

from __future__ import annotations

import torch

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec
from .moe import MoESpec, stack_experts


def _num_experts(cfg: ModelConfig) -> int:
    # transformers' default (128) when the config names neither
    return cfg.hf.get("num_experts") or cfg.hf.get("num_local_experts") or 128


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    step, dense = cfg.hf.get("decoder_sparse_step", 1), set(cfg.hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(cfg.num_hidden_layers)
                 if _num_experts(cfg) > 0 and i not in dense and (i + 1) % step == 0)


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    moe = MoESpec(num_experts=_num_experts(cfg), top_k=cfg.hf["num_experts_per_tok"],
                  intermediate_size=cfg.hf["moe_intermediate_size"],
                  norm_topk_prob=cfg.hf.get("norm_topk_prob", False), activation=cfg.hidden_act)
    return DecoderSpec(qk_norm="head", qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, moe=moe,
                       moe_layers=moe_layers(cfg))


def convert(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    for i in moe_layers(cfg):
        p = f"model.layers.{i}.mlp"
        stack_experts(state, f"{p}.experts", _num_experts(cfg), "gate_proj", "up_proj", "down_proj")
        state[f"{p}.router.weight"] = state.pop(f"{p}.gate.weight")
    return state
