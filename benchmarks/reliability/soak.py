"""``soak``: a long steady load, then idle; nothing may grow that the load did not need.

One cluster of simulated workers (``--engine sim``: the real worker service, batch
scheduler, block pool and writes, steps slept out at an H100's speed), two gateways and a
scheduler. Its capacity is measured first (a closed loop with as many clients as the
workers have sequence slots); then Poisson arrivals at ``--soak-load`` (default 70 %) of it
run for ``--soak-seconds`` (30 minutes; the short form a minute), in windows whose tokens are
checked against the reference and dropped, so the load generator holds one window at a time.
Every ``interval`` seconds it samples each process (gateways, scheduler, workers and
``redis-server``): resident memory and open file descriptors, and Redis's ``used_memory``
and key count.

Goals, after a warm-up of the first quarter of the load:

* memory flat: each process's resident memory at the end of the load (median of its last
  three samples) within 5 % of the same at the end of the warm-up (or 4 MiB, below which
  one allocator arena moves it); for Redis, its ``used_memory`` less the streams capped by
  design (its allocator keeps pages it freed: its resident size is reported, not judged), and
  only once the warm-up is longer than a finished request's TTL (before that its records pile
  up by design: the short form reports it);
* no file-descriptor growth: each process's count once idle after the load no higher than
  its highest in the first half of the load, give or take 10 % or 4 (a leak grows with the
  requests served, thousands here; connection pools keep what the load's peak needed, and
  clients come and go while it runs);
* Redis back to its baseline once the load is through: every key the load left carries a
  TTL, except the streams capped by design (each reported with its length and bound); with
  ``--soak-idle`` past the longest TTL (the full form), the keys left are those streams
  and ``used_memory`` less their memory is within 5 % (or 1 MiB: clients' buffers, the
  script cache) of the baseline's.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import redis as sync_redis

from pagefleet.common.fencing import DONE_STREAM_MAXLEN, DONE_TTL_S, REQUEST_TTL_S, STEPS_TTL_S

from .cluster import ReliabilityCluster, Row, Settings
from .load import Load, Tally, make_jobs, reference_tokens
from .overload import Arrivals

SIM_PROFILE = "llama-3-8b-h100"
MAX_NUM_SEQS = 16
NUM_WORKERS = 2
SHAPE = dict(prompt_len=(16, 64), max_tokens=(32, 96))
WINDOW_S = 10.0
MEMORY_SLACK = 0.05
MEMORY_FLOOR_MIB = 4.0
REDIS_FLOOR_MIB = 1.0
FD_SLACK = (0.10, 4)
# Streams that stay by design, with their bound: key suffix -> what bounds it.
CAPPED = {":done": f"MAXLEN ~ {DONE_STREAM_MAXLEN}",
          ":requests": "emptied: each entry leaves at its request's finish",
          ":steps:": f"trimmed to 60 s (MINID, one write a second); expires {STEPS_TTL_S} s after its last write"}


def proc_sample(pid: int) -> tuple[float, int] | None:
    """(resident MiB, open file descriptors) of a live process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


@dataclass
class Sampler:
    """Samples every ``interval_s`` in a thread of its own, until ``stop()``."""

    c: ReliabilityCluster
    interval_s: float
    samples: list[dict] = field(default_factory=list)  # {"t", "procs": {name: (MiB, fds)}, "redis": {...}}
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def pids(self) -> dict[str, int]:
        pids = {name: p.pid for name, p in self.c.c.procs.items() if p.poll() is None}
        pids["redis-server"] = self.c.redis.proc.pid
        return pids

    def sample(self) -> dict:
        procs = {n: s for n, pid in self.pids().items() if (s := proc_sample(pid)) is not None}
        with sync_redis.Redis(port=self.c.redis.port, socket_timeout=10) as r:
            info = r.info("memory")
            capped = capped_bytes(r)
            red = {"used_memory": int(info["used_memory"]), "capped": capped, "keys": int(r.dbsize())}
        if "redis-server" in procs:  # judged by what it holds, less the capped streams, not its RSS
            red["rss_mib"] = procs["redis-server"][0]
            procs["redis-server"] = ((red["used_memory"] - capped) / 2**20, procs["redis-server"][1])
        return {"t": time.monotonic(), "procs": procs, "redis": red}

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def capped_bytes(r) -> int:
    """Bytes of the streams capped by design (``CAPPED``)."""
    total = 0
    for pattern in ("*:done", "*:steps:*"):
        for key in r.scan_iter(match=pattern, count=1000):
            total += int(r.memory_usage(key) or 0)
    return total


