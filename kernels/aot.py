"""Ahead-of-time builds of the Triton kernels for a GPU that is not here.

Triton ships ``ptxas``, so every variant the launchers can pick compiles to a cubin on a
machine without a GPU (``triton.compile`` with a ``GPUTarget``). ``build`` compiles one
variant and reads its resource use back from the cubin (``cuobjdump``), so a test can
check that it fits the target: a kernel that would fail to build or launch on a GPU then
fails on CPU. The meta-parameters come from the launchers' own functions
(``attention_meta``, ``merge_meta``, ``write_kv_meta``). Integer arguments are compiled
as plain 64-bit values (the JIT may also specialize small or aligned ones).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import fused_triton, moe_triton, triton_ops

# Most shared memory one block may use (opt-in), by compute capability.
MAX_SHARED_BYTES = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
MAX_REGISTERS_PER_THREAD = 255
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass(frozen=True, slots=True)
class Built:
    """One compiled variant and what it uses per block / per thread."""

    kernel: str
    arch: int
    meta: dict
    shared_bytes: int
    registers: int
    spill_bytes: int  # stack frame: registers spilled to local memory

    def check(self) -> None:
        """Raise ``AssertionError`` if the variant cannot launch on its target."""
        limit = MAX_SHARED_BYTES[self.arch]
        if self.shared_bytes > limit:
            raise AssertionError(f"{self.kernel} {self.meta}: {self.shared_bytes} B of shared memory "
                                 f"> {limit} B on sm_{self.arch}")
        if self.registers > MAX_REGISTERS_PER_THREAD:
            raise AssertionError(f"{self.kernel} {self.meta}: {self.registers} registers per thread")
        threads = 32 * self.meta.get("num_warps", 4)
        if self.registers * threads > 65_536:
            raise AssertionError(f"{self.kernel} {self.meta}: {self.registers} x {threads} threads "
                                 "exceeds the 64K registers of an SM")


def build(kernel: str, arch: int, meta: dict, pointer_types: dict[str, str], module=triton_ops) -> Built:
    """Compile ``<module>.<kernel>`` (``triton_ops`` by default) for ``sm_<arch>`` with ``meta`` (constexprs plus
    ``num_warps``/``num_stages``); ``pointer_types`` gives each pointer argument's Triton
    type (``"*bf16"``...), every other non-constexpr argument is ``i64`` unless named in it."""
    fn = getattr(module, kernel)
    consts = {k: v for k, v in meta.items() if k not in _LAUNCH_OPTIONS}
    options = {k: v for k, v in meta.items() if k in _LAUNCH_OPTIONS}
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        signature[name] = "constexpr" if name in consts else pointer_types.get(name, "i64")
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options=options)
    registers, spill = _resource_usage(compiled.asm["cubin"])
    return Built(kernel, arch, meta, int(compiled.metadata.shared), registers, spill)


def attention_pointer_types(dtype: torch.dtype) -> dict[str, str]:
    t = "*" + _TRITON_TYPES[dtype]
    return {"out_ptr": t, "query_ptr": t, "key_cache_ptr": t, "value_cache_ptr": t,
            "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "sinks_ptr": "*fp32", "scale_log2": "fp32",
            "soft_cap": "fp32", "window": "i32", "num_seqs": "i32"}


def merge_pointer_types(dtype: torch.dtype) -> dict[str, str]:
    return {"out_ptr": "*" + _TRITON_TYPES[dtype], "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def write_kv_pointer_types(dtype: torch.dtype) -> dict[str, str]:
    t = "*" + _TRITON_TYPES[dtype]
    return {"key_ptr": t, "value_ptr": t, "key_cache_ptr": t, "value_cache_ptr": t,
            "slot_mapping_ptr": "*i64"}


def moe_pointer_types(dtype: torch.dtype, down: bool) -> dict[str, str]:
    """The grouped GEMM's pointers: the gate/up GEMM writes ``dtype``, the down GEMM float32."""
    t = "*" + _TRITON_TYPES[dtype]
    return {"a_ptr": t, "w_ptr": t, "bias_ptr": t, "out_ptr": "*fp32" if down else t, "sorted_ids_ptr": "*i32",
            "block_expert_ptr": "*i32", "weights_ptr": "*fp32", "num_rows": "i32", "N": "i32", "K": "i32"}


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes) of the cubin's one function."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    if regs is None or stack is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out!r}")
    return int(regs.group(1)), int(stack.group(1))


