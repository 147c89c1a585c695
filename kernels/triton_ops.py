"""Triton kernels for the paged KV cache: ``write_kv`` and a unified ``paged_attention``.

Layouts are those of ``reference.py`` (the plain-torch ground truth).

**write_kv**: one program per token copies that token's ``[num_kv_heads, head_dim]`` K
and V rows to ``slot = block_id * block_size + offset``; a slot of ``-1`` (padding)
makes the program return without writing.

**paged_attention**: one launch serves decode rows (one query token) and chunked
prefill rows (many query tokens that see a cached prefix and, causally, each other).

* Grid ``(num_q_tiles, num_kv_heads, num_splits)``. A *query tile* is ``BLOCK_Q``
  consecutive query tokens of one sequence, and the program handles **all**
  ``num_heads // num_kv_heads`` query heads that share its kv head, so a tile's
  ``BLOCK_M = BLOCK_Q * queries_per_kv`` rows read each K/V tile once (GQA costs no
  extra memory traffic). Decode rows are tiles of one token.
* The launch needs no host sync (and can be captured in a CUDA graph): the number of
  query tiles is bounded from shapes alone by ``num_tokens // BLOCK_Q + num_seqs``,
  and each program finds its sequence by binary search over
  ``query_start_loc[i] // BLOCK_Q + i`` (strictly increasing in ``i``); programs past
  the end of their sequence's queries exit at once.
* The program walks its context in tiles of ``TILE_N`` key positions, looking each
  position's block up in the block table (so ``TILE_N`` is independent of
  ``block_size`` and ``tl.dot`` always gets at least 16 columns), with an online
  softmax in fp32 (``exp2``, the scale folded into ``log2 e``). Keys past the tile's
  last query position are never loaded; the causal mask is
  ``key_pos <= seq_len - q_len + q_index``.
* **Split-KV (flash-decoding)**: with few sequences the grid above has too few
  programs to fill a GPU (batch 1 of a model with 8 kv heads is 8 programs). The
  launcher then splits each context into ``num_splits`` ranges, each program writes
  its partial output and log-sum-exp to fp32 scratch, and a small second kernel
  merges them. ``num_splits`` is a power of two chosen from shapes and the SM count
  (1 when the plain grid already has ~2 programs per SM).
* **Options as compile-time switches** (``USE_WINDOW``, ``USE_SOFTCAP``, ``USE_SINKS``; off,
  the kernel compiles exactly as without them): a sliding ``window`` masks keys at or before
  ``q_pos - window`` and starts each tile's walk at its first query's first visible key
  (split-KV divides only what is left); ``soft_cap`` maps each logit to
  ``soft_cap * tanh(logit / soft_cap)``; ``sinks`` (one float32 logit per query head) join
  each row's softmax denominator once (split 0 adds them under split-KV, the merge weighs
  them in with that split's log-sum-exp).
* Cache addressing is int64 throughout (``block_id * block_stride`` overflows int32
  once a pool passes 2**31 elements); K/V dtype is the query dtype; fp32 inputs use
  IEEE (not TF32) dots so fp32 stays exact enough to compare with the reference.

Decode tiles and splits were chosen by a sweep on an H200 (``docs/BENCHMARKS.md``); prefill
tiles and warp counts are defaults, not yet tuned.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from ._jit import jit

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# Set only by ``forced_splits``: the split count every launch takes instead of its own choice.
_forced_splits: int | None = None


def split_choices() -> list[int]:
    """Every number of splits the launcher can pick (1, 2, 4, ... 16)."""
    return [1 << i for i in range(_MAX_SPLITS.bit_length())]


@contextlib.contextmanager
def forced_splits(num_splits: int):
    """Within: every ``paged_attention_triton`` launch that leaves ``num_splits`` to the launcher
    splits into ``num_splits`` ranges. For compiling each variant at start (a worker's warm-up),
    not for serving."""
    global _forced_splits
    previous, _forced_splits = _forced_splits, num_splits
    try:
        yield
    finally:
        _forced_splits = previous


# ---------------------------------------------------------------------------- write_kv


@jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a view into a step's inputs
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding row
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = key_cache_ptr + block_id * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = value_cache_ptr + block_id * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place.

    Raises ValueError on a shape, dtype, device or stride the kernel does not support.
    """
    _check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        **write_kv_meta(num_kv_heads, head_dim, key_cache.shape[1]),
    )


