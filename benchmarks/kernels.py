"""``pagefleet bench kernels``: paged attention against the memory roofline and a baseline.

On a CUDA GPU (Triton kernels):

* decode attention, one Llama-3-8B-shaped layer (32 q heads, 8 kv heads, head_dim 128,
  bf16, block_size 16, blocks scattered in the pool) at batch 1/16/64/256 and context
  512/2k/8k: achieved HBM bandwidth (K/V + Q + out bytes / time) against the device's
  peak, and beside it torch SDPA over a gathered contiguous copy of the cache (gather
  included, as a paged engine without a paged kernel would have to do);
* prefill chunks of 512/2048 tokens after an equal cached prefix: achieved TFLOP/s;
* one decode step of a Llama-3.2-1B-shaped model with random bf16 weights (CUDA graph
  when capture works): step time against (weights + KV bytes) / peak bandwidth.

Without a GPU the same cases run at smaller sizes on the CPU path (the plain-torch
references, fp32) and the GPU figures are reported as not measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagefleet.kernels import paged_attention, write_kv

from .results import header

# Peak HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s) by device name;
# the first entry whose words all appear in the name wins. Unknown devices fall back to a
# measured device-to-device copy (bandwidth) and report no FLOP/s peak.
_DEVICE_PEAKS: list[tuple[tuple[str, ...], float, float | None]] = [
    (("H200",), 4.8e12, 989e12),
    (("GH200",), 4.0e12, 989e12),
    (("H100", "NVL"), 3.9e12, 835e12),
    (("H100", "PCIe"), 2.0e12, 756e12),
    (("H100",), 3.35e12, 989e12),  # SXM, "NVIDIA H100 80GB HBM3"
    (("A100", "80GB", "PCIe"), 1.935e12, 312e12),
    (("A100", "80GB"), 2.039e12, 312e12),
    (("A100",), 1.555e12, 312e12),
    (("L40S",), 0.864e12, 362e12),
    (("A10G",), 0.6e12, 70e12),
    (("L4",), 0.3e12, 121e12),
]


@dataclass(frozen=True, slots=True)
class LayerShape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Llama-3.2-1B: tied embeddings, GQA 32/8, head_dim 64."""

    num_layers: int = 16
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 128256
    block_size: int = 16

    @property
    def num_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + self.vocab_size * h + h


Timer = Callable[[Callable[[], object]], float]  # seconds per call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagefleet bench kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--json", default="bench-results/kernels.json", help="where to write results"
    )
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    args = parser.parse_args(argv)

    result: dict = header("kernels", "pagefleet bench kernels" + (" --quick" if args.quick else ""), **torch_machine())
    if torch.cuda.is_available():
        result["gpu"] = _gpu_suite(args.quick)
    else:
        print("No CUDA GPU: running the CPU path only; GPU figures are not measured.")
        result["cpu"] = _cpu_suite(args.quick)
        result["gpu"] = {"measured": False, "reason": "no CUDA GPU was available"}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- cases


def make_decode_case(batch, context, shape: LayerShape, dtype, device, *, query_len=1, seed=0):
    """A step where each of ``batch`` sequences has ``context`` tokens cached (this step's
    ``query_len`` included), its blocks scattered through the pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = math.ceil(context / shape.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    num_tokens = batch * query_len
    return dict(
        query=torch.randn(
            num_tokens, shape.num_heads, shape.head_dim, generator=gen, device=device, dtype=dtype
        ),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(
            0, num_tokens + 1, query_len, dtype=torch.int32, device=device
        ),
        scale=shape.head_dim**-0.5,
    )


def decode_bytes(batch, context, shape: LayerShape, elem: int) -> int:
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_dim
    q_and_out = 2 * batch * shape.num_heads * shape.head_dim
    return (kv + q_and_out) * elem


def prefill_flops(batch, chunk, prefix, shape: LayerShape) -> int:
    """QK^T and PV over the causally visible keys: row r sees prefix + r + 1 keys."""
    visible = chunk * prefix + chunk * (chunk + 1) // 2
    return 4 * batch * shape.num_heads * shape.head_dim * visible


def gathered_sdpa(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Baseline for uniform decode batches: copy each sequence's blocks out, then dense SDPA."""
    batch = block_tables.shape[0]
    k = key_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # [B, kv, L, d]
    v = value_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    q = query.view(batch, 1, *query.shape[1:]).transpose(1, 2)  # [B, h, 1, d]
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(query.shape)


# ---------------------------------------------------------------------------- suites


