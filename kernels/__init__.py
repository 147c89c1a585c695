"""Paged-KV kernels: attention over block tables and K/V slot writes; the fused MoE layer.

``paged_attention``, ``write_kv``, ``fused_moe`` and a layer's fused elementwise operations
(``rms_norm``, ``silu_and_mul``, ``rope``) dispatch on the device of their tensors: the
Triton kernels on CUDA, the plain-torch references elsewhere (the Triton
interpreter is for tests, not serving).
"""

from __future__ import annotations

import contextlib

import torch

from .fused_reference import rms_norm_ref, rope_ref, silu_and_mul_ref
from .moe_reference import fused_moe_ref
from .reference import paged_attention_ref, write_kv_ref

__all__ = ["paged_attention", "write_kv", "fused_moe", "rms_norm", "silu_and_mul", "rope", "paged_attention_ref",
           "write_kv_ref", "fused_moe_ref", "rms_norm_ref", "silu_and_mul_ref", "rope_ref"]


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


def attention_split_choices(device: torch.device) -> list[int | None]:
    """The split counts ``paged_attention`` can take on ``device`` (``[None]`` where it never
    splits: the references)."""
    if not _use_triton(torch.empty(0, device=device)):
        return [None]
    from .triton_ops import split_choices

    return split_choices()


@contextlib.contextmanager
def forced_attention_splits(num_splits: int | None):
    """Within: ``paged_attention`` on the Triton kernels splits every context into
    ``num_splits`` ranges (``None``: its own choice). For a worker's warm-up only."""
    if num_splits is None:
        yield
        return
    from .triton_ops import forced_splits

    with forced_splits(num_splits):
        yield


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    *, window=None, soft_cap=None, sinks=None):
    """Attention of each sequence's query rows over its paged context; see ``reference``
    (``window``, ``soft_cap``, ``sinks``: its attention options)."""
    if _use_triton(query):
        from .triton_ops import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            window=window, soft_cap=soft_cap, sinks=sinks,
        )
    return paged_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        window=window, soft_cap=soft_cap, sinks=sinks,
    )


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation, b13=None, b2=None):
    """Tokens through their top-k experts, weighted and summed; see ``moe_reference``."""
    if _use_triton(hidden):
        from .moe_triton import fused_moe_triton

        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, activation, b13, b2)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, activation, b13, b2)


def rms_norm(x, weight, eps, offset=0.0):
    """RMSNorm over the last dimension; see ``fused_reference.rms_norm_ref``."""
    if _use_triton(x):
        from .fused_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, offset)
    return rms_norm_ref(x, weight, eps, offset)


def silu_and_mul(gate_up):
    """``silu(gate) * up`` of the two halves of ``gate_up``'s last dimension."""
    if _use_triton(gate_up):
        from .fused_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def rope(positions, q, k, cos, sin):
    """Rotary embedding of ``q`` and ``k`` at ``positions``; see ``fused_reference.rope_ref``."""
    if _use_triton(q):
        from .fused_triton import rope_triton

        return rope_triton(positions, q, k, cos, sin)
    return rope_ref(positions, q, k, cos, sin)
