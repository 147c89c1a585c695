"""Mixtral: Mistral's attention, a sparse MoE block on every layer (softmax, top-k,
renormalized)."""

from __future__ import annotations

import torch

from pagefleet.common.model_config import ModelConfig

from .decoder import DecoderSpec
from .moe import MoESpec, stack_experts


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    moe = MoESpec(num_experts=cfg.hf["num_local_experts"], top_k=cfg.hf["num_experts_per_tok"],
                  intermediate_size=cfg.intermediate_size, norm_topk_prob=True, activation=cfg.hidden_act)
    return DecoderSpec(moe=moe)


def convert(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    for i in range(cfg.num_hidden_layers):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        stack_experts(state, f"{old}.experts", cfg.hf["num_local_experts"], "w1", "w3", "w2")
        state[f"{new}.router.weight"] = state.pop(f"{old}.gate.weight")
        state[f"{new}.w13"] = state.pop(f"{old}.w13")
        state[f"{new}.w2"] = state.pop(f"{old}.w2")
    return state
