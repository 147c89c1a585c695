"""Every Triton kernel variant the launchers can pick builds for sm_80 and sm_90, and fits.

No GPU needed: Triton's bundled ``ptxas`` compiles to cubins here (in a fresh interpreter,
since the CPU tests run the kernels interpreted). The short grid runs in CI;
``PAGEFLEET_SLOW_TESTS=1`` adds more head sizes, GQA ratios and splits on both targets.
"""

from __future__ import annotations

import itertools
import os

import pytest

pytest.importorskip("triton")

from pagefleet.kernels import aot  # noqa: E402

SLOW = os.environ.get("PAGEFLEET_SLOW_TESTS") == "1"
DTYPES = ["bf16", "fp16", "fp32"]
ARCHS = [80, 90]
# (queries per kv head, head_dim): Llama-3-8B is (4, 128); MHA, GQA-8 and head 64 around it.
SHAPES = [(1, 128), (4, 128), (8, 128), (4, 64), (2, 256)] if SLOW else [(4, 128), (8, 64)]
SPLITS = [1, 2, 16] if SLOW else [1, 4]


def _attention_specs() -> list[dict]:
    specs = []
    for arch, dtype, (qpk, head_dim), decode_only, splits in itertools.product(
        ARCHS, DTYPES, SHAPES, (True, False), SPLITS
    ):
        if not SLOW and arch == 80 and dtype != "bf16":
            continue  # the short grid: every dtype on sm_90, bf16 on sm_80
        specs.append(dict(kernel="attention", arch=arch, dtype=dtype, queries_per_kv=qpk, head_dim=head_dim,
                          decode_only=decode_only, num_splits=splits))
        if splits > 1:
            specs.append(dict(kernel="merge", arch=arch, dtype=dtype, head_dim=head_dim, num_splits=splits))
    return specs


SPECS = _attention_specs() + [
    dict(kernel="write_kv", arch=arch, dtype=dtype, num_kv_heads=8, head_dim=128)
    for arch, dtype in itertools.product(ARCHS, DTYPES)
]
# The attention options as the models use them: gpt-oss (8 query heads per kv head, head_dim
# 64, window + sinks), Gemma 2 (2 per kv head, head_dim 256, window + soft-cap); and the
# fused-MoE grouped GEMM (both projections; gpt-oss's with biases).
SPECS += [
    dict(kernel="attention", arch=arch, dtype="bf16", queries_per_kv=qpk, head_dim=head_dim, decode_only=decode_only,
         num_splits=splits, window=True, **{option: True})
    for arch, (qpk, head_dim, option), decode_only, splits in itertools.product(
        ARCHS, [(8, 64, "sinks"), (2, 256, "soft_cap")], (True, False), (1, 4))
] + [
    dict(kernel="moe", arch=arch, dtype=dtype, down=down, bias=bias)
    for arch, dtype, down, bias in itertools.product(ARCHS, ("bf16",), (False, True), (False, True))
]
# Head sizes that are not a power of two (Phi-3's 96, 80): the decode tile stays one.
SPECS += [
    dict(kernel="attention", arch=90, dtype="bf16", queries_per_kv=4, head_dim=head_dim, decode_only=True,
         num_splits=splits)
    for head_dim, splits in itertools.product((80, 96), (1, 4))
]
# A layer's fused elementwise kernels at the widths the models use: norms over 2,048-16,384
# features (and a head of 128, Qwen3's q/k norm), Gemma's offset; SiLU-and-mul over 8,192 and
# 28,672; RoPE over heads of 64-256 features, Phi-3's partial rotation.
SPECS += [
    dict(kernel="rms_norm", arch=arch, dtype="bf16", dim=dim, offset=offset)
    for arch, dim, offset in itertools.product(ARCHS, (128, 2048, 4096, 16384), (False, True))
] + [
    dict(kernel="silu_and_mul", arch=arch, dtype=dtype, d=d)
    for arch, dtype, d in itertools.product(ARCHS, ("bf16", "fp32"), (8192, 28672))
] + [
    dict(kernel="rope", arch=arch, dtype="bf16", head_dim=head_dim, rotary_dim=rot)
    for arch, (head_dim, rot) in itertools.product(ARCHS, ((64, 64), (128, 128), (96, 48), (256, 256)))
]
LLAMA3_8B = [dict(kernel="attention", arch=90, dtype="bf16", queries_per_kv=4, head_dim=128,
                  decode_only=d, num_splits=1) for d in (True, False)]


def _id(spec: dict) -> str:
    shape = "-".join(f"{k}{v}" for k, v in spec.items() if k not in ("kernel", "arch", "dtype"))
    return f"{spec['kernel']}-sm{spec['arch']}-{spec['dtype']}-{shape}"


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    """Every variant, built once in one fresh interpreter."""
    specs = SPECS + LLAMA3_8B
    return {_id(s): r for s, r in zip(specs, aot.build_in_subprocess(specs), strict=True)}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_every_variant_builds_and_fits_its_target(built, spec):
    result = built[_id(spec)]
    assert "error" not in result, result.get("error")
    aot.Built(**result).check()
    if spec["kernel"] in ("merge", "write_kv", "moe", "rms_norm", "silu_and_mul", "rope"):
        assert result["spill_bytes"] == 0, f"{spec['kernel']} spills registers"


@pytest.mark.parametrize("spec", LLAMA3_8B, ids=_id)
def test_llama3_8b_attention_does_not_spill_on_hopper(built, spec):
    """Llama-3-8B's layer (32 query heads over 8 kv heads, head_dim 128) in bf16 on sm_90.
    The decode variant's 64-position tile may spill a little: on an H200 it ran 128.7 µs a
    layer at batch 64 x 2k against 164.5 µs for the 32-position tile that does not
    (docs/results/attention-sweep-h200.json); a spill past 256 B is not that variant any more."""
    result = built[_id(spec)]
    assert "error" not in result, result.get("error")
    allowed = 256 if spec["decode_only"] else 0
    assert result["spill_bytes"] <= allowed, f"{result['registers']} registers, {result['spill_bytes']} B spilled"


def test_check_refuses_what_cannot_launch():
    too_big = aot.Built("k", 80, {"num_warps": 4}, shared_bytes=200_000, registers=64, spill_bytes=0)
    with pytest.raises(AssertionError, match="shared memory"):
        too_big.check()
    too_many = aot.Built("k", 90, {"num_warps": 16}, shared_bytes=0, registers=255, spill_bytes=0)
    with pytest.raises(AssertionError, match="64K registers"):
        too_many.check()


def test_a_broken_variant_is_reported_not_hidden():
    (result,) = aot.build_in_subprocess([dict(kernel="merge", arch=90, dtype="bf16", head_dim=128,
                                              num_splits=3)])
    assert "error" in result  # 3 splits: the merge's tl.arange needs a power of two