def _cpu_suite(quick: bool) -> dict:
    shape, dtype = LayerShape(), torch.float32
    timer = _wall_timer(repeat=2 if quick else 3)
    decode = []
    for batch in (1, 4) if quick else (1, 16):
        for context in (512,) if quick else (512, 2048):
            case = make_decode_case(batch, context, shape, dtype, "cpu")
            seconds = timer(lambda case=case: paged_attention(**case))
            moved = decode_bytes(batch, context, shape, 4)
            decode.append(_row(batch=batch, context=context, seconds=seconds, bytes=moved))
    prefill = []
    for chunk in (128,) if quick else (128, 512):
        case = make_decode_case(1, 2 * chunk, shape, dtype, "cpu", query_len=chunk)
        seconds = timer(lambda case=case: paged_attention(**case))
        flops = prefill_flops(1, chunk, chunk, shape)
        prefill.append(_row(chunk=chunk, prefix=chunk, seconds=seconds, flops=flops))
    model = ModelShape(num_layers=2, vocab_size=8192) if quick else ModelShape()
    e2e = [_e2e_step(model, batch=4, context=512, dtype=torch.bfloat16, device="cpu", timer=timer)]
    peak = _measured_copy_bandwidth("cpu")
    for row in e2e:
        row["roofline_seconds"] = row["bytes"] / peak
    _print_table("CPU reference decode (Llama-3-8B layer, fp32)", decode)
    _print_table("CPU reference prefill chunk", prefill)
    _print_table("CPU decode step (Llama-3.2-1B shape, bf16; roofline from a measured copy)", e2e)
    return {
        "dtype": "float32 (attention), bfloat16 (model step)",
        "copy_bandwidth_bytes_per_s": peak,
        "decode": decode,
        "prefill": prefill,
        "e2e": e2e,
    }


def _gpu_suite(quick: bool) -> dict:
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak_bw, peak_flops, source = device_peaks(name)
    shape, dtype = LayerShape(), torch.bfloat16
    timer = _cuda_timer
    copy_bw = _measured_copy_bandwidth("cuda")
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s read + written "
          f"({copy_bw / peak_bw:.1%} of the {peak_bw / 1e12:.2f} TB/s peak)")
    decode = []
    for batch in (1, 64) if quick else (1, 16, 64, 256):
        for context in (2048,) if quick else (512, 2048, 8192):
            case = make_decode_case(batch, context, shape, dtype, device)
            moved = decode_bytes(batch, context, shape, 2)
            ours = timer(lambda case=case: paged_attention(**case))
            base = _try_oom(lambda case=case: timer(lambda: gathered_sdpa(**case)))
            decode.append(
                _row(
                    batch=batch,
                    context=context,
                    seconds=ours,
                    bytes=moved,
                    peak_fraction=moved / ours / peak_bw,
                    copy_fraction=moved / ours / copy_bw,
                    sdpa_gathered_seconds=base,
                    speedup_vs_sdpa=None if base is None else base / ours,
                )
            )
            del case
            torch.cuda.empty_cache()
    prefill = []
    for chunk in (512,) if quick else (512, 2048):
        batch = 4
        case = make_decode_case(batch, 2 * chunk, shape, dtype, device, query_len=chunk)
        seconds = timer(lambda case=case: paged_attention(**case))
        flops = prefill_flops(batch, chunk, chunk, shape)
        prefill.append(
            _row(
                batch=batch,
                chunk=chunk,
                prefix=chunk,
                seconds=seconds,
                flops=flops,
                peak_fraction=None if peak_flops is None else flops / seconds / peak_flops,
            )
        )
    e2e = []
    for batch, context in ((1, 2048), (64, 2048)) if not quick else ((64, 2048),):
        row = _e2e_step(ModelShape(), batch, context, dtype, device, timer, graph=True)
        row["roofline_seconds"] = row["bytes"] / peak_bw
        row["roofline_fraction"] = row["roofline_seconds"] / row["seconds"]
        e2e.append(row)
    _print_table(f"Decode attention, Llama-3-8B layer, bf16, {name}", decode)
    _print_table("Prefill chunks (4 sequences, chunk after an equal cached prefix)", prefill)
    _print_table("Decode step, Llama-3.2-1B shape, random bf16 weights", e2e)
    return {
        "measured": True,
        "device": name,
        "peak_hbm_bytes_per_s": peak_bw,
        "peak_bf16_flops": peak_flops,
        "peak_source": source,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "timing": "one Python launch a call, L2 flushed between (triton.testing.do_bench)",
        "targets": {"decode_peak_fraction": 0.70, "decode_speedup_vs_sdpa": 2.0},
        "decode": decode,
        "prefill": prefill,
        "e2e": e2e,
    }


# ---------------------------------------------------------------------------- model step


