"""``pagefleet bench decode``: the engine's decode step against the memory roofline, CUDA
graphs on and off.

A decode step must read every weight and every sequence's KV cache once, so on a GPU it
cannot beat ``(weight bytes + KV bytes read) / peak HBM bandwidth`` (the roofline). For each
batch size and context this fills an engine (``load_format="dummy"``: the shape's random
weights, made on the device) with ``batch`` sequences of ``context`` prompt tokens, lets
them all reach decoding, then times ``--steps`` whole ``engine.step()`` calls (scheduling,
inputs, forward, sampling and reading the ids back), once replaying CUDA graphs and once
with ``enforce_eager``. Reported: ms per step, the roofline, their ratio (target <= 1.3x).

Shapes: ``llama-3.2-1b`` and ``llama-3-8b`` (their published configs, written to a temp
dir), or ``--model DIR``. Without a GPU the same loop runs ``tiny`` on the CPU at small
sizes, as a smoke test: no roofline there.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from .results import header, int_list

SHAPES = {
    # meta-llama/Llama-3.2-1B and Meta-Llama-3-8B config.json (the fields the model reads)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=8192),
}


def write_shape(name: str, directory: Path) -> Path:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, bos_token_id=128000,
               eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16", **SHAPES[name])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def measure(model: str, *, batch: int, context: int, steps: int, enforce_eager: bool, device: str,
            dtype: str, load_format: str, block_size: int = 16, profile: bool = False) -> dict:
    from pagefleet import Engine, SamplingParams

    per_seq = math.ceil((context + steps + 4) / block_size)
    engine = Engine(model, device=device, dtype=dtype, load_format=load_format, block_size=block_size,
                    num_blocks=batch * per_seq + 8, max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
                    max_model_len=context + steps + 8, enforce_eager=enforce_eager, enable_prefix_caching=False)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % (vocab - 10) + 5 for j in range(context)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.step()  # the first decode step of every sequence (graphs warm)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # reads the sampled ids back: the device has finished the step
        times.append(time.perf_counter() - t0)
    runner = engine.executor.runner
    graphed = runner.last_step_graphed
    where = profile_steps(engine, 5) if profile and device == "cuda" else None
    cfg, elt = engine.model_config, engine.executor.dtype.itemsize
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.executor.model.parameters())
    kv_bytes = 2 * cfg.num_hidden_layers * batch * (context + steps) * cfg.num_key_value_heads * cfg.head_dim * elt
    while engine.has_unfinished_requests():
        engine.step()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    times.sort()
    row = dict(batch=batch, context=context, cuda_graphs=graphed, step_ms_p50=1000 * times[len(times) // 2],
               step_ms_min=1000 * times[0], weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    if where is not None:
        row["profile"] = where
    return row


# Kernel names by what they do (torch profiler's device events); the rest is elementwise,
# reductions and copies (norms, RoPE, activations, residual adds, casts, the sampler's argmax).
_KERNEL_KINDS = (("attention", ("paged_attention", "merge_splits", "write_kv")),
                 ("gemm", ("nvjet", "gemm", "cutlass", "splitkreduce", "sm90_xmma", "ampere_")))


def profile_steps(engine, steps: int) -> dict:
    """Where ``steps`` decode steps' time goes on the device: GPU busy time (the sum of kernel
    times) by kind, kernel launches, all per step, beside the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # Without acc_events, torch 2.11 on an H200 warned "Profiler clears events at the end of each
    # cycle" and the split read 0.16 ms of GEMMs a step for 2.5 GB of weights (0.52 ms at the
    # copy bandwidth): about one step's kernels of the five (docs/BENCHMARKS.md, 2026-11-28).
    acc = {"acc_events": True} if "acc_events" in inspect.signature(profile.__init__).parameters else {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **acc) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    by_kind = {kind: 0.0 for kind, _ in _KERNEL_KINDS} | {"other": 0.0}
    launches = 0
    for k in prof.key_averages():
        if k.device_type != torch.autograd.DeviceType.CUDA or k.self_device_time_total <= 0:
            continue  # an operator's row repeats its kernels' time; only the kernels' rows count
        name = k.key.lower()
        kind = next((kind for kind, keys in _KERNEL_KINDS if any(key in name for key in keys)), "other")
        by_kind[kind] += k.self_device_time_total / 1e3 / steps  # ms a step
        launches += k.count
    return dict(step_ms_profiled=1000 * wall, gpu_busy_ms=sum(by_kind.values()),
                kernels_per_step=launches / steps, **{f"{k}_ms": v for k, v in by_kind.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b,llama-3-8b",
                   help=f"comma-separated: {', '.join(SHAPES)} (random bf16 weights)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--batch", type=int_list, default=[1, 16, 64], help="comma-separated batch sizes")
    p.add_argument("--context", type=int_list, default=[512, 2048], help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per point")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default="bench-results/decode.json")
    p.add_argument("--profile", action="store_true",
                   help="also profile 5 steps a point (GPU): busy time by kernel kind, launches a step")
    args = p.parse_args(argv)
    from .kernels import device_peaks, torch_machine

    cuda = torch.cuda.is_available()
    peak, source = (None, None)
    if cuda:
        peak, _, source = device_peaks(torch.cuda.get_device_name())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            models = [(Path(args.model).name, args.model, "auto")]
        elif cuda:
            models = [(s, str(write_shape(s, Path(tmp) / s)), "dummy") for s in args.shape.split(",")]
        else:  # the smoke test: the loop, not the figures
            models = [("tiny (CPU smoke run)", "tiny", "auto")]
            args.batch, args.context, args.steps, args.dtype = [1, 4], [64], 4, "float32"
        for label, model, load_format in models:
            for context in args.context:
                for batch in args.batch:
                    for eager in (False, True) if cuda else (True,):
                        row = measure(model, batch=batch, context=context, steps=args.steps, enforce_eager=eager,
                                      device="cuda" if cuda else "cpu", dtype=args.dtype, load_format=load_format,
                                      profile=args.profile)
                        row["model"] = label
                        if peak:
                            row["roofline_ms"] = 1000 * (row["weight_bytes"] + row["kv_bytes"]) / peak
                            row["x_roofline"] = row["step_ms_p50"] / row["roofline_ms"]
                        rows.append(row)
                        print(_line(row), flush=True)
    out = dict(**header("decode", "pagefleet bench decode", **torch_machine()), peak_bandwidth=peak, peak_source=source,
               rows=rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


def _line(r: dict) -> str:
    roof = f", roofline {r['roofline_ms']:.3f} ms ({r['x_roofline']:.2f}x)" if "roofline_ms" in r else ""
    graphs = "graphs" if r["cuda_graphs"] else "eager"
    where = r.get("profile")
    prof = (f"; GPU busy {where['gpu_busy_ms']:.3f} ms (attention {where['attention_ms']:.3f}, gemm "
            f"{where['gemm_ms']:.3f}, other {where['other_ms']:.3f}), {where['kernels_per_step']:.0f} kernels"
            if where else "")
    return (f"{r['model']}: batch {r['batch']:>3} x context {r['context']:>5} [{graphs}]: "
            f"{r['step_ms_p50']:.3f} ms/step p50{roof}{prof}")


if __name__ == "__main__":
    raise SystemExit(main())
