"""Paged-KV kernels: attention over block tables and K/V slot writes.

``paged_attention`` and ``write_kv`` dispatch on the device of their tensors: the
Triton kernels on CUDA, the plain-torch references elsewhere (the Triton
interpreter is for tests, not serving).
"""

from __future__ import annotations

import torch

from .reference import paged_attention_ref, write_kv_ref

__all__ = ["paged_attention", "write_kv", "paged_attention_ref", "write_kv_ref"]


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        from . import triton_ops  # noqa: F401
    except ImportError:
        return False
    return True


def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` rows into the caches at ``slot_mapping`` (``-1`` skips), in place."""
    if _use_triton(key):
        from .triton_ops import write_kv_triton

        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Attention of each sequence's query rows over its paged context; see ``reference``."""
    if _use_triton(query):
        from .triton_ops import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return paged_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
