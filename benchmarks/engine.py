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
256 running sequences, each with prefix caching on (the default) and off.

``--trace shared-prefix`` measures prefix caching instead, on SGLang's
``generated-shared-prefix`` shape: ``--gsp-num-groups`` groups of ``--gsp-prompts-per-group``
prompts, each a group's system prompt of ``--gsp-system-prompt-len`` tokens and a question of
``--gsp-question-len`` tokens, ``--gsp-output-len`` tokens out, all arriving at once (the
flags of every shared-prefix workload; ``--sp-*`` still accepted).
Caching on vs off: throughput, time to first token from the trace's start (p50, p90),
hit rate; then the default trace on vs off (what caching costs when nothing is shared)
and the step overhead on vs off.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagefleet.bench.datasets import add_shared_prefix_args

from .results import header


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

    @classmethod
    def shared_prefix(
        cls, groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int,
        seed: int, vocab: int = 256,
    ) -> Trace:
        """SGLang's ``generated-shared-prefix``: per group one system prompt, then a question each."""
        rng = random.Random(seed)
        prompts = []
        for _ in range(groups):
            system = [rng.randrange(vocab) for _ in range(system_len)]
            prompts += [system + [rng.randrange(vocab) for _ in range(question_len)]
                        for _ in range(prompts_per_group)]
        return cls(prompts, [output_len] * len(prompts))

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
    ttft_p50_s: float | None = None  # from the trace's start (every request arrives then)
    ttft_p90_s: float | None = None
    prefix_cache_hit_rate: float | None = None  # tokens found cached / tokens looked up
    # Every step that computed tokens: [batched tokens, KV tokens read, seconds of the whole
    # engine.step()] (what `pagefleet bench sim-fit` fits a simulated worker's profile to).
    step_timings: list[list[float]] | None = None


def run_pagefleet(model: str, trace: Trace, batching: str, max_num_seqs: int, block_size: int,
                  enable_prefix_caching: bool = True, device: str = "auto") -> Result:
    from pagefleet import Engine, SamplingParams

    engine = Engine(model, batching=batching, max_num_seqs=max_num_seqs, block_size=block_size, device=device,
                    num_blocks=8192, max_num_batched_tokens=2048, enable_prefix_caching=enable_prefix_caching)
    for p, k in zip(trace.prompts, trace.max_tokens, strict=True):
        engine.add_request(p, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
    peak_alloc, used_at_peak, steps, produced = 0, 0, 0, 0
    first_token: dict[str, float] = {}
    shapes, timings = _record_step_shapes(engine), []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_shapes, t0 = len(shapes), time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        if len(shapes) > num_shapes and shapes[-1][0]:
            timings.append([*shapes[-1], now - t0])
        for d in deltas:
            produced += len(d.token_ids)
            if d.token_ids and d.request_id not in first_token:
                first_token[d.request_id] = now - start
        steps += 1
        alloc = engine.kv.num_allocated_slots()
        if alloc > peak_alloc:
            peak_alloc = alloc
            used_at_peak = _used_slots(engine)
    seconds = time.perf_counter() - start
    engine.check_integrity()
    assert produced == trace.useful_tokens, (produced, trace.useful_tokens)
    waste = 1 - used_at_peak / peak_alloc if peak_alloc else 0.0
    ttft = sorted(first_token.values())
    stats = engine.stats()
    caching = "" if enable_prefix_caching or batching == "static" else ", no prefix caching"
    return Result(
        f"pagefleet {batching}{caching}", seconds, produced, produced / seconds, steps, waste,
        ttft_p50_s=_percentile(ttft, 0.5), ttft_p90_s=_percentile(ttft, 0.9),
        prefix_cache_hit_rate=(stats.prefix_cache_hits_total / stats.prefix_cache_queries_total
                               if stats.prefix_cache_queries_total else None),
        step_timings=timings,
    )


def _record_step_shapes(engine) -> list[tuple[int, int]]:
    """A list that gets ``(batched tokens, KV tokens read)`` of every step the engine runs."""
    from pagefleet.worker.sim import step_shape

    shapes: list[tuple[int, int]] = []
    execute = engine.executor.execute

    def recorded(out):
        shapes.append(step_shape(out))
        return execute(out)

    engine.executor.execute = recorded
    return shapes


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _used_slots(engine) -> int:
    """Slots holding a token right now: every computed token of every request with blocks
    (a block shared by several requests counts for each)."""
    if engine.batching == "static":
        return sum(r.num_computed_tokens for r in engine.scheduler.batch if not r.is_finished) + sum(
            r.num_tokens for r in engine.scheduler.batch if r.is_finished
        )
    return sum(r.num_computed_tokens for r in engine.scheduler.running)


def run_hf_padded(path: str, trace: Trace, batch: int, device: str = "cpu") -> Result:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
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
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(limits), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        produced += sum(limits)  # each row's own budget; the rest of the batch's steps are waste
    seconds = time.perf_counter() - start
    return Result("transformers generate (padded)", seconds, produced, produced / seconds)


def run_hf_continuous(path: str, trace: Trace, batch: int, device: str = "cpu") -> Result:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    gen = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                        max_new_tokens=max(trace.max_tokens))
    # `page_size` is the newer name of `block_size` (which some versions no longer take, some
    # no longer want): give the one this version has.
    size_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch, **{size_key: 16})
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


