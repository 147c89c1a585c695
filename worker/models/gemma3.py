"""Gemma 3 (text): Gemma 2 with per-head q/k norms and a RoPE base of its own on the
sliding layers; a ``gemma3`` vision-language checkpoint serves its language model."""

from __future__ import annotations

import dataclasses

import torch

from pagefleet.common.model_config import SLIDING, ModelConfig

from . import gemma2
from .decoder import DecoderSpec


def _local_rope(cfg: ModelConfig):
    rope = cfg.hf.get("rope_parameters") or {}
    if SLIDING in rope:
        local = dict(rope[SLIDING])
        theta = local.pop("rope_theta")
        kind = local.get("rope_type", "default")
        return float(theta), None if kind == "default" else local
    return float(cfg.hf.get("rope_local_base_freq", 10000.0)), None


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    # transformers' Gemma 3 attention applies no soft-cap, whatever attn_logit_softcapping says
    spec = gemma2.decoder_spec(cfg, qk_norm="head", local_rope=_local_rope(cfg))
    return dataclasses.replace(spec, attn_soft_cap=None)


_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))


def convert(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's language model under the text model's names."""
    out = {}
    for key, value in state.items():
        for old, new in _PREFIXES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        if key.startswith(("model.vision_tower", "model.multi_modal_projector", "vision_tower",
                           "multi_modal_projector")):
            continue
        out[key] = value
    return out
