"""``pagefleet bench scheduler``: the one scheduler against a fleet of simulated workers.

For each point of ``--workers`` x ``--queued`` (default 16, 64, 256 x 1k, 10k, 50k), on
this machine: a fresh Redis, that many simulated workers (``pagefleet worker --engine sim
--count``, up to ``--workers-per-process`` a process; each reports every 100 ms and on
every large change), then ``--queued`` requests written into the requests stream at once
(as gateways would: one ``XADD`` each), and only then the scheduler (``pagefleet
scheduler``), so its global queue holds them all while it places them. Requests are short
(``--prompt-len`` tokens, ``--max-tokens`` out); the fleet has a seat for every queued
request (256 sequences and 4,096 blocks a worker), so the workers' room is not what limits
placement. The workers run at ``--time-scale 0.05`` (twenty times slower than an H100): a
fleet stepping in real time, or as fast as it can (``inf``), needs more CPU than a small
machine has, and the scheduler measured would be the one starved by its own fleet.

Measured, from the first placement to the last request's final write:

* placements per second (the scheduler's admissions counter over that window);
* decision latency p50 / p99 (its histogram, interpolated inside buckets);
* the scheduler process's CPU seconds per second of wall time (``/proc``);
* Redis commands per request (``INFO commandstats``, reset before the writes: the
  gateway-side ``XADD`` included), in all and by command.

Targets at 256 workers and 50k queued: >= 5,000 placements/s, decision p99 <= 1 ms, the
scheduler below one core. Everything shares this machine (workers, Redis, the scheduler):
on a small one the figures are a floor, set by whichever of them runs out of CPU first.

``placement_core`` (each point's ``placement_core`` in the JSON) measures the scheduler's
own logic apart from all that, in this process: the same queue, rounds of placement, worker
table and prefix index, with real reports at 10 Hz per worker, driven at 5,000 placements/s
of simulated time: decisions per CPU second, their latency, and the CPU it takes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pagefleet.bench.prometheus import scrape

from ..results import header, int_list

DEFAULT_WORKERS = (16, 64, 256)
DEFAULT_QUEUED = (1000, 10_000, 50_000)
TARGETS = {"placements_per_s": 5000.0, "decision_p99_ms": 1.0, "scheduler_cpu_per_s": 1.0}


# -- reading the scheduler ---------------------------------------------------------------------
def histogram(sample: dict[str, float], name: str) -> list[tuple[float, float]]:
    """``(upper bound, cumulative count)`` of histogram ``name``, ascending."""
    prefix = f"{name}_bucket{{le=\""
    rows = [(float(k[len(prefix):-2]), v) for k, v in sample.items() if k.startswith(prefix)]
    return sorted(rows)


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, linear inside its bucket (as PromQL's
    ``histogram_quantile``); None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - below) / (count - below) if count > below else 1.0)
        lo, below = le, count
    return lo


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu(redis) -> float:
    """CPU seconds the Redis server has used (user + system)."""
    info = redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commandstats(redis) -> dict[str, int]:
    """Calls per command since the last ``CONFIG RESETSTAT``."""
    info = redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


# -- the requests ------------------------------------------------------------------------------
def write_requests(redis, keys, n: int, prompt_len: int, max_tokens: int, block_size: int, seed: int) -> None:
    """``n`` generate entries in the requests stream, as a gateway writes them (pipelined)."""
    from pagefleet.common.blocks import block_hashes
    from pagefleet.common.redis import encode_request_entry
    from pagefleet.protos import cluster_pb2, generation_pb2

    rng = random.Random(seed)
    pipe = redis.pipeline(transaction=False)
    now_ms = int(time.time() * 1000)
    for i in range(n):
        prompt = [256] + [rng.randrange(32, 127) for _ in range(prompt_len - 1)]
        msg = cluster_pb2.AssignRequest(
            request_id=f"bench-{i}", prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True),
            block_hashes=block_hashes(prompt, block_size), hash_block_size=block_size,
        )
        pipe.xadd(keys.requests, encode_request_entry(msg, now_ms))
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


# -- one point ---------------------------------------------------------------------------------
def run_point(num_workers: int, num_queued: int, args, log_dir: Path) -> dict:
    import redis as redis_lib

    from pagefleet.common.redis import Keys, RedisServer
    from pagefleet.launcher import ClusterConfig, LocalCluster

    worker_args = ["--engine", "sim", "--sim-profile", args.sim_profile, "--time-scale", str(args.time_scale),
                   "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
                   "--num-swap-blocks", "0"]
    with RedisServer() as server:
        cfg = ClusterConfig(port=0, num_workers=num_workers, redis_url=server.url, worker_args=worker_args,
                            # Workers starved of CPU for a moment on a small machine must not be
                            # declared dead, nor the scheduler miss its lease's renewal (it then
                            # stops, as it must): this measures placement, not recovery. Reports
                            # every 100 ms as its figures always had (not an eighth of --dead-after).
                            scheduler_args=["--placement", args.placement, "--policy", args.policy,
                                            "--dead-after", "10", "--lease-ms", "15000", "--report-interval", "0.1"],
                            log_dir=str(log_dir), log_level="warning", metrics_port=0,
                            workers_per_process=args.workers_per_process)
        cluster = LocalCluster(cfg)
        r = redis_lib.Redis.from_url(server.url)
        keys = Keys(cfg.namespace)
        try:
            left = num_workers
            while left > 0:
                count = min(left, args.workers_per_process)
                cluster.add_worker(count=count)
                left -= count
            _wait(lambda: r.hlen(keys.workers) >= num_workers, 180, "the workers to register", cluster)
            r.config_resetstat()
            redis_cpu = _redis_cpu(r)
            write_requests(r, keys, num_queued, args.prompt_len, args.max_tokens, 16, args.seed)
            sched = cluster.start_scheduler()
            spies = [_py_spy(sched.pid, args.profile_scheduler, f"w{num_workers}-q{num_queued}"),
                     _py_spy(cluster.procs["worker-0"].pid, args.profile_scheduler,
                             f"w{num_workers}-q{num_queued}-worker-0")]
            url = cluster.metrics_url("scheduler")
            _wait(lambda: _try_scrape(url), 60, "the scheduler's metrics", cluster)
            try:
                res = _measure(cluster, sched.pid, url, r, keys, num_workers, num_queued, args)
                res["redis_cpu_ms_per_request"] = (_redis_cpu(r) - redis_cpu) / num_queued * 1e3
                res["load_average_1m"] = os.getloadavg()[0]  # everything else on the machine
                return res
            finally:
                for spy in spies:
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(30)
        finally:
            cluster.stop()
            r.close()


def _py_spy(pid: int, folder: str | None, name: str) -> subprocess.Popen | None:
    """``py-spy record`` of the scheduler into ``folder/<name>.txt`` (collapsed stacks)."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                             "--output", str(Path(folder) / f"{name}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _try_scrape(url: str) -> dict | None:
    try:
        return scrape(url)
    except OSError:
        return None