def flatness(samples: list[dict], warm_until: float, idle: dict | None = None) -> tuple[dict, dict]:
    """Per process: (memory MiB at warm-up end, at the end, growth) and (fd max in the first
    half of the load after warm-up, the count once idle: ``idle``'s sample, else the max in
    the second half)."""
    after = [s for s in samples if s["t"] >= warm_until]
    memory, fds = {}, {}
    if len(after) < 4:
        return memory, fds
    half = len(after) // 2
    for name in after[0]["procs"]:
        mib = [s["procs"][name][0] for s in after if name in s["procs"]]
        fd = [s["procs"][name][1] for s in after if name in s["procs"]]
        if len(mib) < 4:
            continue
        start, end = statistics.median(mib[:3]), statistics.median(mib[-3:])
        memory[name] = (round(start, 1), round(end, 1), round(end / start - 1, 4))
        fds[name] = (max(fd[:half]), idle["procs"][name][1] if idle and name in idle["procs"] else max(fd[half:]))
    return memory, fds


def _redis_rss(samples: list[dict], warm_until: float) -> tuple | None:
    rss = [s["redis"]["rss_mib"] for s in samples if s["t"] >= warm_until and "rss_mib" in s["redis"]]
    return (round(statistics.median(rss[:3]), 1), round(statistics.median(rss[-3:]), 1)) if len(rss) >= 4 else None


def leftover_keys(port: int, baseline: set[bytes]) -> tuple[dict, list[str], int]:
    """Keys the load left: (capped streams {key: (length, bound, bytes)}, keys with neither a TTL
    nor a cap, the capped streams' bytes)."""
    capped, unbounded, total = {}, [], 0
    with sync_redis.Redis(port=port, socket_timeout=10) as r:
        for key in r.scan_iter(count=1000):
            if key in baseline:
                continue
            name = key.decode()
            bound = next((b for part, b in CAPPED.items() if name.endswith(part) or part.endswith(":") and part in name),
                         None)
            if bound is not None:
                size = int(r.memory_usage(key) or 0)
                capped[name] = (int(r.xlen(key)), bound, size)
                total += size
            elif r.ttl(key) == -1:  # no TTL (-2: gone since the scan)
                unbounded.append(name)
    return capped, unbounded, total