def step_overhead(model: str, num_seqs: int = 256, steps: int = 30, enable_prefix_caching: bool = True,
                  device: str = "auto") -> dict:
    """Non-model CPU time of a decode step with ``num_seqs`` running: step time minus the forward pass.

    The sequences decode in lockstep, so one step in ``block_size`` fills (and hashes) a block
    of each: the p50 is a step that fills none, the mean spreads those over every step.
    """
    from pagefleet import Engine, SamplingParams

    engine = Engine(model, num_blocks=num_seqs * 8, max_num_seqs=num_seqs, max_num_batched_tokens=4096,
                    enable_prefix_caching=enable_prefix_caching, device=device)
    engine.executor.runner.profile = True  # time the forward pass apart from the rest of the step
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
        cpu.append(time.thread_time() - c - engine.executor.runner.last_model_cpu_seconds)
        model_t.append(engine.executor.runner.last_model_seconds)
    non_model = [a - b for a, b in zip(total, model_t, strict=True)]
    return {
        "num_running": num_seqs,
        "enable_prefix_caching": enable_prefix_caching,
        "step_ms_p50": statistics.median(total) * 1e3,
        "model_ms_p50": statistics.median(model_t) * 1e3,
        "non_model_ms_p50": statistics.median(non_model) * 1e3,
        "non_model_ms_min": min(non_model) * 1e3,
        "non_model_cpu_ms_p50": statistics.median(cpu) * 1e3,
        "non_model_cpu_ms_mean": statistics.fmean(cpu) * 1e3,
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
    p.add_argument("--json", default=None,
                   help="where to write (default: bench-results/engine.json, or engine-shared-prefix.json)")
    p.add_argument("--skip-transformers", action="store_true", help="only the pagefleet modes")
    p.add_argument("--quick", action="store_true", help="a 32-request trace, for a smoke run")
    p.add_argument("--device", default="auto",
                   help="long-tailed trace: where pagefleet and transformers both run (auto: cuda where "
                        "there is one, else cpu)")
    p.add_argument("--trace", default="long-tailed", choices=("long-tailed", "shared-prefix"),
                   help="shared-prefix: prefix caching on vs off (see the module docstring)")
    add_shared_prefix_args(p, num_groups=4, prompts_per_group=16, system_prompt_len=1024, question_len=32,
                           output_len=16)
    p.add_argument("--repeats", type=int, default=2,
                   help="shared-prefix: on/off pairs of the default trace, interleaved (the best of each counts)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 32
    if args.trace == "shared-prefix":
        return run_shared_prefix(args)
    args.json = args.json or "bench-results/engine.json"
    from pagefleet.worker.executor import resolve_device

    try:
        device = str(resolve_device(args.device))
    except ValueError as e:
        p.error(f"--device {args.device}: {e}")
    torch.manual_seed(0)
    trace = Trace.long_tailed(args.num_requests, args.seed, long_fraction=args.long_fraction,
                              short=tuple(args.short), long=tuple(args.long))
    from pagefleet.worker.models.loader import save_tiny

    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(save_tiny(Path(tmp) / "tiny"))  # the same weights, readable by transformers
        # First, in a process that has not yet run `transformers`: a serving worker never
        # imports it, and after its runs the same steps cost ~0.4 ms more here.
        overhead = step_overhead(ckpt, device=device)
        results.append(run_pagefleet(ckpt, trace, "continuous", args.max_num_seqs, args.block_size, device=device))
        results.append(run_pagefleet(ckpt, trace, "static", args.max_num_seqs, args.block_size, device=device))
        if not args.skip_transformers:
            results.append(run_hf_padded(ckpt, trace, args.max_num_seqs, device))
            try:
                results.append(run_hf_continuous(ckpt, trace, args.max_num_seqs, device))
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
        **header("engine", "pagefleet bench engine", torch=torch.__version__, torch_threads=torch.get_num_threads(),
                 device=device, device_name=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"),
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


def run_shared_prefix(args) -> int:
    """Prefix caching on vs off: the shared-prefix trace, the default trace, the step overhead."""
    from pagefleet.worker.models.loader import save_tiny

    torch.manual_seed(0)
    sp = Trace.shared_prefix(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                             args.gsp_question_len, args.gsp_output_len, args.seed)
    lt = Trace.long_tailed(args.num_requests, args.seed, long_fraction=args.long_fraction,
                           short=tuple(args.short), long=tuple(args.long))
    cont = (args.max_num_seqs, args.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(save_tiny(Path(tmp) / "tiny"))
        overhead = {on: step_overhead(ckpt, enable_prefix_caching=on) for on in (False, True)}
        warm = Trace.shared_prefix(2, 4, 128, 8, 4, args.seed + 1)  # first runs pay one-time costs
        for on in (False, True):
            run_pagefleet(ckpt, warm, "continuous", *cont, enable_prefix_caching=on)
        shared = {on: run_pagefleet(ckpt, sp, "continuous", *cont, enable_prefix_caching=on) for on in (False, True)}
        default: dict[bool, list[Result]] = {False: [], True: []}
        for _ in range(max(1, args.repeats)):  # interleaved: load on the machine hits both alike
            for on in (False, True):
                default[on].append(run_pagefleet(ckpt, lt, "continuous", *cont, enable_prefix_caching=on))
    best = {on: min(rs, key=lambda r: r.seconds) for on, rs in default.items()}
    summary = {
        "shared_prefix_throughput_on_over_off": shared[True].tokens_per_second / shared[False].tokens_per_second,
        "shared_prefix_ttft_p50_off_over_on": shared[False].ttft_p50_s / shared[True].ttft_p50_s,
        "shared_prefix_ttft_p90_off_over_on": shared[False].ttft_p90_s / shared[True].ttft_p90_s,
        "shared_prefix_hit_rate": shared[True].prefix_cache_hit_rate,
        "default_trace_throughput_cost": 1 - best[True].tokens_per_second / best[False].tokens_per_second,
        "step_overhead_off": overhead[False],
        "step_overhead_on": overhead[True],
    }
    report = {
        **header("engine-shared-prefix", "pagefleet bench engine --trace shared-prefix", torch=torch.__version__,
                 torch_threads=torch.get_num_threads()),
        "trace": {"groups": args.gsp_num_groups, "prompts_per_group": args.gsp_prompts_per_group,
                  "system_len": args.gsp_system_prompt_len, "question_len": args.gsp_question_len,
                  "output_len": args.gsp_output_len, "seed": args.seed, "max_num_seqs": args.max_num_seqs,
                  "block_size": args.block_size, "useful_tokens": sp.useful_tokens,
                  "prompt_tokens": sum(len(x) for x in sp.prompts)},
        "default_trace": {"num_requests": args.num_requests, "useful_tokens": lt.useful_tokens,
                          "repeats": max(1, args.repeats)},
        "results": [asdict(r) for r in shared.values()],
        "default_trace_results": [asdict(r) for on in (False, True) for r in default[on]],
        "summary": summary,
    }
    out = Path(args.json or "bench-results/engine-shared-prefix.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nshared-prefix trace: {args.gsp_num_groups} groups x {args.gsp_prompts_per_group} prompts, system "
          f"{args.gsp_system_prompt_len} + question {args.gsp_question_len} tokens, {args.gsp_output_len} out; "
          f"max_num_seqs {args.max_num_seqs}, block_size {args.block_size}; all arrive at once")
    print("| prefix caching | seconds | output tok/s | TTFT p50 (s) | TTFT p90 (s) | hit rate |\n|---|---|---|---|---|---|")
    for on, r in shared.items():
        rate = f"{r.prefix_cache_hit_rate:.1%}" if r.prefix_cache_hit_rate is not None else "-"
        print(f"| {'on' if on else 'off'} | {r.seconds:.2f} | {r.tokens_per_second:.1f} | "
              f"{r.ttft_p50_s:.3f} | {r.ttft_p90_s:.3f} | {rate} |")
    print(f"on / off: throughput {summary['shared_prefix_throughput_on_over_off']:.2f}x, TTFT p50 "
          f"{summary['shared_prefix_ttft_p50_off_over_on']:.2f}x lower, p90 "
          f"{summary['shared_prefix_ttft_p90_off_over_on']:.2f}x lower")
    print(f"\ndefault trace ({args.num_requests} requests, nothing shared), best of {max(1, args.repeats)}:")
    print("| prefix caching | seconds (each run) | useful tok/s (best) |\n|---|---|---|")
    for on in (False, True):
        runs = ", ".join(f"{r.seconds:.2f}" for r in default[on])
        print(f"| {'on' if on else 'off'} | {runs} | {best[on].tokens_per_second:.1f} |")
    print(f"cost of caching: {summary['default_trace_throughput_cost']:+.1%} throughput")
    for on in (False, True):
        o = overhead[on]
        print(f"step at {o['num_running']} running, caching {'on' if on else 'off'}: non-model "
              f"{o['non_model_ms_p50']:.2f} ms wall, {o['non_model_cpu_ms_p50']:.2f} ms CPU p50, "
              f"{o['non_model_cpu_ms_mean']:.2f} ms CPU mean (model {o['model_ms_p50']:.2f} ms)")
    print(f"JSON: {out}")
    return 0