def _e2e_step(model: ModelShape, batch, context, dtype, device, timer, *, graph=False) -> dict:
    """One decode step (one token per sequence) of a random-weight Llama-shaped model."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, kv_dim, q_dim = (
        model.hidden_size,
        model.num_kv_heads * model.head_dim,
        model.num_heads * model.head_dim,
    )

    def weight(*size):
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(
            dtype
        )

    embed = weight(model.vocab_size, h)
    layers = [
        dict(
            qkv=weight(h, q_dim + 2 * kv_dim),
            o=weight(q_dim, h),
            gate_up=weight(h, 2 * model.intermediate_size),
            down=weight(model.intermediate_size, h),
            norm1=torch.ones(h, device=device, dtype=dtype),
            norm2=torch.ones(h, device=device, dtype=dtype),
        )
        for _ in range(model.num_layers)
    ]
    shape = LayerShape(model.num_heads, model.num_kv_heads, model.head_dim, model.block_size)
    case = make_decode_case(batch, context, shape, dtype, device)
    caches = [(case["key_cache"], case["value_cache"])]
    caches += [
        (torch.randn_like(case["key_cache"]), torch.randn_like(case["value_cache"]))
        for _ in layers[1:]
    ]
    positions = case["seq_lens"].long() - 1
    slot_mapping = (
        case["block_tables"].long().gather(1, (positions // model.block_size)[:, None])[:, 0]
        * model.block_size
        + positions % model.block_size
    )
    inv_freq = 1.0 / (
        500000.0 ** (torch.arange(0, model.head_dim, 2, device=device) / model.head_dim)
    )
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    tokens = torch.randint(0, model.vocab_size, (batch,), generator=gen, device=device)

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def step():
        x = embed[tokens]
        for layer, (key_cache, value_cache) in zip(layers, caches, strict=True):
            r = F.rms_norm(x, (h,), layer["norm1"])
            q, k, v = (r @ layer["qkv"]).split((q_dim, kv_dim, kv_dim), dim=-1)
            q = rope(q.view(batch, model.num_heads, model.head_dim))
            k = rope(k.view(batch, model.num_kv_heads, model.head_dim))
            v = v.reshape(batch, model.num_kv_heads, model.head_dim)
            write_kv(k, v, key_cache, value_cache, slot_mapping)
            o = paged_attention(
                q.contiguous(),
                key_cache,
                value_cache,
                case["block_tables"],
                case["seq_lens"],
                case["query_start_loc"],
                case["scale"],
            )
            x = x + o.view(batch, q_dim) @ layer["o"]
            r = F.rms_norm(x, (h,), layer["norm2"])
            gate, up = (r @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return F.rms_norm(x, (h,)) @ embed.T

    mode = "eager"
    fn = step
    if graph:
        captured = _try_cuda_graph(step)
        if captured is not None:
            fn, mode = captured, "cuda graph"
    seconds = timer(fn)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = model.num_layers * 2 * batch * context * kv_dim * elem
    return _row(
        batch=batch,
        context=context,
        layers=model.num_layers,
        vocab=model.vocab_size,
        mode=mode,
        seconds=seconds,
        bytes=model.num_params * elem + kv_bytes,
    )


def _try_cuda_graph(step):
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile and warm up outside the capture
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay
    except Exception as exc:  # capture is an optimisation; eager timing still stands
        print(f"CUDA graph capture failed ({exc!r}); timing eager.")
        return None


# ---------------------------------------------------------------------------- timing


def _cuda_timer(fn) -> float:
    """Seconds a call, launched from Python one call at a time, the L2 cache flushed between
    (Triton's ``do_bench``): below batch 64 the launch (40-100 µs) is most of it, where the
    engine replays the same kernels from a CUDA graph."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def _wall_timer(repeat: int) -> Timer:
    def timer(fn) -> float:
        fn()  # warm-up
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    return timer


def _try_oom(measure):
    try:
        return measure()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def device_peaks(name: str) -> tuple[float, float | None, str]:
    for words, bandwidth, flops in _DEVICE_PEAKS:
        if all(w in name for w in words):
            return bandwidth, flops, "datasheet"
    return _measured_copy_bandwidth("cuda"), None, "measured device-to-device copy"


def _measured_copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large copy: a practical peak."""
    numel = (1 << 30) // 4 if device == "cuda" else (256 << 20) // 4
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    timer = _cuda_timer if device == "cuda" else _wall_timer(repeat=5)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * numel * 4 / seconds


# ---------------------------------------------------------------------------- output


def _row(**fields) -> dict:
    row = dict(fields)
    if "bytes" in row:
        row["bytes_per_s"] = row["bytes"] / row["seconds"]
    if "flops" in row:
        row["flops_per_s"] = row["flops"] / row["seconds"]
    return row


def _print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if not rows:
        return
    columns = list(rows[0])
    cells = [[_fmt(c, r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(column: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if column.endswith("seconds"):
        return f"{value * 1e3:.3f} ms"
    if column == "bytes_per_s":
        return f"{value / 1e9:.1f} GB/s"
    if column == "flops_per_s":
        return f"{value / 1e12:.3f} TFLOP/s"
    if column in ("bytes", "flops"):
        return f"{value:.3g}"
    if "fraction" in column:
        return f"{100 * value:.1f}%"
    if column.startswith("speedup"):
        return f"{value:.2f}x"
    return str(value)


def torch_machine() -> dict:
    """What the kernel studies add to the shared header's machine."""
    info = {"torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


if __name__ == "__main__":
    raise SystemExit(main())
