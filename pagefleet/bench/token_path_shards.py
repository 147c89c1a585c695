"""``bench token-path --shards N [--redis-cluster --primaries P]``: the token path on shards.

The same load as ``token_path`` (one model, ``--workers`` simulated workers, ``--requests``
streams, ``--concurrency`` at a time), served by ``--shards`` shards of that model, each with
its own scheduler and ``workers / shards`` of the workers; the gateway spreads the requests over
the shards by id. Redis is a throwaway plain ``redis-server`` or, with ``--redis-cluster``, a
throwaway Redis Cluster of ``--primaries`` primaries (1: one node serving every slot) with
``--replicas`` replicas each; or ``--redis-url`` names one already running (a node of it).

On a cluster the shards are named so that their hash tags land on the primaries in turn
(``spread_shard_names``): shard i on the i-th primary (by slot order) modulo P. A primary's
figures count only the tokens (or requests) of the shards whose slots it serves; which shard
each request went to is read from Redis (each request's owner key, ``Keys.owner``), not
recomputed. Per primary: ``INFO cpu`` and ``INFO commandstats`` over the run, per token of its
shards, and its CPU over a quiet spell before the run (the fleet up, no request: reports,
polls, the cluster bus). Per shard's scheduler: its process's CPU per placement (the requests
of its shard; no failure, so one placement each), and the same less its quiet rate over the
run's wall time (what placing cost beyond the reports and polls it pays whatever the load).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagefleet.bench.token_path import _delta, drive, scrape, start_cluster, summarize, tree_cpu

QUIET_S = 3.0  # the quiet spell before a run, for each primary's and scheduler's background CPU


@dataclass(frozen=True, slots=True)
class Primary:
    """A primary (or the one plain Redis) and the slot ranges it serves."""

    host: str
    port: int
    slots: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    def serves(self, slot: int) -> bool:
        return any(a <= slot <= b for a, b in self.slots)


def primaries_of(url: str, cluster: bool) -> list[Primary]:
    """The primaries behind ``url`` in slot order (``CLUSTER SLOTS``); a plain Redis: itself, all slots."""
    import redis as redis_lib

    r = redis_lib.Redis.from_url(url)
    kw = r.connection_pool.connection_kwargs
    try:
        if not cluster:
            return [Primary(kw.get("host", "127.0.0.1"), int(kw.get("port", 6379)), ((0, 16383),))]
        ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for start, end, node, *_ in r.execute_command("CLUSTER", "SLOTS"):
            # A node that has met no other does not know its address: it answers "".
            host = (node[0].decode() if isinstance(node[0], bytes) else node[0]) or kw.get("host", "127.0.0.1")
            ranges.setdefault((host, int(node[1])), []).append((int(start), int(end)))
    finally:
        r.close()
    nodes = [Primary(h, p, tuple(sorted(s))) for (h, p), s in ranges.items()]
    return sorted(nodes, key=lambda n: n.slots[0][0])


def spread_shard_names(num_shards: int, primaries: list[Primary], ns: str = "pf") -> list[str]:
    """``num_shards`` names ``s<k>`` (smallest k first) whose hash tags land on the primaries in
    turn: shard i on ``primaries[i % len(primaries)]``."""
    from pagefleet.common.redis import Keys
    from pagefleet.common.redis_cluster import key_slot

    names: list[str] = []
    k = 0
    for i in range(num_shards):
        want = primaries[i % len(primaries)]
        while not want.serves(key_slot(Keys(ns, f"s{k}").requests)) or f"s{k}" in names:
            k += 1
        names.append(f"s{k}")
        k = 0
    return names


def start_redis(args):
    """``(server or None, url)``: ``--redis-url`` as given, else a throwaway cluster or Redis."""
    if args.redis_url:
        return None, args.redis_url
    if args.redis_cluster:
        from pagefleet.common.redis_cluster import RedisClusterServer

        server = RedisClusterServer(args.primaries, args.replicas).start()
    else:
        from pagefleet.common.redis import RedisServer

        server = RedisServer(unix_socket=getattr(args, "redis_socket", False)).start()
    return server, server.url


def process_url(server, url: str) -> str:
    """The URL the cluster's processes get: the socket of a standalone Redis started here with
    ``--redis-socket`` (as ``up --redis-socket`` gives), else ``url``. Redis's own counters are read over ``url``."""
    return getattr(server, "socket_url", None) or url


