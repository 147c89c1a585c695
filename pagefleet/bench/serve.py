"""``pagefleet bench serve``: the cluster against the in-process engine, on one seeded trace.

Both runs replay the same requests with the same arrival times (Poisson at ``--rate``
requests/s, or ``--concurrency`` requests in flight) and time every token at the
client: throughput, TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99) and goodput
(requests/s meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``). The cluster run goes
through a local cluster with one worker (or ``--target``, a running gateway); the
in-process run drives an ``Engine`` in this process. A third, sequential probe sends
one short request at a time to both and reports the TTFT that the gateway -> Redis ->
scheduler -> worker path adds. Writes a table, JSON (``--json``) and a PNG plot
(``--plot``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagefleet.common.service import EnvArgumentParser


@dataclass(slots=True)
class TraceRequest:
    prompt: str
    max_tokens: int
    arrival_s: float  # offset from the start (rate mode); 0 in concurrency mode


@dataclass(slots=True)
class Timing:
    send: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per message: (time, num tokens)
    token_counts: list[int] = field(default_factory=list)
    ok: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.send

    @property
    def tpot(self) -> float | None:
        n = self.num_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def make_trace(args) -> list[TraceRequest]:
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    for _ in range(args.num_requests):
        n = rng.randint(args.prompt_len[0], args.prompt_len[1])
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
        if args.rate:
            t += rng.expovariate(args.rate)
        out.append(TraceRequest(prompt, rng.randint(args.output_len[0], args.output_len[1]), t))
    return out


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.start = time.monotonic()

    def tick(self) -> None:
        self.done += 1
        width = 30
        fill = int(width * self.done / self.total)
        rate = self.done / max(1e-9, time.monotonic() - self.start)
        sys.stderr.write(f"\r{self.label:<12} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"{rate:5.1f} req/s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# -- the cluster ------------------------------------------------------------------------------
async def run_cluster(target: str, trace: list[TraceRequest], concurrency: int | None) -> tuple[list[Timing], float]:
    from pagefleet.client import AsyncClient

    timings = [Timing() for _ in trace]
    bar = Progress(len(trace), "cluster")
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    async with AsyncClient(target) as c:
        start = time.perf_counter()

        async def one(i: int, r: TraceRequest) -> None:
            if sem is None:
                await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            else:
                await sem.acquire()
            t = timings[i]
            t.send = time.perf_counter()
            try:
                async for msg in c.generate_stream(r.prompt, max_tokens=r.max_tokens, temperature=0,
                                                   ignore_eos=True):
                    if msg.token_ids:
                        t.token_times.append(time.perf_counter())
                        t.token_counts.append(len(msg.token_ids))
                    if msg.finish_reason:
                        t.ok = msg.finish_reason in (1, 2)
            finally:
                if sem is not None:
                    sem.release()
                bar.tick()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
        return timings, time.perf_counter() - start


# -- the in-process engine ------------------------------------------------------------------------
def run_engine(engine, trace: list[TraceRequest], concurrency: int | None) -> tuple[list[Timing], float]:
    from pagefleet import SamplingParams

    timings = [Timing() for _ in trace]
    bar = Progress(len(trace), "in-process")
    start = time.perf_counter()
    nxt = 0
    live = 0
    ids: dict[str, int] = {}
    while nxt < len(trace) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(trace) and (
            (concurrency and live < concurrency) or (not concurrency and start + trace[nxt].arrival_s <= now)
        ):
            r = trace[nxt]
            rid = engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                                              ignore_eos=True))
            ids[rid] = nxt
            timings[nxt].send = start + r.arrival_s if not concurrency else now
            nxt += 1
            live += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.001, start + trace[nxt].arrival_s - time.perf_counter())))
            continue
        deltas = engine.step()
        t_now = time.perf_counter()
        for d in deltas:
            t = timings[ids[d.request_id]]
            if d.token_ids:
                t.token_times.append(t_now)
                t.token_counts.append(len(d.token_ids))
            if d.finish_reason:
                t.ok = d.finish_reason in ("stop", "length")
                live -= 1
                bar.tick()
    return timings, time.perf_counter() - start


def probe_engine(engine, prompts: list[str]) -> list[float]:
    from pagefleet import SamplingParams

    out = []
    for p in prompts:
        t0 = time.perf_counter()
        engine.add_request(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while not any(d.token_ids for d in engine.step()):
            pass
        out.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return out


async def probe_cluster(target: str, prompts: list[str]) -> list[float]:
    from pagefleet.client import AsyncClient

    out = []
    async with AsyncClient(target) as c:
        for p in prompts:
            t0 = time.perf_counter()
            async for msg in c.generate_stream(p, max_tokens=1, temperature=0, ignore_eos=True):
                if msg.token_ids:
                    out.append(time.perf_counter() - t0)
    return out


# -- numbers -------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(timings: list[Timing], wall_s: float, slo_ttft: float, slo_tpot: float) -> dict:
    done = [t for t in timings if t.ok and t.token_times]
    toks = sum(t.num_tokens for t in done)
    ttft = [t.ttft for t in done]
    tpot = [t.tpot for t in done if t.tpot is not None]
    itl = [x for t in done for x in t.itls()]
    e2e = [t.e2e for t in done]
    good = [t for t in done if t.ttft <= slo_ttft and (t.tpot or 0) <= slo_tpot]

    def stats(v):
        return {"p50_ms": pct(v, 50) * 1e3, "p90_ms": pct(v, 90) * 1e3, "p99_ms": pct(v, 99) * 1e3}

    return {
        "num_requests": len(timings), "num_completed": len(done), "wall_s": wall_s,
        "output_tokens_per_s": toks / wall_s, "requests_per_s": len(done) / wall_s,
        "goodput_requests_per_s": len(good) / wall_s,
        "ttft": stats(ttft), "tpot": stats(tpot), "itl": stats(itl), "e2e": stats(e2e),
    }


def table(results: dict) -> str:
    runs = [k for k in ("in_process", "cluster") if k in results]
    lines = [f"{'metric':<28}" + "".join(f"{r:>16}" for r in runs)]
    lines.append(f"{'output tokens/s':<28}" + "".join(f"{results[r]['output_tokens_per_s']:>16.1f}" for r in runs))
    lines.append(f"{'requests/s':<28}" + "".join(f"{results[r]['requests_per_s']:>16.2f}" for r in runs))
    lines.append(f"{'goodput requests/s':<28}" + "".join(f"{results[r]['goodput_requests_per_s']:>16.2f}"
                                                          for r in runs))
    for m in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50_ms", "p90_ms", "p99_ms"):
            lines.append(f"{m.upper() + ' ' + q:<28}" + "".join(f"{results[r][m][q]:>16.2f}" for r in runs))
    return "\n".join(lines)


def plot(results: dict, timings: dict[str, list[Timing]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, ts in timings.items():
        done = [t for t in ts if t.ok and t.token_times]
        for ax, values, label in ((axes[0], [t.ttft * 1e3 for t in done], "TTFT (ms)"),
                                  (axes[1], [x * 1e3 for t in done for x in t.itls()], "ITL (ms)"),
                                  (axes[2], [t.e2e * 1e3 for t in done], "end-to-end (ms)")):
            s = sorted(values)
            ax.plot(s, [i / max(1, len(s) - 1) for i in range(len(s))], label=name)
            ax.set_xlabel(label)
            ax.set_ylabel("CDF")
    axes[0].legend()
    fig.suptitle("pagefleet bench serve: " + ", ".join(
        f"{k} {v['output_tokens_per_s']:.0f} tok/s" for k, v in results.items() if isinstance(v, dict)
        and "output_tokens_per_s" in v))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="pagefleet bench serve", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64, help="requests in the trace")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 16 without --rate)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0, help="seed of the trace")
    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    p.add_argument("--device", default="auto", help="device of the engine (both runs)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (both runs)")
    p.add_argument("--target", default=None, help="a running gateway instead of a local one-worker cluster")
    p.add_argument("--skip-in-process", action="store_true", help="run the cluster only")
    p.add_argument("--num-probes", type=int, default=30, help="sequential one-token requests for the path probe")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput: TTFT limit")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT limit")
    p.add_argument("--json", default="bench-results/serve.json", help="where the JSON goes ('' for nowhere)")
    p.add_argument("--plot", default="bench-results/serve.png", help="where the PNG goes ('' for nowhere)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.rate is None and args.concurrency is None:
        args.concurrency = 16
    trace = make_trace(args)
    probes = [f"probe {i}: " + "z" * 32 for i in range(args.num_probes)]
    results: dict = {"config": {k: v for k, v in vars(args).items()}}
    timings: dict[str, list[Timing]] = {}

    if not args.skip_in_process:
        from pagefleet import Engine

        engine = Engine(model=args.model, device=args.device, num_blocks=args.num_blocks)
        warm = [TraceRequest(r.prompt, 8, 0.0) for r in trace[:16]]
        _on_thread(run_engine, engine, warm, 16)  # first touches of the KV pool, allocator warm-up
        probe_engine(engine, probes[:3])
        # On a thread of its own, as in the worker.
        ts, wall = _on_thread(run_engine, engine, trace, args.concurrency)
        results["in_process"] = summarize(ts, wall, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        timings["in_process"] = ts
        results["probe_in_process_ttft_ms"] = [x * 1e3 for x in _on_thread(probe_engine, engine, probes)]
        del engine

    cluster = None
    target = args.target
    if target is None:
        from pagefleet.launcher import ClusterConfig, LocalCluster

        worker_args = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
        cluster = LocalCluster(ClusterConfig(port=0, num_workers=1, model=args.model, device=args.device,
                                             worker_args=worker_args, log_level="warning"))
        cluster.start()
        target = cluster.gateway_target
    try:
        warm = [TraceRequest(r.prompt, 8, 0.0) for r in trace[:16]]
        asyncio.run(run_cluster(target, warm, 16))  # the same warm-up as in-process
        asyncio.run(probe_cluster(target, probes[:3]))
        ts, wall = asyncio.run(run_cluster(target, trace, args.concurrency))
        results["cluster"] = summarize(ts, wall, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        timings["cluster"] = ts
        results["probe_cluster_ttft_ms"] = [x * 1e3 for x in asyncio.run(probe_cluster(target, probes))]
    finally:
        if cluster is not None:
            cluster.stop()

    print(table({k: v for k, v in results.items() if k in ("in_process", "cluster")}))
    if "in_process" in results:
        ratio = results["cluster"]["output_tokens_per_s"] / results["in_process"]["output_tokens_per_s"]
        added = pct(results["probe_cluster_ttft_ms"], 50) - pct(results["probe_in_process_ttft_ms"], 50)
        results["cluster_throughput_ratio"] = ratio
        results["path_added_ttft_p50_ms"] = added
        print(f"\ncluster throughput / in-process: {ratio * 100:.1f} %  (target >= 90 %)")
        print(f"TTFT added by gateway -> redis -> scheduler -> worker, p50 of {args.num_probes} sequential "
              f"one-token requests: {added:.2f} ms  (target <= 5 ms)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2, default=lambda o: asdict(o)))
        print(f"JSON: {args.json}")
    if args.plot:
        print(f"plot: {args.plot}" if plot(results, timings, Path(args.plot)) else "plot: skipped (no matplotlib)")
    return 0


def _on_thread(fn, *args):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), name="engine")
    t.start()
    t.join()
    return out[0]
