"""Triton kernels for a decoder layer's per-token elementwise work: RMSNorm, SiLU-and-mul and
rotary embedding, each one launch where the plain-torch layers take 2 to 14.

On a GPU a decode step of a small batch is made of these more than of anything else: about
36 kernels a layer of ~1-1.5 µs each, where the layer's GEMMs are 4 (H200 profile in
docs/BENCHMARKS.md). Each kernel follows its reference's roundings (``fused_reference``):
every intermediate the reference rounds to the activations' dtype is rounded here too, the
arithmetic between in float32, so the results are those of the reference up to float32
reduction order (RMSNorm's sum) and the device's ``exp``/``rsqrt``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._jit import jit


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def rms_norm_meta(dim: int, offset: bool) -> dict:
    """The compile-time parameters ``rms_norm_triton`` launches with (one row a program)."""
    block = triton.next_power_of_2(dim)
    return dict(DIM=dim, BLOCK=block, HAS_OFFSET=bool(offset), num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def silu_and_mul_meta(d: int) -> dict:
    """The compile-time parameters ``silu_and_mul_triton`` launches with."""
    return dict(D=d, BLOCK=min(1024, triton.next_power_of_2(d)), num_warps=4)


@functools.lru_cache(maxsize=256)  # once per shape: a launch reads it (never changes it)
def rope_meta(head_dim: int, rotary_dim: int) -> dict:
    """The compile-time parameters ``rope_triton`` launches with (one head of one token a program)."""
    return dict(HEAD_DIM=head_dim, ROT=rotary_dim, BLOCK=triton.next_power_of_2(head_dim),
                num_warps=1 if head_dim <= 128 else 2)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows_per_outer, stride_x0, stride_x1, eps, offset,
                     DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_OFFSET: tl.constexpr):
    row = tl.program_id(0)
    outer, inner = row // rows_per_outer, row % rows_per_outer
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    x_in = tl.load(x_ptr + outer.to(tl.int64) * stride_x0 + inner * stride_x1 + cols, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    h = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        y = h * (offset + w)
    else:
        y = w * h.to(x_in.dtype).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * DIM + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``rms_norm_ref`` in one launch. ``x``: 2 or 3 dimensions, its last contiguous (a view
    such as a head of a fused QKV output is read in place)."""
    shape, dim = x.shape, x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, dim).contiguous()
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {list(weight.shape)}")
    out_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out.view(shape)
    rows_per_outer = x.shape[1] if x.dim() == 3 else 1
    stride_x1 = x.stride(1) if x.dim() == 3 else 0
    _rms_norm_kernel[(x.numel() // dim,)](
        x, weight, out, rows_per_outer, x.stride(0), stride_x1, float(eps), float(offset),
        **rms_norm_meta(dim, bool(offset)),
    )
    return out.view(shape)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_row, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g_in = tl.load(gu_ptr + row * stride_row + cols, mask=mask, other=0.0)
    g = g_in.to(tl.float32)
    u = tl.load(gu_ptr + row * stride_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(g_in.dtype).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref`` in one launch; ``gate_up``: ``[n, 2 * d]``, rows contiguous."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        gate_up = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    n, two_d = gate_up.shape
    d = two_d // 2
    out = torch.empty((n, d), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    meta = silu_and_mul_meta(d)
    _silu_and_mul_kernel[(n, triton.cdiv(d, meta["BLOCK"]))](gate_up, out, gate_up.stride(0), **meta)
    return out


@jit(do_not_specialize_on_alignment=["pos_ptr"])  # a view into a step's inputs: see _paged_attention_kernel
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
                 stride_q0, stride_q1, stride_k0, stride_k1, num_q_heads, num_k_heads,
                 HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < num_q_heads
    kh = head - num_q_heads
    if is_q:
        src = q_ptr + token * stride_q0 + head * stride_q1
        dst = q_out_ptr + (token * num_q_heads + head) * HEAD_DIM
    else:
        src = k_ptr + token * stride_k0 + kh * stride_k1
        dst = k_out_ptr + (token * num_k_heads + kh) * HEAD_DIM
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK)
    x_in = tl.load(src + d, mask=d < HEAD_DIM, other=0.0)
    x = x_in.to(tl.float32)
    rot = d < ROT
    first = d < half
    partner = tl.where(first, d + half, d - half)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    rotated_half = tl.where(first, -xp, xp)
    pos = tl.load(pos_ptr + token)
    c = tl.load(cos_ptr + pos * ROT + d, mask=rot, other=0.0).to(x_in.dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * ROT + d, mask=rot, other=0.0).to(x_in.dtype).to(tl.float32)
    a = (x * c).to(x_in.dtype).to(tl.float32)
    b = (rotated_half * s).to(x_in.dtype).to(tl.float32)
    y = tl.where(rot, (a + b).to(x_in.dtype), x_in)
    tl.store(dst + d, y, mask=d < HEAD_DIM)


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_ref`` in one launch for ``q`` and ``k`` together (views of a fused QKV output are
    read in place; the results are new contiguous tensors)."""
    n, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot = cos.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if not (cos.is_contiguous() and sin.is_contiguous()) or rot % 2 or rot > head_dim:
        raise ValueError(f"cos/sin must be contiguous [positions, rotary_dim <= {head_dim}, even], "
                         f"got {list(cos.shape)}")
    q_out = torch.empty((n, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    _rope_kernel[(n, num_q_heads + num_k_heads)](
        q, k, q_out, k_out, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q_heads, num_k_heads, **rope_meta(head_dim, rot),
    )
    return q_out, k_out