class NodeCounters:
    """CPU and command counts of each primary, read over a plain connection to it."""

    def __init__(self, primaries: list[Primary]) -> None:
        import redis as redis_lib

        self.primaries = primaries
        self.clients = [redis_lib.Redis(host=p.host, port=p.port) for p in primaries]

    def cpu(self) -> list[float]:
        out = []
        for c in self.clients:
            info = c.info("cpu")
            out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
        return out

    def reset(self) -> None:
        for c in self.clients:
            c.config_resetstat()

    def commands(self) -> list[dict[str, tuple[int, int]]]:
        """Per primary: command -> (calls, µs spent running it) since ``reset``."""
        return [{k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in c.info("commandstats").items()}
                for c in self.clients]

    def shard_of_requests(self, keys_by_shard: dict, run: str) -> dict[str, str]:
        """``request id -> shard`` for run ``run``'s requests, from their owner keys."""
        from pagefleet.common.redis_cluster import key_slot

        found: dict[str, str] = {}
        for shard, keys in keys_by_shard.items():
            pattern = keys.owner(f"{run}-*")
            node = next(c for p, c in zip(self.primaries, self.clients, strict=True) if p.serves(key_slot(pattern)))
            prefix = keys.owner("")
            for key in node.scan_iter(match=pattern, count=1000):
                found[key.decode().removeprefix(prefix)] = shard
        return found

    def close(self) -> None:
        for c in self.clients:
            c.close()


def measure_shards(args, tmp: Path, mode: str) -> dict:
    """One run of ``mode`` (stream, fixed) on shards: the figures per primary and per scheduler."""
    from pagefleet.common.redis import Keys
    from pagefleet.common.redis_cluster import key_slot

    max_tokens = args.max_tokens if mode == "stream" else 1
    server, url = start_redis(args)
    try:
        primaries = primaries_of(url, args.redis_cluster)
        n = args.shards or 1
        names = spread_shard_names(n, primaries) if args.redis_cluster else [f"s{i}" for i in range(n)]
        cluster = start_cluster(args, tmp, redis_url=process_url(server, url), redis_cluster=args.redis_cluster,
                                shards_per_model=n,
                                shard_names=names)
        counters = NodeCounters(primaries)
        try:
            base = {"backend": args.backend, "target": cluster.http_url if args.backend == "openai"
                    else cluster.gateway_target, "connections": args.connections, "prompt_len": args.prompt_len,
                    "timeout_s": args.timeout, "model": "tiny"}
            drive(dict(base, run=f"warm-{mode}", num_requests=min(64, args.requests),
                       concurrency=min(64, args.concurrency), max_tokens=min(16, max_tokens)), tmp)
            time.sleep(1.0)
            schedulers = {shard: cluster.procs[name].pid for name, shard in cluster.scheduler_shards.items()}
            worker_urls = [cluster.metrics_url(n) for n in cluster.procs if n.startswith("worker")]
            procs = {"gateway": [cluster.procs["gateway"].pid], "scheduler": list(schedulers.values()),
                     "workers": [p.pid for name, p in cluster.procs.items() if name.startswith("worker")]}
            quiet0, squiet0 = counters.cpu(), {s: tree_cpu(p) for s, p in schedulers.items()}
            time.sleep(QUIET_S)
            quiet1, squiet1 = counters.cpu(), {s: tree_cpu(p) for s, p in schedulers.items()}
            counters.reset()
            w0 = [scrape(u) for u in worker_urls]
            cpu0 = {k: sum(tree_cpu(p) for p in v) for k, v in procs.items()}
            sched0 = {s: tree_cpu(p) for s, p in schedulers.items()}
            rcpu0 = counters.cpu()
            t0 = time.monotonic()
            out_path = tmp / f"client-{mode}.json"
            subprocess.run([sys.executable, "-m", "pagefleet.bench.token_client",
                            json.dumps(dict(base, run=mode, num_requests=args.requests, concurrency=args.concurrency,
                                            max_tokens=max_tokens, out=str(out_path)))], check=True)
            rcpu1 = counters.cpu()
            run_s = time.monotonic() - t0
            cpu1 = {k: sum(tree_cpu(p) for p in v) for k, v in procs.items()}
            sched1 = {s: tree_cpu(p) for s, p in schedulers.items()}
            stats = counters.commands()
            w1 = [scrape(u) for u in worker_urls]
            shard_of = counters.shard_of_requests({s: Keys(cluster.cfg.namespace, s) for s in names}, mode)
        finally:
            counters.close()
            cluster.stop()
    finally:
        if server is not None:
            server.stop()
    streams = json.loads(out_path.read_text())
    s = summarize(streams["streams"])
    per_key = "num_tokens" if mode == "stream" else "num_requests"
    by_shard = {name: {"num_tokens": 0, "num_requests": 0} for name in names}
    for i, st in enumerate(streams["streams"]):
        shard = shard_of.get(f"{mode}-{i}")
        if shard is not None:
            by_shard[shard]["num_tokens"] += st["num_tokens"]
            by_shard[shard]["num_requests"] += 1
    slot_of = {name: key_slot(Keys(cluster.cfg.namespace, name).requests) for name in names}
    nodes = []
    for j, p in enumerate(primaries):
        mine = [name for name in names if p.serves(slot_of[name])]
        units = sum(by_shard[name][per_key] for name in mine)
        calls = sum(n for n, _ in stats[j].values())
        nodes.append({
            "node": p.name, "num_slots": sum(b - a + 1 for a, b in p.slots), "shards": mine,
            "num_tokens": sum(by_shard[name]["num_tokens"] for name in mine),
            "num_requests": sum(by_shard[name]["num_requests"] for name in mine),
            "redis_cpu_us": (rcpu1[j] - rcpu0[j]) / units * 1e6 if units else None,
            "redis_commands": calls / units if units else None,
            "redis_commands_by_name": {k: n / units for k, (n, _) in sorted(stats[j].items(), key=lambda kv: -kv[1][0])}
            if units else {},
            # The µs spent running each command (commandstats' usec; EVALSHA's include those of
            # the commands its script calls, which are counted under their own names too).
            "redis_command_us_by_name": {k: us / units for k, (_, us) in sorted(stats[j].items(), key=lambda kv: -kv[1][1])}
            if units else {},
            "quiet_cpu_pct": (quiet1[j] - quiet0[j]) / QUIET_S * 100,
        })
    per = s["num_tokens"] if mode == "stream" else s["num_streams"]
    steps = sum(_delta(a, b, "pagefleet:iteration_tokens_total_count") or 0 for a, b in zip(w0, w1, strict=True))
    writes = sum(_delta(a, b, "pagefleet:worker_output_writes_total") or 0 for a, b in zip(w0, w1, strict=True))
    placements = {name: by_shard[name]["num_requests"] for name in names}
    squiet = {name: (squiet1[name] - squiet0[name]) / QUIET_S for name in names}  # CPU s per s
    return {
        "mode": mode, "backend": args.backend, "label": args.label, "max_tokens": max_tokens,
        "redis": f"Redis Cluster, {len(primaries)} primar{'y' if len(primaries) == 1 else 'ies'}"
                 f", {args.replicas} replica(s) each" if args.redis_cluster else "one Redis (no cluster)",
        "num_primaries": len(primaries), "num_shards": n, "shards": names,
        **s,
        "wall_s": streams["wall_s"],
        "tokens_per_s": s["num_tokens"] / streams["wall_s"],
        "per": "token" if mode == "stream" else "request",
        "num_requests_found_in_shards": sum(placements.values()),
        "by_shard": by_shard,
        "primaries": nodes,
        "steps_per_write": steps / writes if steps and writes else None,
        "redis_cpu_us": sum(rcpu1[j] - rcpu0[j] for j in range(len(primaries))) / per * 1e6,
        "redis_commands": sum(n for x in stats for n, _ in x.values()) / per,
        "cpu_us": {k: (cpu1[k] - cpu0[k]) / per * 1e6 for k in procs},
        "run_s": run_s,
        "schedulers": [{"shard": name, "num_placements": placements[name], "quiet_cpu_pct": squiet[name] * 100,
                        "cpu_us_per_placement": (sched1[name] - sched0[name]) / placements[name] * 1e6
                        if placements[name] else None,
                        "cpu_us_per_placement_less_quiet": (sched1[name] - sched0[name] - squiet[name] * run_s)
                        / placements[name] * 1e6 if placements[name] else None} for name in names],
        "scheduler_cpu_us_per_placement": (cpu1["scheduler"] - cpu0["scheduler"]) / max(1, sum(placements.values()))
        * 1e6,
        "scheduler_cpu_us_per_placement_less_quiet": (cpu1["scheduler"] - cpu0["scheduler"] - sum(squiet.values())
                                                      * run_s) / max(1, sum(placements.values())) * 1e6,
    }


