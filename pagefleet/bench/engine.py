"""``pagefleet bench engine``: continuous vs static batching vs `transformers`, one process.

A seeded synthetic trace with long-tailed output lengths (most requests short, a few
long: the shape that makes static batching wait) runs through:

* pagefleet, continuous batching;
* pagefleet, static batching (same model, same kernels, padded and reserved up front);
* `transformers` ``generate`` on padded batches of ``max_num_seqs``;
* `transformers`' own continuous batching (``init_continuous_batching``).

Only useful tokens count: each request's own output, never padding or the tokens a
finished row keeps producing in a static batch. Also measured: KV waste at peak
(allocated minus used slots over allocated) and the non-model CPU time per step with
256 running sequences.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class Trace:
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def long_tailed(
        cls, n: int, seed: int, *, long_fraction: float = 0.1, short: tuple[int, int] = (8, 32),
        long: tuple[int, int] = (256, 512), vocab: int = 256,
    ) -> Trace:
        """Prompts of 64-256 tokens; most answers short, ``long_fraction`` of them long."""
        rng = random.Random(seed)
        prompts, outs = [], []
        for _ in range(n):
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(64, 256))])
            outs.append(rng.randint(*long) if rng.random() < long_fraction else rng.randint(*short))
        return cls(prompts, outs)

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Result:
    system: str
    seconds: float
    useful_tokens: int
    tokens_per_second: float
    steps: int | None = None
    kv_waste_at_peak: float | None = None
    note: str = ""


def run_pagefleet(model: str, trace: Trace, batching: str, max_num_seqs: int, block_size: int) -> Result:
    from pagefleet import Engine, SamplingParams

    engine = Engine(model, batching=batching, max_num_seqs=max_num_seqs, block_size=block_size,
                    num_blocks=8192, max_num_batched_tokens=2048)
    for p, k in zip(trace.prompts, trace.max_tokens, strict=True):
        engine.add_request(p, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
    peak_alloc, used_at_peak, steps, produced = 0, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for d in engine.step():
            produced += len(d.token_ids)
        steps += 1
        alloc = engine.kv.num_allocated_slots()
        if alloc > peak_alloc:
            peak_alloc = alloc
            used_at_peak = _used_slots(engine)
    seconds = time.perf_counter() - start
    engine.check_integrity()
    assert produced == trace.useful_tokens, (produced, trace.useful_tokens)
    waste = 1 - used_at_peak / peak_alloc if peak_alloc else 0.0
    return Result(f"pagefleet {batching}", seconds, produced, produced / seconds, steps, waste)


def _used_slots(engine) -> int:
    """Slots holding a token right now: every cached token of every request with blocks."""
    if engine.batching == "static":
        return sum(r.num_computed_tokens for r in engine.scheduler.batch if not r.is_finished) + sum(
            r.num_tokens for r in engine.scheduler.batch if r.is_finished
        )
    return sum(r.num_computed_tokens for r in engine.scheduler.running)


def run_hf_padded(path: str, trace: Trace, batch: int) -> Result:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    produced = 0
    start = time.perf_counter()
    for i in range(0, len(trace.prompts), batch):
        prompts = trace.prompts[i : i + batch]
        limits = trace.max_tokens[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(limits), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        produced += sum(limits)  # each row's own budget; the rest of the batch's steps are waste
    seconds = time.perf_counter() - start
    return Result("transformers generate (padded)", seconds, produced, produced / seconds)


def run_hf_continuous(path: str, trace: Trace, batch: int) -> Result:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                        max_new_tokens=max(trace.max_tokens))
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch, block_size=16, page_size=16)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    start = time.perf_counter()
    ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=k)
           for i, (p, k) in enumerate(zip(trace.prompts, trace.max_tokens, strict=True))]
    produced = 0
    pending = set(ids)
    deadline = start + 3600
    while pending and time.perf_counter() < deadline:
        out = manager.get_result(timeout=5)
        if out is not None and out.request_id in pending and out.is_finished():
            pending.discard(out.request_id)
            produced += len(out.generated_tokens)
    seconds = time.perf_counter() - start
    manager.stop(block=True, timeout=30)
    return Result("transformers continuous batching", seconds, produced, produced / seconds,
                  note="" if not pending else f"{len(pending)} requests unfinished")


def step_overhead(model: str, num_seqs: int = 256, steps: int = 30) -> dict:
    """Non-model CPU time of a decode step with ``num_seqs`` running: step time minus the forward pass."""
    from pagefleet import Engine, SamplingParams

    engine = Engine(model, num_blocks=num_seqs * 8, max_num_seqs=num_seqs, max_num_batched_tokens=4096)
    engine.runner.profile = True  # time the forward pass apart from the rest of the step
    rng = random.Random(0)
    for _ in range(num_seqs):
        engine.add_request([rng.randrange(256) for _ in range(64)],
                           SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill everything first: what follows are pure decode steps
    assert engine.stats().num_running == num_seqs
    total, model_t, cpu = [], [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        total.append(time.perf_counter() - t)
        # This thread's CPU time outside the forward pass: robust to other load on the machine.
        cpu.append(time.thread_time() - c - engine.runner.last_model_cpu_seconds)
        model_t.append(engine.runner.last_model_seconds)
    non_model = [a - b for a, b in zip(total, model_t, strict=True)]
    return {
        "num_running": num_seqs,
        "step_ms_p50": statistics.median(total) * 1e3,
        "model_ms_p50": statistics.median(model_t) * 1e3,
        "non_model_ms_p50": statistics.median(non_model) * 1e3,
        "non_model_ms_min": min(non_model) * 1e3,
        "non_model_cpu_ms_p50": statistics.median(cpu) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-fraction", type=float, default=0.1, help="share of requests with long outputs")
    p.add_argument("--short", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"),
                   help="output tokens of a short request")
    p.add_argument("--long", type=int, nargs=2, default=(256, 512), metavar=("MIN", "MAX"),
                   help="output tokens of a long request")
    p.add_argument("--json", default="bench-results/engine.json")
    p.add_argument("--skip-transformers", action="store_true", help="only the pagefleet modes")
    p.add_argument("--quick", action="store_true", help="a 32-request trace, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 32
    torch.manual_seed(0)
    trace = Trace.long_tailed(args.num_requests, args.seed, long_fraction=args.long_fraction,
                              short=tuple(args.short), long=tuple(args.long))
    from pagefleet.worker.models.loader import save_tiny

    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(save_tiny(Path(tmp) / "tiny"))  # the same weights, readable by transformers
        # First, in a process that has not yet run `transformers`: a serving worker never
        # imports it, and after its runs the same steps cost ~0.4 ms more here.
        overhead = step_overhead(ckpt)
        results.append(run_pagefleet(ckpt, trace, "continuous", args.max_num_seqs, args.block_size))
        results.append(run_pagefleet(ckpt, trace, "static", args.max_num_seqs, args.block_size))
        if not args.skip_transformers:
            results.append(run_hf_padded(ckpt, trace, args.max_num_seqs))
            try:
                results.append(run_hf_continuous(ckpt, trace, args.max_num_seqs))
            except Exception as e:  # report, don't hide: the row says why it has no figure
                results.append(Result("transformers continuous batching", float("nan"), 0, float("nan"),
                                      note=f"failed: {type(e).__name__}: {e}"[:200]))
    cont = results[0].tokens_per_second
    hf = [r.tokens_per_second for r in results[2:] if r.tokens_per_second == r.tokens_per_second]
    summary = {
        "continuous_over_static": cont / results[1].tokens_per_second,
        "continuous_over_best_transformers": cont / max(hf) if hf else None,
        "kv_waste_at_peak_continuous": results[0].kv_waste_at_peak,
        "kv_waste_at_peak_static": results[1].kv_waste_at_peak,
        "step_overhead": overhead,
    }
    report = {
        "benchmark": "engine",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "trace": {"num_requests": args.num_requests, "seed": args.seed, "max_num_seqs": args.max_num_seqs,
                  "long_fraction": args.long_fraction, "short": list(args.short), "long": list(args.long),
                  "block_size": args.block_size, "useful_tokens": trace.useful_tokens,
                  "prompt_tokens": sum(len(x) for x in trace.prompts)},
        "results": [asdict(r) for r in results],
        "summary": summary,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\ntrace: {args.num_requests} requests, {trace.useful_tokens} useful output tokens, "
          f"max_num_seqs {args.max_num_seqs}, block_size {args.block_size}")
    print("| system | seconds | useful tok/s | steps | KV waste at peak | note |\n|---|---|---|---|---|---|")
    for r in results:
        waste = f"{r.kv_waste_at_peak:.1%}" if r.kv_waste_at_peak is not None else "-"
        print(f"| {r.system} | {r.seconds:.2f} | {r.tokens_per_second:.1f} | {r.steps or '-'} | {waste} | {r.note} |")
    print(f"\ncontinuous / static: {summary['continuous_over_static']:.2f}x")
    if summary["continuous_over_best_transformers"]:
        print(f"continuous / best transformers: {summary['continuous_over_best_transformers']:.2f}x")
    print(f"step at {overhead['num_running']} running: {overhead['step_ms_p50']:.2f} ms, model "
          f"{overhead['model_ms_p50']:.2f} ms, non-model {overhead['non_model_ms_p50']:.2f} ms wall, "
          f"{overhead['non_model_cpu_ms_p50']:.2f} ms CPU (p50)")
    print(f"JSON: {out}")
    return 0
