"""Plain-torch references for the paged-KV kernels.

These are the CPU path of the engine and the ground truth the Triton kernels are
tested against. Layouts (shared with the Triton kernels):

* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* ``slot_mapping``: ``[num_tokens]`` int64, ``slot = block_id * block_size + offset``;
  ``-1`` marks a padding row that is skipped.
* ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32
* ``seq_lens``: ``[num_seqs]`` int32, context length including this step's tokens
  (whose K/V are already written to the cache).
* ``query_start_loc``: ``[num_seqs + 1]`` int32; sequence ``i``'s queries are rows
  ``query_start_loc[i]:query_start_loc[i+1]`` and are the last tokens of its context.

Attention options (``paged_attention_ref``'s keywords, compile-time switches of the Triton
kernel): ``window`` (a query at position ``p`` sees keys ``p - window < k <= p``), ``soft_cap``
(logits become ``soft_cap * tanh(logits / soft_cap)``, Gemma 2) and ``sinks`` (``[num_heads]``
float32 logits of a key with no value, joining each head's softmax denominator, gpt-oss).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place."""
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


_scratch_local = threading.local()


def _scratch(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A reusable buffer of ``shape`` for gathered K/V, one per thread.

    Allocating a fresh multi-megabyte tensor every layer of every step costs more in
    page faults than the gather itself (measured: ~6x slower on CPU).
    """
    bufs = getattr(_scratch_local, "bufs", None)
    if bufs is None:
        bufs = _scratch_local.bufs = {}
    numel = math.prod(shape)
    # Buffers made under inference mode can't be written outside it, and vice versa.
    key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]`` of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].to(torch.int64))
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context.

    Decode rows (one query token) of all sequences run as one padded batch; each
    prefill chunk runs on its own with a causal mask offset by its cached prefix.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    gqa = num_heads != num_kv_heads

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode_batch(query, key_cache, value_cache, block_tables, lens, qsl, decode, scale, out, gqa,
                      (window, soft_cap, sinks))
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        seq_len = lens[i]
        k = _gather_context(key_cache, block_tables[i], seq_len)
        v = _gather_context(value_cache, block_tables[i], seq_len)
        q = query[qsl[i] : qsl[i + 1]]
        # Query row r sits at absolute position seq_len - n + r and sees keys 0..that position.
        pos_q = torch.arange(seq_len - n, seq_len, device=query.device)
        pos_k = torch.arange(seq_len, device=query.device)
        mask = pos_k[None, :] <= pos_q[:, None]
        if window is not None:
            mask &= pos_k[None, :] > pos_q[:, None] - window
        o = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, gqa, soft_cap, sinks)
        out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1).to(query.dtype)
    return out


def _attend(q, k, v, mask, scale, gqa, soft_cap, sinks):
    """Softmax attention in float32 of ``q [..., heads, Lq, d]`` over ``k``/``v``
    ``[..., kv_heads, L, d]`` where ``mask`` (broadcast to ``[..., Lq, L]``) is true."""
    q, k, v = q.float(), k.float(), v.float()
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _decode_batch(query, key_cache, value_cache, block_tables, lens, qsl, rows, scale, out, gqa, options):
    """All single-token rows at once: gather each table's blocks, pad to the longest context."""
    block_size = key_cache.shape[1]
    idx = torch.tensor(rows, device=query.device)
    seq_lens = torch.tensor([lens[i] for i in rows], device=query.device)
    max_len = int(seq_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables.index_select(0, idx)[:, :max_blocks].to(torch.int64)
    # Entries past a sequence's own blocks are unspecified (may be -1 or stale): read block 0.
    num_used = (seq_lens + block_size - 1) // block_size
    in_use = torch.arange(max_blocks, device=query.device)[None, :] < num_used[:, None]
    tables = torch.where(in_use, tables, 0)
    n = len(rows)
    flat = tables.reshape(-1)
    shape = (n * max_blocks, *key_cache.shape[1:])
    k = torch.index_select(key_cache, 0, flat, out=_scratch("k", shape, key_cache))
    v = torch.index_select(value_cache, 0, flat, out=_scratch("v", shape, value_cache))
    k = k.view(n, max_blocks * block_size, *key_cache.shape[2:])
    v = v.view(n, max_blocks * block_size, *value_cache.shape[2:])
    q_rows = torch.tensor([qsl[i] for i in rows], device=query.device)
    q = query.index_select(0, q_rows)  # [n, num_heads, head_dim]
    window, soft_cap, sinks = options
    pos_k = torch.arange(max_blocks * block_size, device=query.device)[None, :]
    mask = pos_k < seq_lens[:, None]
    if window is not None:
        mask &= pos_k >= seq_lens[:, None] - window
    o = _attend(
        q[:, :, None, :],  # [n, heads, 1, d]
        k.transpose(1, 2),  # [n, kv_heads, L, d]
        v.transpose(1, 2),
        mask[:, None, None, :],
        scale,
        gqa,
        soft_cap,
        sinks,
    )
    out.index_copy_(0, q_rows, o[:, :, 0, :].to(query.dtype))