def shards_row(x: dict) -> str:
    """One line per run: the run's totals, then each primary and each scheduler."""
    def f(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    lines = [f"{x.get('label') or '':>8} {x['mode']:>6} {x['backend']:>6}: {x['redis']}, {x['num_shards']} shard(s) "
             f"{','.join(x['shards'])}: {x['num_whole']}/{x['num_streams']} whole, {x['tokens_per_s']:.0f} tok/s; "
             f"per {x['per']}: Redis {x['redis_commands']:.3f} commands {x['redis_cpu_us']:.2f} us, gateway "
             f"{x['cpu_us']['gateway']:.1f} us, workers {x['cpu_us']['workers']:.1f} us; scheduler "
             f"{x['scheduler_cpu_us_per_placement']:.0f} us a placement; steps/write {f(x['steps_per_write'])}"]
    for p in x["primaries"]:
        lines.append(f"{'':>10}primary {p['node']} ({','.join(p['shards']) or 'no shard'}): {p['num_tokens']} tokens, "
                     f"{p['num_requests']} requests, per {x['per']} {f(p['redis_cpu_us'])} us CPU "
                     f"{f(p['redis_commands'], '.3f')} commands; quiet {p['quiet_cpu_pct']:.2f} % CPU")
    for s in x["schedulers"]:
        lines.append(f"{'':>10}scheduler {s['shard']}: {s['num_placements']} placements, "
                     f"{f(s['cpu_us_per_placement'], '.0f')} us CPU a placement "
                     f"({f(s['cpu_us_per_placement_less_quiet'], '.0f')} less its quiet {s['quiet_cpu_pct']:.1f} %)")
    return "\n".join(lines)
