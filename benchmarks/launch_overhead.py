"""The kernel launchers' own Python, a call, without the launch: ``python -m pagefleet.benchmarks.launch_overhead``.

An eager step (every step with prompt rows, and every step under ``--enforce-eager``) runs
each launcher once a layer: the attention, the KV write, two RMSNorms, RoPE, SiLU-and-mul.
Here each ``@triton.jit`` kernel is replaced by a no-op, so what is timed is the launcher's
checks, its meta-parameters and its argument lists on CPU tensors of a Llama-3-8B layer at 64
decoding sequences; Triton's own launch (and the GPU) come on top. CPU only, no GPU needed.
"""

from __future__ import annotations

import time

import torch


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(reps: int = 3000) -> dict[str, float]:
    from pagefleet.kernels import fused_triton, triton_ops

    kernels = [(module, name, getattr(module, name)) for module, names in (
        (triton_ops, ("_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel")),
        (fused_triton, ("_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel"))) for name in names]
    for module, name, _ in kernels:
        setattr(module, name, _NoLaunch())
    try:
        return _measure(triton_ops, fused_triton, reps)
    finally:
        for module, name, kernel in kernels:
            setattr(module, name, kernel)


def _measure(triton_ops, fused_triton, reps: int) -> dict[str, float]:
    heads, kv_heads, head_dim, block, n = 32, 8, 128, 16, 64
    bf16, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    query = torch.randn(n, heads, head_dim, **bf16)
    key_cache = torch.zeros(256, block, kv_heads, head_dim, **bf16)
    value_cache = torch.zeros_like(key_cache)
    tables, seq_lens = torch.zeros(n, 8, **i32), torch.full((n,), 100, **i32)
    starts = torch.arange(n + 1, **i32)
    key = torch.randn(n, kv_heads, head_dim, **bf16)
    slots, positions = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    hidden, weight = torch.randn(n, 4096, **bf16), torch.ones(4096, **bf16)
    gate_up = torch.randn(n, 2 * 14336, **bf16)
    cos_sin = torch.randn(4096, head_dim)
    calls = {
        "paged_attention": lambda: triton_ops.paged_attention_triton(query, key_cache, value_cache, tables,
                                                                     seq_lens, starts, 0.088),
        "write_kv": lambda: triton_ops.write_kv_triton(key, key, key_cache, value_cache, slots),
        "rms_norm": lambda: fused_triton.rms_norm_triton(hidden, weight, 1e-5),
        "rope": lambda: fused_triton.rope_triton(positions, query, key, cos_sin, cos_sin),
        "silu_and_mul": lambda: fused_triton.silu_and_mul_triton(gate_up),
    }
    out = {}
    for name, call in calls.items():
        call()
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        out[name] = (time.perf_counter() - t0) / reps * 1e6
        print(f"{name}: {out[name]:.1f} us a call")
    layer = out["paged_attention"] + out["write_kv"] + 2 * out["rms_norm"] + out["rope"] + out["silu_and_mul"]
    print(f"a layer (attention, KV write, 2 RMSNorms, RoPE, SiLU-and-mul): {layer:.1f} us")
    return out


if __name__ == "__main__":
    main()