def _wait(cond, timeout_s: float, what: str, cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        cluster.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def _measure(cluster, pid: int, url: str, r, keys, num_workers: int, num_queued: int, args) -> dict:
    admissions = "pagefleet:scheduler_admissions_total"
    latency = "pagefleet:scheduler_decision_latency_seconds"
    # (wall, CPU, sample) before the first decision (the last such sample) and once every
    # request was placed: the window the rates are over (its ends are one poll apart at worst).
    first = last = None
    zero = (time.perf_counter(), cpu_seconds(pid), {})
    max_queue = 0.0
    deadline = time.monotonic() + args.timeout
    while True:
        cluster.check_alive()
        now, cpu, sample = time.perf_counter(), cpu_seconds(pid), scrape(url)
        max_queue = max(max_queue, sample.get("pagefleet:scheduler_queue_length", 0.0))
        if first is None:
            if sample.get(f"{latency}_count", 0) > 0:
                first = zero
            else:
                zero = (now, cpu, sample)
        num_done = num_queued - r.xlen(keys.requests)  # a request's entry is deleted at its finish
        # Placed (or, for the few whose Assign was overtaken by a retry, finished) every one.
        if last is None and (sample.get(admissions, 0) >= num_queued or num_done >= num_queued):
            last = (now, cpu, sample)
        if last is not None and num_done >= num_queued:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num_workers} workers x {num_queued}: not finished in {args.timeout}s "
                               f"({int(sample.get(admissions, 0))} placed, {num_done} done)")
        time.sleep(args.poll if first is not None else 0.02)
    wall = last[0] - first[0]
    placed = last[2][admissions] - first[2].get(admissions, 0.0)
    # The histogram over the window: what the first sample had seen is taken off.
    before = dict(histogram(first[2], latency))
    window = [(le, n - before.get(le, 0.0)) for le, n in histogram(last[2], latency)]
    stats = commandstats(r)
    calls = sum(stats.values())
    p50, p99 = quantile(window, 0.5), quantile(window, 0.99)
    within_1ms = next((n for le, n in window if le >= 0.001), 0.0) / max(1.0, window[-1][1])
    return {
        "num_workers": num_workers,
        "num_queued": num_queued,
        "max_queue_length_seen": int(max_queue),
        "window_s": wall,
        "placements": int(placed),
        "placements_per_s": placed / wall if wall > 0 else None,
        "decision_p50_ms": None if p50 is None else p50 * 1e3,
        "decision_p99_ms": None if p99 is None else p99 * 1e3,
        "decisions_within_1ms": within_1ms,
        "scheduler_cpu_per_s": (last[1] - first[1]) / wall if wall > 0 else None,
        "redis_commands_per_request": calls / num_queued,
        "redis_commands_by_name_per_request": {k: v / num_queued for k, v in
                                                sorted(stats.items(), key=lambda kv: -kv[1])},
    }


