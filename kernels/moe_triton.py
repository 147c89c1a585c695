"""A fused mixture-of-experts layer in Triton: tokens grouped by expert, one grouped GEMM per
projection, the top-k outputs combined.

Layouts and result are those of ``moe_reference.fused_moe_ref``. The steps:

1. **Group** (``align_by_expert``, torch ops with no host sync, so a CUDA graph can hold
   them): each of the ``num_tokens * top_k`` (token, slot) rows gets an id
   ``token * top_k + slot``; ids are sorted by expert and each expert's run is padded to a
   multiple of ``BLOCK_M`` with the id ``num_tokens * top_k`` (a padding row the kernel skips).
   ``block_expert[b]`` is the expert of the ``b``-th block of ``BLOCK_M`` ids, ``-1`` past the
   last one; the number of blocks is bounded from shapes alone.
2. **Gate/up GEMM**: one program per (block of ids, ``BLOCK_N`` columns) multiplies the
   block's rows of ``hidden`` (row ``id // top_k``) by its expert's ``w13`` (+ ``b13``), into
   ``[num_tokens * top_k, 2 * intermediate]``.
3. ``activation`` (a torch function, as in the reference).
4. **Down GEMM**: the same kernel over ``w2`` (+ ``b2``), each row multiplied by its routing
   weight, into float32 ``[num_tokens * top_k, hidden]``.
5. **Combine**: the ``top_k`` rows of each token summed.

Dots run in fp32 IEEE for fp32 inputs (so the interpreter test can ask for near-exact
equality); bf16 tiles are widened before the dot only under the interpreter (see
``attention_meta``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._jit import jit
from .moe_reference import Activation


@jit(do_not_specialize=["num_rows"])  # a step's tokens x top-k: one binary whatever their number
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_rows,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    ROWS_PER_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last expert's blocks
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < num_rows
    a_rows = ids // ROWS_PER_A
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    w_expert = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_valid = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_expert + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + ids[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_valid[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert)``, int32: row ids grouped by expert, each expert's run
    padded to ``block_m`` (padding id: ``topk_ids.numel()``), and each block's expert (-1: none)."""
    flat = topk_ids.flatten().long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    max_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = (ends - padded)[expert_of] + torch.arange(n, device=device) - first[expert_of]
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def moe_meta(dtype: torch.dtype, *, interpreted: bool = False) -> dict:
    """The compile-time tile parameters of ``_grouped_gemm_kernel`` (both GEMMs)."""
    dot_in_fp32 = dtype == torch.bfloat16 and interpreted
    return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32,
                DOT_PRECISION="ieee" if dtype == torch.float32 or dot_in_fp32 else "tf32",
                DOT_IN_FP32=dot_in_fp32, num_warps=4, num_stages=3)


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``fused_moe_ref``; ValueError on shapes or layouts it cannot take."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    _check(hidden, w13, w2, topk_weights, topk_ids, b13, b2)
    if num_tokens == 0:
        return torch.empty_like(hidden)
    meta = moe_meta(hidden.dtype, interpreted=not isinstance(_grouped_gemm_kernel, triton.runtime.JITFunction))
    block_m = meta["BLOCK_M"]
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_rows = num_tokens * top_k
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    gate_up = torch.empty((num_rows, two_inter), dtype=hidden.dtype, device=hidden.device)
    _gemm(hidden, w13, b13, gate_up, sorted_ids, block_expert, weights, num_rows, top_k, False, meta)
    mid = activation(gate_up).contiguous()
    down = torch.empty((num_rows, hidden_size), dtype=torch.float32, device=hidden.device)
    _gemm(mid, w2, b2, down, sorted_ids, block_expert, weights, num_rows, 1, True, meta)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def _gemm(a, w, bias, out, sorted_ids, block_expert, weights, num_rows, rows_per_a, mul_weight, meta):
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, meta["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, sorted_ids, block_expert, weights,
        num_rows, n, k, a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0), ROWS_PER_A=rows_per_a, HAS_BIAS=bias is not None, MUL_WEIGHT=mul_weight, **meta,
    )


def _check(hidden, w13, w2, topk_weights, topk_ids, b13, b2) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, k13 = w13.shape
    checks = [
        (k13 == hidden_size, f"w13 {list(w13.shape)} must be [experts, 2 * inter, hidden={hidden_size}]"),
        (two_inter % 2 == 0, f"w13 rows {two_inter} must be gate and up rows"),
        (tuple(w2.shape) == (num_experts, hidden_size, two_inter // 2),
         f"w2 {list(w2.shape)} must be [{num_experts}, {hidden_size}, {two_inter // 2}]"),
        (topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens,
         f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must be [num_tokens, top_k]"),
        (hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "inputs must be contiguous rows"),
        (w13.dtype == hidden.dtype and w2.dtype == hidden.dtype, "weights must have hidden's dtype"),
        (b13 is None or tuple(b13.shape) == (num_experts, two_inter), "b13 must be [experts, 2 * inter]"),
        (b2 is None or tuple(b2.shape) == (num_experts, hidden_size), "b2 must be [experts, hidden]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
