"""Every Triton kernel variant the launchers can pick builds for sm_80 and sm_90, and fits.

No GPU needed: Triton's bundled ``ptxas`` compiles to cubins here. The short grid runs in
CI; ``PAGEFLEET_SLOW_TESTS=1`` adds every head size and GQA ratio on both targets.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import aot  # noqa: E402
from pagefleet.kernels.triton_ops import attention_meta, merge_meta, write_kv_meta  # noqa: E402

SLOW = os.environ.get("PAGEFLEET_SLOW_TESTS") == "1"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ARCHS = [80, 90]
# (queries per kv head, head_dim): Llama-3-8B is (4, 128); MHA, GQA-8 and head 64 around it.
SHAPES = [(1, 128), (4, 128), (8, 128), (4, 64), (2, 256)] if SLOW else [(4, 128), (8, 64)]
SPLITS = [1, 2, 16] if SLOW else [1, 4]


def _variants():
    for arch, dtype, (qpk, head_dim), decode_only, splits in itertools.product(
        ARCHS, DTYPES, SHAPES, (True, False), SPLITS
    ):
        if not SLOW and arch == 80 and dtype != torch.bfloat16:
            continue  # the short grid: every dtype on sm_90, bf16 on sm_80
        yield arch, dtype, qpk, head_dim, decode_only, splits


def _id(v) -> str:
    arch, dtype, qpk, head_dim, decode_only, splits = v
    return f"sm{arch}-{str(dtype).removeprefix('torch.')}-gqa{qpk}-d{head_dim}-" \
           f"{'decode' if decode_only else 'prefill'}-split{splits}"


VARIANTS = list(_variants())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_paged_attention_builds_and_fits(variant):
    arch, dtype, qpk, head_dim, decode_only, splits = variant
    meta = attention_meta(qpk, head_dim, 16, dtype, decode_only, splits)
    built = aot.build("_paged_attention_kernel", arch, meta, aot.attention_pointer_types(dtype))
    built.check()
    if splits > 1:
        merge = aot.build("_merge_splits_kernel", arch, {**merge_meta(head_dim, splits), "num_warps": 4},
                          aot.merge_pointer_types(dtype))
        merge.check()
        assert merge.spill_bytes == 0, "the merge kernel spills registers"


@pytest.mark.parametrize("decode_only", [True, False])
def test_llama3_8b_attention_does_not_spill_on_hopper(decode_only):
    """Llama-3-8B's layer (32 query heads over 8 kv heads, head_dim 128) in bf16 on sm_90."""
    meta = attention_meta(4, 128, 16, torch.bfloat16, decode_only, 1)
    built = aot.build("_paged_attention_kernel", 90, meta, aot.attention_pointer_types(torch.bfloat16))
    assert built.spill_bytes == 0, f"{built.registers} registers, {built.spill_bytes} B spilled"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_builds_and_fits(arch, dtype):
    built = aot.build("_write_kv_kernel", arch, {**write_kv_meta(8, 128, 16), "num_warps": 4},
                      aot.write_kv_pointer_types(dtype))
    built.check()
    assert built.spill_bytes == 0 and built.shared_bytes == 0


def test_check_refuses_what_cannot_launch():
    too_big = aot.Built("k", 80, {"num_warps": 4}, shared_bytes=200_000, registers=64, spill_bytes=0)
    with pytest.raises(AssertionError, match="shared memory"):
        too_big.check()
    too_many = aot.Built("k", 90, {"num_warps": 16}, shared_bytes=0, registers=255, spill_bytes=0)
    with pytest.raises(AssertionError, match="64K registers"):
        too_many.check()
