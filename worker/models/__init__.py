"""Llama-family decoder models over the paged KV cache."""

from .config import ModelConfig
from .llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