# -- in a process of its own --------------------------------------------------------------------
# Triton decides at import whether kernels are compiled or interpreted (TRITON_INTERPRET), so a
# process that interprets them (the CPU tests) builds cubins through a fresh interpreter.
_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_spec(spec: dict) -> Built:
    """Build one variant described in plain data: ``kernel`` (``attention`` | ``merge`` |
    ``write_kv`` | ``moe`` | ``rms_norm`` | ``silu_and_mul`` | ``rope``), ``arch``, ``dtype``
    (``bf16`` | ``fp16`` | ``fp32``) and the shape fields its meta function takes (``moe``:
    ``down``, the second GEMM, with its routing weights)."""
    dtype = _DTYPE_NAMES[spec["dtype"]]
    kind = spec["kernel"]
    if kind == "attention":
        meta = triton_ops.attention_meta(spec["queries_per_kv"], spec["head_dim"], spec.get("block_size", 16),
                                         dtype, spec["decode_only"], spec["num_splits"],
                                         window=spec.get("window", False), soft_cap=spec.get("soft_cap", False),
                                         sinks=spec.get("sinks", False))
        return build("_paged_attention_kernel", spec["arch"], meta, attention_pointer_types(dtype))
    if kind == "merge":
        meta = {**triton_ops.merge_meta(spec["head_dim"], spec["num_splits"]), "num_warps": 4}
        return build("_merge_splits_kernel", spec["arch"], meta, merge_pointer_types(dtype))
    if kind == "write_kv":
        meta = {**triton_ops.write_kv_meta(spec["num_kv_heads"], spec["head_dim"], spec.get("block_size", 16)),
                "num_warps": 4}
        return build("_write_kv_kernel", spec["arch"], meta, write_kv_pointer_types(dtype))
    if kind == "moe":
        down = spec["down"]
        meta = {**moe_triton.moe_meta(dtype), "ROWS_PER_A": 1 if down else spec.get("top_k", 2),
                "HAS_BIAS": spec.get("bias", False), "MUL_WEIGHT": down}
        return build("_grouped_gemm_kernel", spec["arch"], meta, moe_pointer_types(dtype, down), moe_triton)
    t = "*" + spec["dtype"]
    if kind == "rms_norm":
        meta = fused_triton.rms_norm_meta(spec["dim"], spec.get("offset", False))
        types = {"x_ptr": t, "w_ptr": t, "out_ptr": t, "rows_per_outer": "i32", "eps": "fp32", "offset": "fp32"}
        return build("_rms_norm_kernel", spec["arch"], meta, types, fused_triton)
    if kind == "silu_and_mul":
        return build("_silu_and_mul_kernel", spec["arch"], fused_triton.silu_and_mul_meta(spec["d"]),
                     {"gu_ptr": t, "out_ptr": t}, fused_triton)
    if kind == "rope":
        types = {"q_ptr": t, "k_ptr": t, "q_out_ptr": t, "k_out_ptr": t, "pos_ptr": "*i64", "cos_ptr": "*fp32",
                 "sin_ptr": "*fp32", "num_q_heads": "i32", "num_k_heads": "i32"}
        meta = fused_triton.rope_meta(spec["head_dim"], spec.get("rotary_dim", spec["head_dim"]))
        return build("_rope_kernel", spec["arch"], meta, types, fused_triton)
    raise ValueError(f"kernel must be attention, merge, write_kv, moe, rms_norm, silu_and_mul or rope; got {kind!r}")


def build_in_subprocess(specs: list[dict], timeout_s: float = 1200) -> list[dict]:
    """``build_spec`` for each of ``specs`` in a fresh interpreter (compiled, never interpreted);
    one dict per spec: the ``Built`` fields, or ``error``."""
    import json
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pagefleet.kernels.aot"], input=json.dumps(specs),
                         capture_output=True, text=True, env=env, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"ahead-of-time build failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def main() -> int:
    """Read a JSON list of specs on stdin, write a JSON list of results on stdout."""
    import json
    import sys
    from dataclasses import asdict

    results = []
    for spec in json.loads(sys.stdin.read()):
        try:
            results.append(asdict(build_spec(spec)))
        except Exception as e:  # reported per variant: one broken kernel must not hide the others
            results.append({"error": f"{type(e).__name__}: {e}"})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