def _check_write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    _require(key.dim() == 3, lambda: f"key must be [num_tokens, num_kv_heads, head_dim], got {_shape(key)}")
    _require(value.shape == key.shape, lambda: f"value {_shape(value)} must match key {_shape(key)}")
    _check_caches(key_cache, value_cache)
    _require(
        key_cache.shape[2:] == key.shape[1:],
        lambda: f"cache rows [num_kv_heads, head_dim] = {list(key_cache.shape[2:])} "
        f"do not match key rows {list(key.shape[1:])}",
    )
    _require(
        slot_mapping.shape == (key.shape[0],),
        lambda: f"slot_mapping must be [num_tokens={key.shape[0]}], got {_shape(slot_mapping)}",
    )
    _require(
        slot_mapping.dtype == torch.int64, lambda: f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    _require(
        key.dtype in _DTYPES and value.dtype in _DTYPES, lambda: f"unsupported key/value dtype {key.dtype}"
    )
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim, got {t.stride()}")
    _require(slot_mapping.stride(0) == 1 or key.shape[0] <= 1, "slot_mapping must be contiguous")
    _check_device(
        key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping
    )


# ---------------------------------------------------------------------------- attention


@triton.jit
def _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= tile_idx``."""
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Arguments that change from step to step are not specialized on: each value class Triton
# specializes an argument on (an integer equal to 1 or a multiple of 16, a pointer aligned to
# 16 bytes) is a binary of its own, compiled the first time a step has it (1-2 s on an H200's
# host). ``seq_lens``, ``query_start_loc`` and the block tables are views into a step's packed
# inputs, at offsets that move with the batch; each is read a scalar at a time, so nothing is
# lost (tests/test_kernel_variants.py).
@jit(do_not_specialize=["window", "num_seqs", "stride_bt"],
     do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"])
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    scale_log2,
    soft_cap,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_idx - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # cached tokens before this step's queries

    # Row r of the tile is query token r // QPK_PAD with head kv_head * QUERIES_PER_KV + r % QPK_PAD.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    row_valid = (q_idx < q_len) & (head_in_group < QUERIES_PER_KV)
    token = (q_start + q_idx).to(tl.int64)
    head = (kv_head * QUERIES_PER_KV + head_in_group).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM

    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = prefix_len + q_idx  # absolute position; the row sees keys 0..q_pos

    # One past the last key any row of this tile may see.
    kv_end = tl.minimum(seq_len, prefix_len + tl.minimum((local_tile + 1) * BLOCK_Q, q_len))
    if USE_WINDOW:  # the first key the tile's first query sees
        kv_start = tl.maximum(prefix_len + local_tile * BLOCK_Q - window + 1, 0)
    else:
        kv_start = 0
    if NUM_SPLITS == 1:
        kv_lo = kv_start
        kv_hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = kv_start + split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = key_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = value_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_valid = pos < kv_hi
        # int64 before the multiply: block_id * stride_kb overflows int32 in large pools.
        block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            k_head + block_id[None, :] * stride_kb + offset[None, :] * stride_ks + d[:, None],
            mask=pos_valid[None, :] & d_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if USE_SOFTCAP:  # cap * tanh(logit / cap), in the log2 domain; tanh(x) = 1 - 2 / (e^2x + 1)
            x = s / (soft_cap * 1.4426950408889634)
            s = (soft_cap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + block_id[:, None] * stride_vb + offset[:, None] * stride_vs + d[None, :],
            mask=pos_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if USE_SINKS:  # a key with no value: only the denominator grows
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * 1.4426950408889634
        if NUM_SPLITS > 1:
            sink = tl.where(split == 0, sink, float("-inf"))
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = split.to(tl.int64) * stride_ps + token * stride_pt + head * stride_ph
        tl.store(part_out_ptr + part[:, None] + d[None, :], o, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 domain
        # part_lse is part_out without its last dim: its offsets are part_out's / stride_ph.
        tl.store(part_lse_ptr + part // stride_ph, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, NUM_SPLITS).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = s * stride_ps + token * stride_pt + head * stride_ph
    lse = tl.load(part_lse_ptr + base // stride_ph)
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # empty splits weigh 0
    o = tl.load(part_out_ptr + base[:, None] + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0)
    total = tl.sum(w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    merged = tl.sum(o * w[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def paged_attention_triton(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context.

    Same contract as ``paged_attention_ref`` (options included); returns ``[num_tokens, num_heads, head_dim]``
    in ``query``'s dtype. ``num_splits`` (a power of two, at most 16) forces the split-KV
    path; by default it is chosen from the shapes and the device's SM count. Rows past
    ``query_start_loc[-1]`` (padding) are left unwritten. Raises ValueError on a shape,
    dtype, device or stride the kernel does not support.
    """
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out

    decode_only = num_tokens == num_seqs  # every sequence has exactly one query row
    block_q = attention_meta(num_heads // num_kv_heads, head_dim, key_cache.shape[1], query.dtype,
                             decode_only, 1)["BLOCK_Q"]
    num_q_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = _forced_splits or _default_num_splits(query.device, num_q_tiles * num_kv_heads)
    _require(
        1 <= num_splits <= _MAX_SPLITS and num_splits & (num_splits - 1) == 0,
        lambda: f"num_splits must be a power of two in [1, {_MAX_SPLITS}], got {num_splits}",
    )
    meta = attention_meta(num_heads // num_kv_heads, head_dim, key_cache.shape[1], query.dtype,
                          decode_only, num_splits, interpreted=_interpreted(),
                          window=window is not None, soft_cap=soft_cap is not None, sinks=sinks is not None)
    if sinks is not None:
        _require(sinks.shape == (num_heads,) and sinks.dtype == torch.float32 and sinks.device == query.device,
                 lambda: f"sinks must be float32 [num_heads={num_heads}] on {query.device}, got {sinks.dtype} {_shape(sinks)}")
    _require(window is None or window >= 1, lambda: f"window must be at least 1, got {window}")

    if num_splits > 1:
        part_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel
    part_strides = part_out.stride()[:3] if num_splits > 1 else (0, 0, 1)

    _paged_attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        out,
        part_out,
        part_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else query,  # unused unless USE_SINKS
        float(scale) * _LOG2E,
        float(soft_cap or 1.0),
        int(window or 0),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_tables.stride(0),
        *part_strides,
        **meta,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            *part_strides,
            **merge_meta(head_dim, num_splits),
        )
    return out


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def attention_meta(queries_per_kv: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   decode_only: bool, num_splits: int, *, interpreted: bool = False, window: bool = False,
                   soft_cap: bool = False, sinks: bool = False) -> dict:
    """The compile-time parameters (and warps/stages) ``paged_attention_triton`` launches
    ``_paged_attention_kernel`` with: one function, so ahead-of-time builds compile exactly
    the variants the launcher can pick. ``window``, ``soft_cap``, ``sinks``: which
    attention options the variant has."""
    qpk_pad = triton.next_power_of_2(queries_per_kv)
    block_m = max(16 if decode_only else 64, qpk_pad)
    # Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; there (tests
    # only) bf16 tiles are widened to fp32 before each dot. Compiled kernels never do this.
    dot_in_fp32 = dtype == torch.bfloat16 and interpreted
    return dict(
        QUERIES_PER_KV=queries_per_kv,
        QPK_PAD=qpk_pad,
        BLOCK_Q=block_m // qpk_pad,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        # Decode reads up to 16 KiB of K (and of V) a tile at 16-bit, in a power of two of positions:
        # 128 of head_dim 64, 64 of 96 or 128 (an H200 sweep, docs/results/attention-sweep-h200.json:
        # 1.3-1.6x over 32 at batch 16-64).
        TILE_N=min(128, max(32, 1 << (8192 // max(head_dim, 1)).bit_length() - 1)) if decode_only else 64,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        USE_WINDOW=window,
        USE_SOFTCAP=soft_cap,
        USE_SINKS=sinks,
        # A 64-row prefill tile of head_dim >= 128 keeps a [64, head_dim] fp32 accumulator: at 4
        # warps it spills registers (ptxas, sm_80 and sm_90: tests/test_kernels_aot.py), at 8 not.
        num_warps=8 if not decode_only and head_dim >= 128 else 4,
        num_stages=2 if decode_only else 3,
    )


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def merge_meta(head_dim: int, num_splits: int) -> dict:
    """The compile-time parameters of ``_merge_splits_kernel``."""
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits)


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def write_kv_meta(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """The compile-time parameters of ``_write_kv_kernel``."""
    return dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )


def _interpreted() -> bool:
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def _default_num_splits(device: torch.device, num_programs: int) -> int:
    """Split the context only when the plain grid has fewer than ~2 programs per SM, and then
    into enough ranges for ~4 (measured on an H200: batch 16 x 2k, head_dim 128, 54 -> 42 µs)."""
    if device.type != "cuda":
        return 1
    return splits_for(torch.cuda.get_device_properties(device).multi_processor_count, num_programs)


def splits_for(sms: int, num_programs: int) -> int:
    """``_default_num_splits`` on a GPU of ``sms`` multiprocessors."""
    if num_programs >= 2 * sms:
        return 1
    want = math.ceil(4 * sms / max(num_programs, 1))
    return min(_MAX_SPLITS, triton.next_power_of_2(want))


def _check_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
) -> None:
    _require(
        query.dim() == 3, lambda: f"query must be [num_tokens, num_heads, head_dim], got {_shape(query)}"
    )
    _check_caches(key_cache, value_cache)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    _require(
        key_cache.shape[3] == head_dim,
        lambda: f"cache head_dim {key_cache.shape[3]} does not match query head_dim {head_dim}",
    )
    _require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        lambda: f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}",
    )
    _require(query.dtype in _DTYPES, lambda: f"query dtype must be one of {_DTYPES}, got {query.dtype}")
    _require(
        key_cache.dtype == query.dtype,
        lambda: f"cache dtype {key_cache.dtype} must equal query dtype {query.dtype}",
    )
    _require(
        query.stride(-1) == 1, lambda: f"query must have unit stride along head_dim, got {query.stride()}"
    )
    _require(seq_lens.dim() == 1, lambda: f"seq_lens must be [num_seqs], got {_shape(seq_lens)}")
    num_seqs = seq_lens.shape[0]
    _require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        lambda: f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got {_shape(block_tables)}",
    )
    _require(
        query_start_loc.shape == (num_seqs + 1,),
        lambda: f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {_shape(query_start_loc)}",
    )
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.numel() > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    _check_device(
        query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require(
        key_cache.dim() == 4,
        lambda: f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {_shape(key_cache)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        lambda: f"value_cache {_shape(value_cache)} must match key_cache {_shape(key_cache)}",
    )
    _require(value_cache.dtype == key_cache.dtype, "key_cache and value_cache dtypes differ")
    _require(
        key_cache.dtype in _DTYPES, lambda: f"cache dtype must be one of {_DTYPES}, got {key_cache.dtype}"
    )
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim, got {t.stride()}")


def _check_device(first: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, expected {first.device}")


def _require(ok: bool, message) -> None:
    """``ValueError(message())`` unless ``ok``: the message (shapes, strides, dtypes formatted)
    is built only for a call that fails; a launch pays for the checks, not for their words."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)