# -- the placement core, in process -------------------------------------------------------------
def placement_core(num_workers: int, num_queued: int, *, rate: float = 5000.0, lifetime_s: float = 1.0,
                   report_hz: float = 10.0, prompt_len: int = 32, max_tokens: int = 2, seed: int = 0) -> dict:
    """The scheduler's own work at ``rate`` placements/s, without its processes: the global
    queue, rounds of placement (``Placer.round``), claims on the worker table, the prefix
    index, and every worker's report at ``report_hz`` (real ``OccupancyReport``s, deltas as the
    scheduler asks for, applied as it applies them). Requests leave ``lifetime_s`` after placement. Only the
    scheduler's calls are timed (``time.thread_time``); building the reports is not.
    """
    from pagefleet.common.blocks import block_hashes
    from pagefleet.protos import cluster_pb2, generation_pb2
    from pagefleet.scheduler.placement import PlacementConfig, Placer
    from pagefleet.scheduler.prefix_index import PrefixIndex
    from pagefleet.scheduler.queue import GlobalQueue, Pending
    from pagefleet.scheduler.workers import WorkerEntry
    from pagefleet.worker.report import Holdings

    rng = random.Random(seed)
    num_blocks = 4096

    def report(w: WorkerEntry) -> cluster_pb2.OccupancyReport:
        held = {rid: 3 for rid in w.placed}
        stats = SimpleNamespace(request_ids=list(held), blocks_per_request=held)
        return cluster_pb2.OccupancyReport(
            worker_id=w.worker_id, num_blocks=num_blocks, num_free_blocks=num_blocks - 3 * len(held),
            block_size=16, max_num_seqs=256, max_model_len=8192, num_running=len(held),
            **holdings[w.worker_id].take(stats))

    workers = [WorkerEntry(f"w{i:03d}", "sim") for i in range(num_workers)]
    holdings = {w.worker_id: Holdings() for w in workers}  # the scheduler asks for delta reports
    for w in workers:
        w.apply_report(report(w))
    queue, index = GlobalQueue("fcfs"), PrefixIndex()
    placer = Placer(PlacementConfig("prefix"), index)
    for i in range(num_queued):
        prompt = [256] + [rng.randrange(32, 127) for _ in range(prompt_len - 1)]
        msg = cluster_pb2.AssignRequest(
            request_id=f"r{i}", prompt_token_ids=prompt, block_hashes=block_hashes(prompt, 16), hash_block_size=16,
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))
        queue.push(Pending(f"r{i}", "", msg, i, enqueued_at=0.0))
    leaving: list[tuple[float, str, WorkerEntry]] = []  # (when, request id, worker)
    next_report = [(k / (num_workers * report_hz), w) for k, w in enumerate(workers)]
    latencies, cpu, now, placed = [], 0.0, 0.0, 0
    while queue:
        c0 = time.thread_time()
        while leaving and leaving[0][0] <= now:  # the done stream: forget
            _, rid, w = leaving.pop(0)
            w.unplace(rid)
            index.release(rid)
        cpu += time.thread_time() - c0
        due = [(t, w) for t, w in next_report if t <= now]
        if due:
            built = [(w, report(w)) for _, w in due]
            next_report = [(t + 1 / report_hz if t <= now else t, w) for t, w in next_report]
            c0 = time.thread_time()
            for w, r in built:
                w.apply_report(r)
                index.apply_events(w.worker_id, r.stored_block_hashes, r.evicted_block_hashes, r.block_hashes_reset)
            cpu += time.thread_time() - c0
        c0 = t0 = time.thread_time()
        rnd = placer.round(workers)
        for _ in range(256):  # one round, as the scheduler's
            p = queue.peek()
            if p is None:
                break
            placement = rnd.choose(p, 64)
            if placement is None:
                break
            queue.remove(p.request_id)
            w = placement.worker
            w.place(p, 64, placement.num_shared_blocks)
            index.hold(w.worker_id, p.request_id, p.assign.block_hashes)
            t1 = time.thread_time()
            latencies.append(t1 - t0)
            t0 = t1
            leaving.append((now + lifetime_s, p.request_id, w))
            placed += 1
            now += 1 / rate
        else:
            cpu += time.thread_time() - c0
            continue
        cpu += time.thread_time() - c0
        if queue and (placement is None):
            now = max(now, leaving[0][0] if leaving else now)  # nothing fits: wait for room
    latencies.sort()
    return {
        "num_workers": num_workers, "num_queued": num_queued, "target_rate": rate,
        "placements": placed, "simulated_s": now,
        "decisions_per_cpu_s": placed / cpu if cpu else None,
        "decision_p50_ms": latencies[len(latencies) // 2] * 1e3,
        "decision_p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
        "cpu_per_s_at_rate": cpu / now if now else None,
    }


# -- the command -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench scheduler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int_list, default=list(DEFAULT_WORKERS), help="comma-separated worker counts")
    p.add_argument("--queued", type=int_list, default=list(DEFAULT_QUEUED), help="comma-separated queue depths")
    p.add_argument("--workers-per-process", type=int, default=64, help="simulated workers per worker process")
    p.add_argument("--sim-profile", default="llama-3-8b-h100", help="the workers' step-time profile")
    p.add_argument("--time-scale", type=float, default=0.05,
                   help="the workers' simulated seconds per real second (inf: as fast as they can)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per worker")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--max-tokens", type=int, default=2, help="output tokens of every request")
    p.add_argument("--placement", default="prefix", help="the scheduler's --placement")
    p.add_argument("--policy", default="fcfs", help="the scheduler's --policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=1.0,
                   help="seconds between reads of the scheduler's metrics (each read costs it: 256 workers' gauges)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one point may take")
    p.add_argument("--json", default="bench-results/scheduler.json", help="where to write the results")
    p.add_argument("--log-dir", default=None, help="keep the components' logs here (default: a temp dir)")
    p.add_argument("--profile-scheduler", default=None, metavar="DIR",
                   help="record the scheduler and the first worker process with py-spy (collapsed stacks, "
                        "a file each a point) into DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"JSON: {args.json} (rewritten after every point)", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.workers:
            for q in args.queued:
                log_dir = Path(args.log_dir or tmp) / f"w{w}-q{q}"
                log_dir.mkdir(parents=True, exist_ok=True)
                res = run_point(w, q, args, log_dir)
                res["placement_core"] = placement_core(w, q, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                                                       seed=args.seed)
                results.append(res)
                print(_row(res), flush=True)
                _write(args, results)
    _write(args, results)
    return 0


def _write(args, results: list[dict]) -> None:
    """The report so far (rewritten after every point)."""
    report = {
        **header("scheduler", "pagefleet bench scheduler"),
        "config": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                   for k, v in vars(args).items() if k not in ("json", "log_dir")},
        "targets": TARGETS,
        "results": results,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def _row(r: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    c = r["placement_core"]
    return (f"workers {r['num_workers']:>4} queued {r['num_queued']:>6}: {f(r['placements_per_s'], '8.0f')} "
            f"placements/s, decision p50 {f(r['decision_p50_ms'], '.3f')} ms p99 {f(r['decision_p99_ms'], '.3f')} ms, "
            f"scheduler CPU {f(r['scheduler_cpu_per_s'], '.2f')} s/s, "
            f"Redis {r['redis_commands_per_request']:.1f} commands/request (max queue {r['max_queue_length_seen']}); "
            f"in process: {f(c['decisions_per_cpu_s'], '.0f')} decisions/CPU-s, p99 {c['decision_p99_ms']:.3f} ms, "
            f"{f(c['cpu_per_s_at_rate'], '.2f')} CPU-s/s at {c['target_rate']:.0f}/s")
