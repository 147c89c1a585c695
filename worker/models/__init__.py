"""Decoder architectures over the paged KV cache, one file each, found by ``model_type``
(``registry``)."""

from pagefleet.common.model_config import ModelConfig

from .decoder import CausalLM, DecoderSpec
from .registry import ARCHITECTURES, architecture

__all__ = ["ModelConfig", "CausalLM", "DecoderSpec", "ARCHITECTURES", "architecture"]
