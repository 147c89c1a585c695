"""``pagefleet bench preemption``: swap vs recompute vs auto under KV-pool pressure.

Three seeded pressure traces, every request submitted at once, a device pool sized to
~30 % of the trace's peak demand (the blocks every request would hold at its longest),
a swap pool large enough for everything:

* ``short-long``: short prompts, long outputs (sequences grow a lot after admission);
* ``long-short``: long prompts, short outputs (victims hold many prompt blocks);
* ``mixed``: both.

Each runs in every mode on the same engine settings. Reported per run: wall time,
output tokens per second (wall and per CPU-second of this process: on a shared
machine the second is the steadier one), p50/p99 request latency (all requests arrive at t=0, so latency is
completion time), preemption rate (the share of requests preempted at least once,
the seeds' health metric, under 2 % at peak for a healthy deployment) and
preemptions per request, blocks and bytes swapped, the swap transfers' achieved
bandwidth and, measured in the same run, a plain ``torch`` copy of the same bytes in
as many contiguous copies (from memory, not cache, on a CPU; device to pinned host
memory on CUDA).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagefleet.common.blocks import num_blocks_for

from .results import header

MODES = ("swap", "recompute", "auto")


@dataclass
class Trace:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def make(cls, name: str, n: int, seed: int, vocab: int = 250) -> Trace:
        rng = random.Random(f"{name}/{seed}")
        shapes = {
            "short-long": ((8, 48), (96, 224)),
            "long-short": ((192, 384), (8, 32)),
        }
        prompts, outs = [], []
        for i in range(n):
            kind = name if name != "mixed" else ("short-long" if i % 2 else "long-short")
            (p_lo, p_hi), (o_lo, o_hi) = shapes[kind]
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(p_lo, p_hi))])
            outs.append(rng.randint(o_lo, o_hi))
        return cls(name, prompts, outs)

    def peak_blocks(self, block_size: int) -> int:
        return sum(num_blocks_for(len(p) + k, block_size) for p, k in zip(self.prompts, self.max_tokens, strict=True))

    def largest_blocks(self, block_size: int) -> int:
        return max(num_blocks_for(len(p) + k, block_size) for p, k in zip(self.prompts, self.max_tokens, strict=True))


@dataclass
class Run:
    trace: str
    mode: str
    seconds: float
    cpu_seconds: float  # this process's CPU time: what a busy shared machine disturbs least
    output_tokens: int
    tokens_per_second: float
    tokens_per_cpu_second: float
    p50_latency_s: float
    p99_latency_s: float
    num_steps: int
    num_preemptions: int
    num_recomputes: int
    preemption_rate: float  # share of requests preempted at least once
    preemptions_per_request: float
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    bytes_moved: int
    swap_gbps: float | None
    plain_copy_gbps: float | None
    swap_vs_plain: float | None
    cost_model: dict | None = None
    extra: dict = field(default_factory=dict)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def plain_copy_gbps(device: torch.device, total_bytes: int, num_copies: int) -> float:
    """A plain ``copy_`` of ``total_bytes`` in ``num_copies`` equal contiguous pieces.

    Sources and destinations rotate through 256 MiB buffers, so on a CPU every piece
    comes from memory, not cache, as a swapped block does; on CUDA the destination is
    pinned host memory, as the swap pool is.
    """
    piece = max(1, total_bytes // max(1, num_copies) // 4)
    span = max(piece * (num_copies + 1), (256 << 20) // 4)
    src = torch.ones(span, device=device)
    dst = torch.zeros(span, pin_memory=device.type == "cuda")
    best = float("inf")
    for rep in range(4):
        base = rep * piece * num_copies
        offsets = [(base + i * piece) % (span - piece) for i in range(num_copies)]
        t0 = time.perf_counter()
        for off in offsets:
            dst[off : off + piece].copy_(src[off : off + piece], non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
    return piece * 4 * num_copies / best / 1e9


def run_one(model: str, trace: Trace, mode: str, args) -> Run:
    from pagefleet import Engine, SamplingParams

    bs = args.block_size
    peak = trace.peak_blocks(bs)
    num_blocks = max(trace.largest_blocks(bs) + 1, round(args.pool_fraction * peak))
    engine = Engine(model, device=args.device, block_size=bs, num_blocks=num_blocks,
                    num_swap_blocks=peak, preemption=mode, max_num_seqs=len(trace.prompts),
                    max_num_batched_tokens=args.max_num_batched_tokens)
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
        for p, k in zip(trace.prompts, trace.max_tokens, strict=True)
    ]
    reqs = dict(engine.requests)
    done: dict[str, float] = {}
    produced = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for d in engine.step():
            produced += len(d.token_ids)
            if d.finished:
                done[d.request_id] = time.perf_counter() - start
    if engine.executor.swap_space is not None:
        engine.executor.swap_space.synchronize()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    engine.check_integrity()
    s = engine.stats()
    lat = [done[r] for r in ids]
    space = engine.executor.swap_space
    moved = space.num_bytes_moved if space else 0
    swap_bw = space.bytes_per_second / 1e9 if space and moved else None
    plain = None
    if moved:
        plain = plain_copy_gbps(engine.device, moved, space.num_transfers)
    return Run(
        trace=trace.name, mode=mode, seconds=seconds, cpu_seconds=cpu_seconds, output_tokens=produced,
        tokens_per_second=produced / seconds, tokens_per_cpu_second=produced / cpu_seconds,
        p50_latency_s=statistics.median(lat), p99_latency_s=_percentile(lat, 0.99),
        num_steps=s.num_steps_total, num_preemptions=s.num_preemptions_total, num_recomputes=s.num_recomputes_total,
        preemption_rate=sum(1 for r in reqs.values() if r.num_preemptions) / len(reqs),
        preemptions_per_request=s.num_preemptions_total / len(reqs),
        num_swapped_out_blocks=s.num_swapped_out_blocks_total, num_swapped_in_blocks=s.num_swapped_in_blocks_total,
        bytes_moved=moved, swap_gbps=swap_bw, plain_copy_gbps=plain,
        swap_vs_plain=swap_bw / plain if swap_bw and plain else None,
        cost_model=asdict(engine.cost_model) if engine.cost_model else None,
        extra={"num_blocks": num_blocks, "peak_blocks": peak, "num_requests": len(ids)},
    )


def _table(runs: list[Run]) -> str:
    head = (f"{'trace':<11} {'mode':<10} {'tok/s':>7} {'tok/cpu-s':>9} {'p50 s':>6} {'p99 s':>6} {'preempt%':>8} "
            f"{'pre/req':>7} {'recomp':>6} {'MB moved':>8} {'swap GB/s':>9} {'plain GB/s':>10} {'ratio':>5}")
    lines = [head, "-" * len(head)]
    for r in runs:
        f = lambda x, w, p: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        lines.append(
            f"{r.trace:<11} {r.mode:<10} {r.tokens_per_second:>7.1f} {r.tokens_per_cpu_second:>9.1f} "
            f"{r.p50_latency_s:>6.2f} "
            f"{r.p99_latency_s:>6.2f} {100 * r.preemption_rate:>7.1f}% {r.preemptions_per_request:>7.2f} "
            f"{r.num_recomputes:>6d} {r.bytes_moved / 1e6:>8.1f} {f(r.swap_gbps, 9, 2)} "
            f"{f(r.plain_copy_gbps, 10, 2)} {f(r.swap_vs_plain, 5, 2)}"
        )
    return "\n".join(lines)


def _verdicts(runs: list[Run]) -> list[str]:
    out = []
    for name in dict.fromkeys(r.trace for r in runs):
        by = {r.mode: r for r in runs if r.trace == name}
        if set(MODES) <= set(by):
            best = max(by["swap"].tokens_per_cpu_second, by["recompute"].tokens_per_cpu_second)
            ratio = by["auto"].tokens_per_cpu_second / best
            out.append(f"{name}: auto at {ratio:.2f}x the better of swap and recompute (tokens per CPU-second) "
                       f"({'meets' if ratio >= 1.0 else 'misses'} the target)")
        sw = by.get("swap")
        if sw is not None and sw.swap_vs_plain is not None:
            out.append(f"{name}: swap transfers at {100 * sw.swap_vs_plain:.0f}% of a plain copy "
                       f"({'meets' if sw.swap_vs_plain >= 0.8 else 'misses'} the 80% target)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagefleet bench preemption", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=16, help="requests per trace")
    ap.add_argument("--traces", default="short-long,long-short,mixed")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--pool-fraction", type=float, default=0.30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode; the fastest is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default="bench-results/preemption.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    known_traces = ("short-long", "long-short", "mixed")
    if bad := [t for t in args.traces.split(",") if t not in known_traces]:
        ap.error(f"--traces: unknown {', '.join(map(repr, bad))}; choose from {', '.join(known_traces)}")
    runs: list[Run] = []
    modes = args.modes.split(",")
    for name in args.traces.split(","):
        trace = Trace.make(name, args.requests, args.seed)
        best: dict[str, Run] = {}
        for rep in range(args.repeats):  # modes interleaved, so load changes hit them alike
            for mode in modes:
                r = run_one(args.model, trace, mode, args)
                print(f"  {name:<11} {mode:<10} #{rep} {r.seconds:6.1f} s  {r.cpu_seconds:6.1f} cpu-s  "
                      f"{r.tokens_per_second:7.1f} tok/s", flush=True)
                if mode not in best or r.cpu_seconds < best[mode].cpu_seconds:
                    best[mode] = r
        runs.extend(best[m] for m in modes)
    print(_table(runs))
    verdicts = _verdicts(runs)
    for v in verdicts:
        print(v)
    result = {
        **header("preemption", "pagefleet bench preemption", torch=torch.__version__,
                 torch_threads=torch.get_num_threads(),
                 device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
        "args": vars(args),
        "runs": [asdict(r) for r in runs],
        "verdicts": verdicts,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
