"""``pagefleet bench token-path``: what one output token costs the cluster between GPU and client.

It starts a local cluster on simulated workers (``--engine sim``: no model time is counted;
``--workers`` of them in one process by default, stepping at ``--time-scale``), drives
``--requests`` streams of ``--max-tokens`` tokens, ``--concurrency`` at a time, over gRPC or
the OpenAI HTTP door (``--backend``), from a client in its own process (``token_client``),
and prints, per output token:

* Redis commands (``INFO commandstats``: EVALSHA and every command a script calls), in all
  and by command, with each command's own time (its ``usec``: a script's includes the commands
  it calls; what is left of Redis CPU is its event loop and sockets); Redis CPU (``INFO cpu``);
* CPU of the gateway, scheduler and worker processes (``/proc``), the workers' also by thread
  (``worker_cpu_us_by_thread``: ``engine``, ``output-writer``, ``main``: the event loop, grpc's)
  and less the simulated model's (``worker_cpu_us_outside_model``: the workers' host path, the
  model's cost model and token draw left out as a real worker's forward pass and sampler are;
  the model's share is the workers' ``pagefleet:sim_model_cpu_seconds_total``);
* delivered tokens/s, TTFT and ITL p50/p99 (the client's clocks), how many streams came back
  whole (``token_client``), the workers' steps per output write and output tokens
  per write (every worker's writes, as Redis counts them): a write is a Redis command, so
  Redis's CPU a token follows the tokens a write, 16 at 16 running a worker and fewer when
  requests wait to start (``redis_cpu_us_per_write``: Redis's CPU over those writes);
* Redis memory per request, in flight (sampled while the run holds its most requests) and
  kept after all finished (what stays for a retry's replay until its TTL).

``--modes stream,fixed``: ``stream`` is the run above; ``fixed`` the same with 1-token
outputs, whose figures per request are the fixed cost of a request. In the same run, **the
floor**: a trivial grpcio servicer (``--backend grpc``) or uvicorn SSE endpoint (``openai``)
streaming canned messages of the same size to the same client (``floor.py``); its CPU per
message is what a relay is compared with. After a ``stream`` run, **the floor at its pace**
(``floor_paced`` in its JSON): the same server sending messages of the tokens the run's
messages carried on average, each stream's as far apart as the run's were (``message_gap_ms_p50``), so
its writes wait between messages as the gateway's do; ``gateway_cpu_vs_paced_floor`` is the
gateway's CPU a token over that floor's.

``--python PATH`` runs the cluster's processes with another interpreter (a venv where an
older checkout is installed), so one machine measures before and after side by side.

``--shards N`` serves the model from N shards, a scheduler each, the workers split over them;
``--redis-cluster`` runs on a throwaway Redis Cluster of ``--primaries`` primaries (1, or 3 and
more) whose shards' hash tags land on different primaries: Redis CPU and commands per token on
each primary (its shards' tokens only), scheduler CPU per placement (``token_path_shards``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagefleet.bench import prometheus

TARGETS = {"redis_commands_per_token": 0.25, "redis_cpu_us_per_token": 2.0,
           "gateway_cpu_vs_floor": 1.25, "worker_cpu_us_per_token": 8.0, "fixed_cpu_us_per_request": 300.0}


# -- reading processes and Redis ----------------------------------------------------------------
def tree_pids(pid: int) -> list[int]:
    """``pid`` and every live descendant (a gateway's ``--processes`` children included)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return out


def _stat_seconds(path: str) -> float:
    """User and system CPU seconds from a ``/proc`` ``stat`` file (a process's or a thread's)."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree_pids(pid):
        try:
            total += _stat_seconds(f"/proc/{p}/stat")
        except OSError:
            continue
    return total


def thread_cpu(pids: list[int]) -> dict[tuple[int, str], tuple[str, float]]:
    """Every thread of ``pids`` (and their descendants), by (process, thread id): the name the
    OS knows it by (``main`` for a process's first thread, its event loop; else its ``comm``: the
    worker names its ``engine`` and ``output-writer`` threads, grpc names its own) and its CPU
    seconds (``schedstat``'s nanoseconds; a thread's clock ticks where that is missing)."""
    out: dict[tuple[int, str], tuple[str, float]] = {}
    for pid in pids:
        for p in tree_pids(pid):
            try:
                tids = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for t in tids:
                task = f"/proc/{p}/task/{t}"
                try:
                    name = "main" if t == str(p) else Path(f"{task}/comm").read_text().strip()
                    try:
                        seconds = int(Path(f"{task}/schedstat").read_text().split()[0]) / 1e9
                    except (OSError, IndexError, ValueError):
                        seconds = _stat_seconds(f"{task}/stat")
                except OSError:  # the thread ended
                    continue
                out[(p, t)] = (name, seconds)
    return out


def cpu_by_thread(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` readings, summed by thread name (a thread that
    started between them counts from zero; one that ended between them is not counted)."""
    out: dict[str, float] = {}
    for key, (name, seconds) in after.items():
        was = before.get(key)
        used = seconds - (was[1] if was is not None and was[0] == name else 0.0)
        out[name] = out.get(name, 0.0) + max(0.0, used)
    return out


def redis_cpu(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


_WORKER_LABEL = re.compile(r'worker="(?:[^"\\]|\\.)*",?')


def scrape(url: str) -> dict[str, float]:
    """A component's metrics, a process's workers summed (its samples carry each one's
    ``worker``); empty when it does not answer."""
    try:
        samples = prometheus.scrape(url)
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, value in samples.items():
        name = _WORKER_LABEL.sub("", name).replace(",}", "}").replace("{}", "")
        out[name] = out.get(name, 0.0) + value
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


# -- one load -------------------------------------------------------------------------------------
def drive(cfg: dict, tmp: Path) -> dict:
    """Run the client process on ``cfg``; its JSON result."""
    cfg = dict(cfg, out=str(tmp / f"client-{cfg['run']}.json"))
    subprocess.run([sys.executable, "-m", "pagefleet.bench.token_client", json.dumps(cfg)], check=True)
    return json.loads(Path(cfg["out"]).read_text())


def summarize(streams: list[dict]) -> dict:
    ttft = [s["ttft_s"] for s in streams if s["ttft_s"] is not None]
    itl = [x for s in streams for x in s["itl_s"]]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for s in streams:
        if not s["ok"]:
            key = s["error"].split(":")[0][:60]
            errors[key] = errors.get(key, 0) + 1
            examples.setdefault(key, s["error"][:300])
    return {
        "num_streams": len(streams),
        "num_whole": sum(s["ok"] for s in streams),
        "errors": errors,
        "error_examples": examples,
        # The first failed streams: where each ended (tokens and messages seen) and when (unix s).
        "failures": [{"stream": i, "error": s["error"][:300], "num_tokens": s["num_tokens"],
                      "num_messages": s["num_messages"], "ttft_s": s["ttft_s"], "span_unix": s.get("span_unix")}
                     for i, s in enumerate(streams) if not s["ok"]][:20],
        "num_tokens": sum(s["num_tokens"] for s in streams),
        "num_messages": sum(s["num_messages"] for s in streams),
        "ttft_p50_ms": _ms(_pct(ttft, 0.5)), "ttft_p99_ms": _ms(_pct(ttft, 0.99)),
        "itl_p50_ms": _ms(_pct(itl, 0.5)), "itl_p99_ms": _ms(_pct(itl, 0.99)),
        # A stream's messages apart, its first to its last over the gaps between them (the median stream).
        "message_gap_ms_p50": _ms(_pct([sum(s["itl_s"]) / (s["num_messages"] - 1)
                                        for s in streams if s["num_messages"] > 1], 0.5)),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


# -- the cluster ----------------------------------------------------------------------------------
# The scheduler's --dead-after here: workers starved of CPU for a moment are not declared dead.
DEAD_AFTER_S = 10.0


def start_cluster(args, tmp: Path, **config):
    """The local cluster of a run; ``config``: more ``ClusterConfig`` fields (Redis, shards)."""
    from pagefleet.launcher import ClusterConfig, LocalCluster

    worker_args = ["--engine", "sim", "--sim-profile", args.sim_profile, "--time-scale", str(args.time_scale),
                   "--max-num-seqs", str(args.max_num_seqs), "--num-swap-blocks", "0"]
    if args.sim_wait != "sleep":
        worker_args += ["--sim-wait", args.sim_wait]
    # Every stream of the run may wait in the queue at once: none is shed.
    gateway_args = ["--max-queue", str(max(1024, args.concurrency))]
    if args.gateway_processes > 1:
        gateway_args += ["--processes", str(args.gateway_processes)]
    if args.stream_interval > 1:
        gateway_args += ["--stream-interval", str(args.stream_interval)]
    cfg = ClusterConfig(port=0, http_port=0 if args.backend == "openai" else None, num_workers=args.workers,
                        worker_args=worker_args, gateway_args=gateway_args,
                        scheduler_args=["--dead-after", str(DEAD_AFTER_S), "--lease-ms", "15000",
                                        *(["--report-interval", str(args.report_interval)] if args.report_interval else [])],
                        log_dir=str(args.log_dir or tmp), log_level="info" if args.log_dir else "warning", metrics_port=0,
                        workers_per_process=args.workers_per_process, python=args.python,
                        env={"OMP_NUM_THREADS": "1"}, redis_socket=getattr(args, "redis_socket", False), **config)
    return LocalCluster(cfg).start(timeout_s=180)


def kept_bytes(r, keys, run: str) -> int:
    """What Redis keeps of run ``run``'s finished requests (their ids are ``<run>-<i>``): the
    bytes of their own keys (owner record with the output record, claim; and ``out:``, where a
    tree before ``--python``'s kept the output record), until those expire. Counted key by key:
    ``used_memory`` moves by more than a short run keeps (clients' buffers)."""
    total = 0
    for pattern in (f"{keys.prefix}:out:{run}-*", keys.owner(f"{run}-*"), keys.idempotency(f"{run}-*")):
        for key in r.scan_iter(match=pattern, count=1000):
            total += int(r.memory_usage(key) or 0)
    return total


class NoOutput(RuntimeError):
    """A run that brought back nothing to measure per token or request."""


def measure_cluster(args, tmp: Path, mode: str) -> dict:
    import redis as redis_lib

    from pagefleet.common.redis import Keys

    max_tokens = args.max_tokens if mode == "stream" else 1
    cluster = start_cluster(args, tmp)
    try:
        # The way the cluster's processes reach Redis: a poll over loopback TCP would have Redis's
        # sends deliver other processes' loopback packets in its time (the kernel's softirq).
        r = redis_lib.Redis.from_url(cluster.component_redis_url)
        keys = Keys(cluster.cfg.namespace)
        target = cluster.http_url if args.backend == "openai" else cluster.gateway_target
        base = {"backend": args.backend, "target": target, "connections": args.connections,
                "prompt_len": args.prompt_len, "timeout_s": args.timeout, "model": "tiny"}
        drive(dict(base, run=f"warm-{mode}", num_requests=min(64, args.requests), concurrency=min(64, args.concurrency),
                   max_tokens=min(16, max_tokens)), tmp)
        time.sleep(1.0)
        procs = {"gateway": [cluster.procs["gateway"].pid], "scheduler": [cluster.procs["scheduler"].pid],
                 "workers": [p.pid for n, p in cluster.procs.items() if n.startswith("worker")]}
        wurl = cluster.metrics_url("worker-0")
        w0 = scrape(wurl)
        mem0 = int(r.info("memory")["used_memory"])
        r.config_resetstat()
        cpu0 = {k: sum(tree_cpu(p) for p in v) for k, v in procs.items()}
        threads0 = thread_cpu(procs["workers"])
        rcpu0 = redis_cpu(r)
        cfg = dict(base, run=mode, num_requests=args.requests, concurrency=args.concurrency, max_tokens=max_tokens)
        client = subprocess.Popen([sys.executable, "-m", "pagefleet.bench.token_client",
                                   json.dumps(dict(cfg, out=str(tmp / f"client-{mode}.json")))])
        in_flight = []  # (bytes over the baseline, requests in the system) while the run is full
        own = {"xlen": 0, "info": 2}  # the bench's own commands in the counts (the INFOs of redis_cpu)
        while client.poll() is None:
            time.sleep(0.5)
            n = int(r.xlen(keys.requests))
            own["xlen"] += 1
            if n >= args.concurrency // 2:
                in_flight.append((int(r.info("memory")["used_memory"]) - mem0, n))
                own["info"] += 1
        if client.returncode:
            raise RuntimeError(f"the client failed ({client.returncode})")
        cpu1 = {k: sum(tree_cpu(p) for p in v) for k, v in procs.items()}
        threads1 = thread_cpu(procs["workers"])
        rcpu1 = redis_cpu(r)
        cmdstats = r.info("commandstats")
        stats = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in cmdstats.items()}
        for name, n in own.items():  # the cluster's commands only
            if name in stats:
                stats[name] -= n
        stats = {k: v for k, v in stats.items() if v > 0 and k != "config"}
        usec = {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in cmdstats.items()}
        w1 = scrape(wurl)
        mem_kept = kept_bytes(r, keys, mode)
        out = json.loads((tmp / f"client-{mode}.json").read_text())
    finally:
        cluster.stop()
    s = summarize(out["streams"])
    per = s["num_tokens"] if mode == "stream" else s["num_streams"]
    if not per:
        raise NoOutput(f"{mode}: no {'token' if mode == 'stream' else 'stream'} came back of {args.requests} "
                       f"streams (errors: {s.get('errors') or 'none counted'}); nothing to divide the costs by")
    calls = sum(stats.values())
    steps = _delta(w0, w1, "pagefleet:iteration_tokens_total_count")
    # The simulated model's CPU (its cost model and token draw: a real worker's forward pass and
    # sampler) a token, over the tokens of the workers that report it (a tree before the workers of
    # one process each served their metrics reports its first worker's alone).
    model_s = _delta(w0, w1, "pagefleet:sim_model_cpu_seconds_total")
    generated = _delta(w0, w1, "pagefleet:generation_tokens_total")
    sim_model_us = model_s / generated * 1e6 * s["num_tokens"] / per if model_s is not None and generated else None
    writes = _delta(w0, w1, "pagefleet:worker_output_writes_total")
    # Every steps write of every worker as Redis counts it: each XADD but an admission's (one a
    # request) and a finish's done entry (one a finishing write, with its XACK).
    steps_writes = stats.get("xadd", 0) - s["num_streams"] - stats.get("xack", 0)
    return {
        "mode": mode, "backend": args.backend, "label": args.label, "max_tokens": max_tokens,
        **s,
        "wall_s": out["wall_s"],
        "tokens_per_s": s["num_tokens"] / out["wall_s"],
        "per": "token" if mode == "stream" else "request",
        "redis_commands": calls / per,
        "redis_commands_by_name": {k: v / per for k, v in sorted(stats.items(), key=lambda kv: -kv[1])},
        "redis_cpu_us": (rcpu1 - rcpu0) / per * 1e6,
        "redis_command_us_by_name": {k: v / per for k, v in sorted(usec.items(), key=lambda kv: -kv[1])},
        "cpu_us": {k: (cpu1[k] - cpu0[k]) / per * 1e6 for k in procs},
        "worker_sim_model_cpu_us": sim_model_us,
        # The workers' host path: their CPU less the simulated model's (issue 19's measure).
        "worker_cpu_us_outside_model": None if sim_model_us is None else (cpu1["workers"] - cpu0["workers"]) / per * 1e6 - sim_model_us,
        # The workers' CPU by thread (engine, output-writer, main: the event loop, grpc's, ...).
        "worker_cpu_us_by_thread": {name: seconds / per * 1e6 for name, seconds in sorted(
            cpu_by_thread(threads0, threads1).items(), key=lambda kv: -kv[1])},
        "steps_per_write": steps / writes if steps and writes else None,
        "tokens_per_write": s["num_tokens"] / steps_writes if steps_writes > 0 else None,
        "redis_cpu_us_per_write": (rcpu1 - rcpu0) / steps_writes * 1e6 if steps_writes > 0 else None,
        "redis_bytes_per_request_in_flight": max((b / n for b, n in in_flight), default=None),
        "redis_bytes_per_request_kept": mem_kept / s["num_streams"],
    }


def _delta(a: dict, b: dict, name: str) -> float | None:
    if name not in b:
        return None
    return b[name] - a.get(name, 0.0)


def measure_floor(args, tmp: Path, tokens_per_message: float = 1, pace_ms: float = 0.0) -> dict:
    """The floor's run: ``--requests`` streams of ``--max-tokens`` canned tokens, ``tokens_per_message``
    a message, each stream's messages ``pace_ms`` apart (0: as fast as the client takes them)."""
    from pagefleet.common.service import free_port

    port = free_port()
    kind = "grpc" if args.backend == "grpc" else "sse"
    server = subprocess.Popen([sys.executable, "-m", "pagefleet.bench.floor", kind, str(port),
                               "--tokens-per-message", str(tokens_per_message), "--pace-ms", str(pace_ms)],
                              stdout=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        server.stdout.readline()
        target = f"127.0.0.1:{port}" if kind == "grpc" else f"http://127.0.0.1:{port}"
        base = {"backend": args.backend, "target": target, "connections": args.connections,
                "prompt_len": args.prompt_len, "timeout_s": args.timeout, "model": "tiny"}
        deadline = time.monotonic() + 30
        while True:  # the server answers once it is up
            try:
                drive(dict(base, run="floor-warm", num_requests=8, concurrency=8, max_tokens=4), tmp)
                break
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cpu0, threads0 = tree_cpu(server.pid), thread_cpu([server.pid])
        out = drive(dict(base, run="floor", num_requests=args.requests, concurrency=args.concurrency,
                         max_tokens=args.max_tokens), tmp)
        # The process's clock ticks (10 ms) count a thread that ended; its threads' nanoseconds
        # a small run's few milliseconds (ticks read 0 there): the larger of the two.
        cpu = max(tree_cpu(server.pid) - cpu0, sum(cpu_by_thread(threads0, thread_cpu([server.pid])).values()))
    finally:
        server.terminate()
        server.wait(10)
    s = summarize(out["streams"])
    return {"mode": "floor", "backend": args.backend, "server": kind, "tokens_per_message": tokens_per_message,
            "pace_ms": pace_ms, **s, "wall_s": out["wall_s"],
            "cpu_us_per_message": cpu / max(1, s["num_messages"]) * 1e6,
            "cpu_us_per_token": cpu / max(1, s["num_tokens"]) * 1e6}


def measure_paced_floor(args, tmp: Path, stream: dict) -> dict:
    """The floor at a stream run's pace: messages of the tokens its messages carried (on
    average: sizes mixed to that mean), each stream's ``message_gap_ms_p50`` apart: what a
    trivial server costs a token when its writes wait on the model as the gateway's do."""
    per = max(1.0, round(stream["num_tokens"] / max(1, stream["num_messages"]), 3))
    return measure_floor(args, tmp, per, round(stream["message_gap_ms_p50"] or 0.0, 3))


# -- the command ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench token-path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16, help="simulated workers")
    p.add_argument("--workers-per-process", type=int, default=None, help="default: all in one process")
    p.add_argument("--time-scale", type=float, default=1.0, help="the workers' simulated seconds per real second")
    p.add_argument("--sim-profile", default="llama-3-8b-h100")
    p.add_argument("--sim-wait", default="sleep", choices=("sleep", "spin"),
                   help="the workers wait out a step asleep, or spinning as a GPU worker's thread does in CUDA's "
                        "synchronize (its CPU counted as the model's): the host path warm, for a machine with a "
                        "core a worker (`pagefleet worker --sim-wait`)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per worker")
    p.add_argument("--requests", type=int, default=1024, help="streams in a run (N)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens of every stream (T)")
    p.add_argument("--concurrency", type=int, default=256, help="streams open at once (C)")
    p.add_argument("--connections", type=int, default=8, help="gRPC channels the client spreads streams over")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--modes", default="stream,fixed", help="comma-separated: stream, fixed (1-token outputs)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor")
    p.add_argument("--gateway-processes", type=int, default=1, help="the gateway's --processes")
    p.add_argument("--stream-interval", type=int, default=1, help="the gateway's --stream-interval")
    p.add_argument("--report-interval", type=float, default=None,
                   help="the scheduler's --report-interval (default: its own)")
    p.add_argument("--python", default=None, help="interpreter of the cluster's processes (default: this one)")
    p.add_argument("--redis-socket", action="store_true",
                   help="the processes reach the Redis started for the run over its unix socket (`up --redis-socket`; "
                        "default: TCP; a --python tree older than 6335cee cannot take a unix URL)")
    p.add_argument("--label", default="", help="a name for this tree in the results (e.g. before, after)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a stream may take")
    p.add_argument("--json", default="bench-results/token-path.json", help="where to write the results")
    p.add_argument("--log-dir", default=None, help="keep the components' logs here (default: a temp dir)")
    add_shard_flags(p)
    return p


def add_shard_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards and Redis Cluster (token_path_shards)")
    g.add_argument("--shards", type=int, default=None, metavar="N",
                   help="serve the model from N shards, a scheduler each, the workers split over them; "
                        "figures per Redis primary and per scheduler")
    g.add_argument("--redis-cluster", action="store_true",
                   help="on a Redis Cluster: a throwaway one of --primaries primaries, or --redis-url's")
    g.add_argument("--primaries", type=int, default=None,
                   help="primaries of the throwaway Redis Cluster (1, or 3+; default 3); with --redis-cluster only")
    g.add_argument("--replicas", type=int, default=None,
                   help="replicas of each primary of the throwaway Redis Cluster (default 0); with --redis-cluster only")
    g.add_argument("--redis-url", default=None,
                   help="a running Redis (with --redis-cluster: a node of a running cluster) instead of a throwaway one")


def shard_flags_error(args) -> str | None:
    """What is wrong with the shard flags, or None."""
    if args.shards is not None and not 1 <= args.shards <= args.workers:
        return f"--shards must be between 1 and --workers ({args.workers}), got {args.shards}"
    for flag, value in (("--primaries", args.primaries), ("--replicas", args.replicas)):
        if value is not None and not args.redis_cluster:
            return f"{flag} sizes the throwaway Redis Cluster: it needs --redis-cluster"
    args.primaries = 3 if args.primaries is None else args.primaries
    args.replicas = 0 if args.replicas is None else args.replicas
    if args.primaries < 1 or args.primaries == 2:
        return f"--primaries: 1, or 3 and more (redis-cli --cluster create wants 3), got {args.primaries}"
    if args.replicas < 0:
        return f"--replicas must be 0 or more, got {args.replicas}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers_per_process is not None and args.workers_per_process < 1:
        print(f"--workers-per-process must be at least 1, got {args.workers_per_process}", file=sys.stderr)
        return 2
    args.workers_per_process = args.workers_per_process or args.workers
    cwd = Path.cwd()
    if args.log_dir:
        args.log_dir = str(Path(args.log_dir).resolve())
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in ("stream", "fixed")]:
        print(f"--modes: unknown {bad} (stream, fixed)", file=sys.stderr)
        return 2
    if not modes and args.no_floor:  # (no mode and the floor: the floor alone)
        print(f"--modes names no mode ({args.modes!r}) and --no-floor leaves out the floor: nothing to run",
              file=sys.stderr)
        return 2
    if error := shard_flags_error(args):
        print(error, file=sys.stderr)
        return 2
    for flag in ("workers", "requests", "max_tokens", "concurrency", "connections", "gateway_processes",
                 "stream_interval", "max_num_seqs", "prompt_len"):
        if getattr(args, flag) < 1:
            print(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    for flag in ("time_scale", "timeout"):  # (nan is not above 0; --time-scale inf: steps never sleep)
        if not getattr(args, flag) > 0:
            print(f"--{flag.replace('_', '-')} must be above 0, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if args.report_interval is not None and not 0 < args.report_interval <= DEAD_AFTER_S / 2:
        print(f"--report-interval must be above 0 and at most {DEAD_AFTER_S / 2} (half the bench's --dead-after), "
              f"got {args.report_interval}",
              file=sys.stderr)
        return 2
    sharded = args.redis_cluster or args.shards is not None
    # SIGTERM ends the bench as Ctrl-C does: through every ``finally``, so the cluster it
    # started is stopped (it was left running, its processes orphaned).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagefleet-token-path-") as d:
        tmp = Path(d)
        # Not from a checkout: ``python -m`` puts the working directory first on the path, and a
        # --python of another tree would import this checkout's package over its own.
        os.chdir(tmp)
        if not args.no_floor:
            results.append(measure_floor(args, tmp))
            print(row(results[-1]), flush=True)
        for mode in modes:
            if sharded:
                from pagefleet.bench.token_path_shards import measure_shards, shards_row

                results.append(measure_shards(args, tmp, mode))
                print(shards_row(results[-1]), flush=True)
                continue
            try:
                results.append(measure_cluster(args, tmp, mode))
            except NoOutput as e:
                print(f"pagefleet bench token-path: {e}", file=sys.stderr)
                return 1
            print(row(results[-1]), flush=True)
            if mode == "stream" and not args.no_floor:
                x = results[-1]
                x["floor_paced"] = measure_paced_floor(args, tmp, x)
                print(row(x["floor_paced"]), flush=True)
    floor = next((x for x in results if x["mode"] == "floor"), None)
    for x in results:
        if floor and x["mode"] == "stream":  # a floor too short to read a CPU tick: no ratio
            per = floor["cpu_us_per_message"]
            x["gateway_cpu_vs_floor"] = x["cpu_us"]["gateway"] / per if per else None
            paced = x.get("floor_paced", {}).get("cpu_us_per_token")
            x["gateway_cpu_vs_paced_floor"] = x["cpu_us"]["gateway"] / paced if paced else None
    report = {
        "benchmark": "token-path", "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_1m": os.getloadavg()[0],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "targets": TARGETS, "results": results,
    }
    out = Path(args.json) if Path(args.json).is_absolute() else cwd / args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"JSON: {out}", file=sys.stderr)
    return 0


def _by_thread(x: dict, top: int = 3) -> str:
    """The workers' CPU by thread, the biggest ``top`` and the rest."""
    by = list(x.get("worker_cpu_us_by_thread", {}).items())
    parts = [f"{name} {us:.1f}" for name, us in by[:top]]
    if len(by) > top:
        parts.append(f"other {sum(us for _, us in by[top:]):.1f}")
    return ", ".join(parts)


def _outside_model(x: dict) -> str:
    outside = x.get("worker_cpu_us_outside_model")
    return "" if outside is None else f"; {outside:.1f} outside the simulated model"


def row(x: dict) -> str:
    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    head = (f"{x.get('label') or '':>8} {x['mode']:>6} {x['backend']:>6}: {x['num_whole']}/{x['num_streams']} whole, "
            f"TTFT p50/p99 {f(x['ttft_p50_ms'])}/{f(x['ttft_p99_ms'])} ms, ITL p50/p99 "
            f"{f(x['itl_p50_ms'], '.2f')}/{f(x['itl_p99_ms'], '.2f')} ms")
    if x["mode"] == "floor" and (x.get("pace_ms") or x.get("tokens_per_message", 1) > 1):
        return (f"{head}; floor server, {x['tokens_per_message']:g} tokens a message {x['pace_ms']:.1f} ms apart: "
                f"{x['cpu_us_per_message']:.1f} us CPU/message, {x['cpu_us_per_token']:.1f} us/token")
    if x["mode"] == "floor":
        return f"{head}; floor server {x['cpu_us_per_message']:.1f} us CPU/message"
    cpu = x["cpu_us"]
    return (f"{head}; {x['tokens_per_s']:.0f} tok/s; per {x['per']}: Redis {x['redis_commands']:.2f} commands "
            f"{x['redis_cpu_us']:.1f} us, gateway {cpu['gateway']:.1f} us, scheduler {cpu['scheduler']:.1f} us, "
            f"workers {cpu['workers']:.1f} us ({_by_thread(x)}{_outside_model(x)}); steps/write {f(x['steps_per_write'], '.2f')}, tokens/write "
            f"{f(x.get('tokens_per_write'))}; Redis bytes/request "
            f"in flight {f(x['redis_bytes_per_request_in_flight'], '.0f')} kept {x['redis_bytes_per_request_kept']:.0f}")


if __name__ == "__main__":
    sys.exit(main())
