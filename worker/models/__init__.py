"""Llama-family decoder models over the paged KV cache."""

from pagefleet.common.model_config import ModelConfig

from .llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
