"""The fused elementwise kernels (RMSNorm, SiLU-and-mul, rotary embedding) against their
plain-torch references: within an ulp of each rounding the reference takes (compiled on an
H200 some products and sums round once where torch rounds twice: 1-ulp differences in a
few values; parity with ``transformers`` is checked by the GPU architecture tests).

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (set before the
kernels are decorated, as in test_kernels.py); with one, compiled on CUDA.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagefleet.kernels import fused_triton  # noqa: E402
from pagefleet.kernels.fused_reference import rms_norm_ref, rope_ref, silu_and_mul_ref  # noqa: E402
from pagefleet.worker.models.rope import rope_tables  # noqa: E402

if not _HAS_CUDA and not isinstance(fused_triton._rms_norm_kernel, InterpretedFunction):
    fused_triton = importlib.reload(fused_triton)

DEVICE = "cuda" if _HAS_CUDA else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cast_ulps(dtype: torch.dtype) -> int:
    """Triton's interpreter casts float32 to bfloat16 by truncation, where compiled kernels (and
    torch) round to nearest: under it each bfloat16 result may be an ulp off per cast it took."""
    return 2 if dtype == torch.bfloat16 and not _HAS_CUDA else 0


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, ulps: int) -> None:
    """``a`` and ``b`` equal, or apart by at most ``ulps`` units in the last place of their dtype."""
    assert a.shape == b.shape and a.dtype == b.dtype
    eps = torch.finfo(a.dtype).eps
    tol = ulps * eps * torch.maximum(a.float().abs(), b.float().abs()) + torch.finfo(a.dtype).tiny
    apart = (a.float() - b.float()).abs()
    assert bool(torch.all(apart <= tol)), f"{int((apart > tol).sum())} values apart, at most {apart.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_reference(dtype, offset):
    g = torch.Generator().manual_seed(0)
    for shape in [(5, 64), (3, 96), (1, 2048), (0, 64)]:
        x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
        w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(DEVICE, dtype)
        # float32 keeps the sum's order in its last bits (2,048 terms); a narrower dtype rounds it away
        ulps = 8 if dtype == torch.float32 else 1 + _cast_ulps(dtype)
        _ulps_apart(fused_triton.rms_norm_triton(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset), ulps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_a_head_view_of_a_fused_projection_in_place(dtype):
    """Qwen3's per-head q/k norm: ``x`` is ``[n, heads, head_dim]`` cut from a wider row."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 6 * 32, generator=g).to(DEVICE, dtype)
    q = qkv[:, : 4 * 32].view(4, 4, 32)
    assert not q.is_contiguous()
    w = torch.rand(32, generator=g).to(DEVICE, dtype) + 0.5
    got = fused_triton.rms_norm_triton(q, w, 1e-6)
    assert got.shape == (4, 4, 32)
    _ulps_apart(got, rms_norm_ref(q, w, 1e-6), 8 if dtype == torch.float32 else 1 + _cast_ulps(dtype))


def test_rms_norm_keeps_a_float32_weight_s_promotion():
    x = torch.randn(3, 64).to(DEVICE, torch.bfloat16)
    w = torch.rand(64).to(DEVICE) + 0.5
    got, want = fused_triton.rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert got.dtype == want.dtype == torch.float32
    _ulps_apart(got, want, 8 + (2**16) * _cast_ulps(torch.bfloat16))  # the normalised row is cast to bf16 first


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    for n, d in [(3, 64), (2, 1500), (0, 8)]:
        gu = (torch.randn(n, 2 * d, generator=g) * 4).to(DEVICE, dtype)
        got, want = fused_triton.silu_and_mul_triton(gu), silu_and_mul_ref(gu)
        if dtype == torch.float32:  # exp's last bits differ between implementations; silu(x) ~ 0 cancels
            torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=1e-5)
        else:
            _ulps_apart(got, want, 1 + _cast_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_matches_the_reference_on_views_of_a_fused_projection(dtype, rotary_fraction):
    """Exact (compiled): the kernel rounds where the reference's separate operations round."""
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, head_dim = 5, 4, 2, 64
    rot = int(head_dim * rotary_fraction)
    cos, sin = rope_tables(10000.0, None, rot, 300, 4096)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 255, 299], device=DEVICE)
    got_q, got_k = fused_triton.rope_triton(positions, q, k, cos, sin)
    want_q, want_k = rope_ref(positions, q, k, cos, sin)
    # Off by the ulps of the two products (a truncated cast in the interpreter, a fused
    # multiply-add on a GPU), not of their sum, which can cancel.
    atol = 2 * max(1, _cast_ulps(dtype)) * torch.finfo(dtype).eps * qkv.float().abs().max().item()
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=atol)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=atol)
    if not _cast_ulps(dtype):
        assert (got_q != want_q).float().mean() < 0.5  # most values the same bits
    assert torch.equal(got_q[0], q[0])  # position 0 turns nothing


def test_the_launchers_name_a_bad_weight_or_table():
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        fused_triton.rms_norm_triton(x, torch.ones(32, device=DEVICE), 1e-6)
    q = torch.randn(2, 2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        fused_triton.rope_triton(torch.zeros(2, dtype=torch.long, device=DEVICE), q, q,
                                 torch.ones(8, 65, device=DEVICE), torch.ones(8, 65, device=DEVICE))
