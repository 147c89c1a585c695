"""The fused-MoE Triton kernel against its plain-torch reference (in Triton's interpreter
without a GPU), and the reference against a per-token loop."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagefleet.kernels import moe_triton  # noqa: E402
from pagefleet.kernels.moe_reference import fused_moe_ref  # noqa: E402

if not _HAS_CUDA and not isinstance(moe_triton._grouped_gemm_kernel, InterpretedFunction):
    moe_triton = importlib.reload(moe_triton)

DEVICE = "cuda" if _HAS_CUDA else "cpu"


def silu_gated(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype, bias, seed=0, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert no token picks
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    b13 = torch.randn(num_experts, 2 * inter, generator=g) * 0.1 if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.1 if bias else None
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return dict(hidden=to(x), w13=to(w13), w2=to(w2), topk_weights=weights.to(DEVICE), topk_ids=ids.to(DEVICE),
                activation=silu_gated, b13=to(b13), b2=to(b2))


def test_reference_matches_a_per_token_loop():
    case = make_moe(7, 4, 2, 32, 16, torch.float64, bias=True)
    want = torch.zeros_like(case["hidden"])
    for t in range(7):
        for j in range(2):
            e = int(case["topk_ids"][t, j])
            h = case["w13"][e] @ case["hidden"][t] + case["b13"][e]
            want[t] += case["topk_weights"][t, j].double() * (case["w2"][e] @ silu_gated(h) + case["b2"][e])
    torch.testing.assert_close(fused_moe_ref(**case), want)


def test_alignment_groups_every_row_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    sorted_ids, block_expert = moe_triton.align_by_expert(ids, 5, 4)
    rows = [int(i) for i in sorted_ids if i < ids.numel()]
    assert sorted(rows) == list(range(ids.numel()))
    for b, e in enumerate(block_expert.tolist()):
        block = [int(i) for i in sorted_ids[b * 4:(b + 1) * 4] if i < ids.numel()]
        assert all(int(ids.flatten()[i]) == e for i in block)
        assert e != -1 or not block
    assert 4 not in block_expert.tolist()  # expert 4 has no rows, so no block


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter", "bias"), [
    (1, 4, 2, 64, 32, False),  # one decoding token
    (37, 8, 2, 64, 48, True),  # several blocks per expert, ragged tiles, biases
    (20, 6, 3, 48, 32, False),  # an expert nobody picks
])
def test_kernel_matches_reference_fp32(num_tokens, num_experts, top_k, hidden, inter, bias):
    case = make_moe(num_tokens, num_experts, top_k, hidden, inter, torch.float32, bias,
                    skip_expert=5 if num_experts == 6 else None)
    got = moe_triton.fused_moe_triton(**case)
    torch.testing.assert_close(got.cpu(), fused_moe_ref(**case).cpu(), atol=1e-5, rtol=1e-5)


def test_kernel_matches_reference_bf16():
    case = make_moe(19, 4, 2, 64, 32, torch.bfloat16, bias=True)
    got = moe_triton.fused_moe_triton(**case)
    torch.testing.assert_close(got.cpu().float(), fused_moe_ref(**case).cpu().float(), atol=3e-2, rtol=3e-2)


def test_launcher_rejects_mismatched_weights():
    case = make_moe(3, 4, 2, 32, 16, torch.float32, bias=False)
    case["w2"] = case["w2"][:, :, :8]
    with pytest.raises(ValueError, match="w2"):
        moe_triton.fused_moe_triton(**case)