def run(s: Settings) -> Row:
    name = "soak"
    seconds = s.soak_seconds or s.pick(60.0, 1800.0)
    load = s.soak_load
    idle_s = s.pick(5.0, DONE_TTL_S + 30.0) if s.soak_idle_s is None else s.soak_idle_s
    interval = s.pick(2.0, 15.0)
    started = time.perf_counter()
    slots = MAX_NUM_SEQS * NUM_WORKERS
    worker_args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--engine", "sim", "--sim-profile", SIM_PROFILE,
                   "--time-scale", str(s.sim_time_scale)]
    tally = Tally()
    with ReliabilityCluster(s, name, num_workers=NUM_WORKERS, worker_args=worker_args, standby=False) as c:
        with sync_redis.Redis(port=c.redis.port, socket_timeout=10) as r:
            baseline_keys = set(r.scan_iter(count=1000))
            baseline_memory = int(r.info("memory")["used_memory"])
        # capacity: a closed loop, every slot busy
        closed = make_jobs(s.pick(4, 16) * slots, f"{name}-capacity", **SHAPE)
        t0 = time.perf_counter()
        Load(c.gateway_targets, closed, slots).start().join()
        capacity = len(closed) / (time.perf_counter() - t0)
        rate = load * capacity
        sampler = Sampler(c, interval)
        sampler.samples.append(sampler.sample())
        sampler.start()
        t_load = time.monotonic()
        k = 0
        while time.monotonic() - t_load < seconds:
            jobs = make_jobs(max(1, round(rate * WINDOW_S)), f"{name}-{k}", seed=k, **SHAPE)
            outcomes = Arrivals(c.gateway_targets, jobs, rate, seed=k).run()
            window = Tally.of(outcomes, reference_tokens(jobs, sim_profile=SIM_PROFILE))
            for f in ("sent", "completed", "lost", "duplicated", "missing", "differing"):
                setattr(tally, f, getattr(tally, f) + getattr(window, f))
            tally.errors.update(window.errors)
            k += 1
        load_s = time.monotonic() - t_load
        sampler.stop()
        held = c.wait_idle()
        time.sleep(idle_s)
        capped, unbounded, capped_total = leftover_keys(c.redis.port, baseline_keys)
        idle = sampler.sample()
        idle_memory, num_keys = idle["redis"]["used_memory"], idle["redis"]["keys"]
        memory, fds = flatness(sampler.samples, t_load + load_s / 4, idle)
    leaked = {k: v for k, v in held.items() if k != "workers" and v}
    # Redis holds each finished request for its TTL: not flat before the warm-up is past it.
    judged = {n: m for n, m in memory.items() if n != "redis-server" or load_s / 4 >= DONE_TTL_S}
    past_ttls = idle_s >= DONE_TTL_S
    memory_back = (idle_memory - capped_total) / baseline_memory - 1
    figures = {
        "sim time scale": s.sim_time_scale,
        "capacity req/s": round(capacity, 1), "offered req/s": round(rate, 1), "load s": round(load_s, 1),
        "idle s": idle_s, "samples": len(sampler.samples),
        "memory MiB at warm-up end -> end (growth)": memory,
        "memory judged": sorted(judged),
        "fds: max in the first half of the load -> once idle": fds,
        "Redis keys: baseline -> after idle": (len(baseline_keys), num_keys),
        "Redis used_memory MiB: baseline -> after idle (capped streams)": (
            round(baseline_memory / 2**20, 2), round(idle_memory / 2**20, 2), round(capped_total / 2**20, 2)),
        "Redis resident MiB: warm-up end -> end of load": _redis_rss(sampler.samples, t_load + load_s / 4),
        "streams kept by design (length, bound, bytes)": capped,
        "TTLs (s): own/out/req after the finish, own while running, steps after the last write": (
            DONE_TTL_S, REQUEST_TTL_S, STEPS_TTL_S),
    }
    if tally.errors:
        figures["lost because"] = dict(tally.errors.most_common(3))
    if unbounded:
        figures["keys with neither TTL nor cap"] = unbounded[:10]
    if leaked:
        figures["held at the end"] = leaked
    goals = {
        "memory flat after warm-up (each process within 5 %)": bool(judged) and all(
            growth <= MEMORY_SLACK or end - start <= MEMORY_FLOOR_MIB for start, end, growth in judged.values()),
        "no file-descriptor growth": bool(fds) and all(
            second <= first + max(FD_SLACK[0] * first, FD_SLACK[1]) for first, second in fds.values()),
        "every key the load left expires or is capped": not unbounded,
        "nothing held at the end": not leaked,
    }
    if past_ttls:
        goals["Redis memory back to baseline once the TTLs passed (less capped streams, within 5 %)"] = (
            memory_back <= MEMORY_SLACK or (idle_memory - capped_total - baseline_memory) / 2**20 <= REDIS_FLOOR_MIB)
    return Row(name, **tally.figures(), seconds=round(time.perf_counter() - started, 1), figures=figures,
               goals=goals)
