"""``pagefleet bench reliability``: faults under load, with real processes, counted.

Every scenario starts its own cluster (``ReliabilityCluster``: ``redis-server`` with an
append-only file fsynced on every write, two gateways, two workers, an active scheduler
and a standby), drives it, disturbs it, and reports a row: requests sent, completed and
lost; tokens duplicated, missing and differing from an undisturbed run of the same
requests (greedy and seeded; ``load``); and figures and goals of its own.
Every scenario ends by waiting for the workers to hold nothing: blocks or requests still
held, or entries left in the requests stream, are leaks.

Scenarios (``--scenario``, repeatable; default all):

* ``worker-kill``: SIGKILL a worker mid-generation (a new one is started each time);
* ``scheduler-kill``: SIGKILL the active scheduler; the standby takes over;
* ``gateway-kill``: SIGKILL a gateway; clients retry the same ids on the other one;
* ``redis-restart``: SIGKILL ``redis-server``, restart it on its append-only file;
* ``worker-freeze``: SIGSTOP a worker past the dead timeout, then SIGCONT it;
* ``scheduler-partition``: cut the active scheduler's link to Redis (a TCP proxy), not
  the workers'; it must stop before the standby takes over;
* ``fuzz``: generated bad requests and raw bytes (``fuzz``);
* ``cancels``: cancels at random moments (``cancels``);
* ``overload``: ten times the sustainable rate (``overload``);
* ``soak``: 30 minutes at 70 % of capacity on simulated workers, then idle: memory and file
  descriptors flat, Redis back to its baseline but for streams capped by design (``soak``).

``--short`` is the CI form (small counts; tests/test_reliability.py runs it); the full
form's figures are in docs/RELIABILITY.md. Exit status 1 when any row misses a goal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..results import header
from .cluster import ReliabilityCluster, Row, Settings, wait_for
from .load import Load, Tally, make_jobs, reference_tokens
from .tcp_proxy import TcpProxy

# Faster than the defaults, so a scenario spends its time on the load rather than on timeouts.
DEAD_AFTER = ["--dead-after", "1.0"]
LEASE_MS = 3000  # the scheduler's default
CONCURRENCY = 16


def _jobs(s: Settings, name: str, short: int, full: int):
    jobs = make_jobs(s.pick(short, full), name)
    return jobs, reference_tokens(jobs)


def _finish(name: str, c: ReliabilityCluster, load: Load, reference: dict, started: float,
            figures: dict, goals: dict[str, bool] | None = None) -> Row:
    """The row of a scenario whose load is running: join it, wait for idle, count."""
    outcomes = load.join()
    held = c.wait_idle()
    tally = Tally.of(outcomes, reference)
    figures = dict(figures, **{"client retries": tally.num_retries})
    if load.codes:
        figures["retried on"] = dict(load.codes)
    if tally.errors:
        figures["lost because"] = dict(tally.errors.most_common(3))
        figures["lost, e.g."] = tally.lost_ids[:3]
    leaked = {k: v for k, v in held.items() if k != "workers" and v}
    if leaked:
        figures["held at the end"] = leaked
    if held["stream_entries"]:
        figures["left in the requests stream"] = c.stream_entries()
    goals = {"nothing held at the end": not leaked, **(goals or {})}
    return Row(name, **tally.figures(), seconds=round(time.perf_counter() - started, 1), figures=figures,
               goals=goals)


def _disturb_points(load: Load, n: int):
    """Wait for each of ``n`` evenly spaced points of the load's progress in turn."""
    for k in range(n):
        load.wait_fraction((k + 1) / (n + 2))
        yield k


def worker_kill(s: Settings) -> Row:
    name = "worker-kill"
    jobs, reference = _jobs(s, name, 48, 320)
    kills = s.pick(1, 3)
    started = time.perf_counter()
    with ReliabilityCluster(s, name, scheduler_args=DEAD_AFTER) as c:
        load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
        for _ in _disturb_points(load, kills):
            c.c.kill(c.busy_worker(), signal.SIGKILL)
            c.c.add_worker()
        row = _finish(name, c, load, reference, started, {"workers killed": kills})
        row.figures["requests resumed elsewhere"] = c.state().num_reassigned
    return row


def scheduler_kill(s: Settings) -> Row:
    name = "scheduler-kill"
    jobs, reference = _jobs(s, name, 64, 400)
    kills = s.pick(1, 3)
    takeovers = []
    started = time.perf_counter()
    with ReliabilityCluster(s, name, scheduler_args=DEAD_AFTER) as c:
        load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
        for _ in _disturb_points(load, kills):
            active = wait_for(c.active_scheduler, 30, "an active scheduler")
            t = time.monotonic()
            c.c.kill(active, signal.SIGKILL)
            wait_for(c.active_scheduler, 60, "the standby to take over", every_s=0.02)
            takeovers.append(time.monotonic() - t)
            c.start_standby()
        figures = {"schedulers killed": kills, "takeover s (max)": round(max(takeovers), 2)}
        return _finish(name, c, load, reference, started, figures)


def gateway_kill(s: Settings) -> Row:
    name = "gateway-kill"
    jobs, reference = _jobs(s, name, 48, 320)
    kills = s.pick(1, 4)
    started = time.perf_counter()
    with ReliabilityCluster(s, name) as c:
        load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
        for k in _disturb_points(load, kills):
            i = k % 2
            c.c.kill(c.c.gateway_name(i), signal.SIGKILL)
            time.sleep(1.0)
            c.c.start_gateway(i)
        return _finish(name, c, load, reference, started, {"gateways killed": kills})


def redis_restart(s: Settings) -> Row:
    """Redis down for ``down`` seconds each time; past 2/3 of the lease the active scheduler
    cannot know it still holds it and stops placing; a whole lease without a renewal and it
    stands by, and a standby takes over once Redis is back (a scheduler that exits is replaced)."""
    name = "redis-restart"
    jobs, reference = _jobs(s, name, 48, 320)
    outages = s.pick([0.5], [0.5, 1.0, 5.0])
    exits: dict[str, int] = {}
    started = time.perf_counter()
    with ReliabilityCluster(s, name, scheduler_args=DEAD_AFTER) as c:
        load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
        for k in _disturb_points(load, len(outages)):
            c.redis.restart(down_s=outages[k])
            time.sleep(LEASE_MS / 1000)  # long enough for a scheduler that lost track of its lease to stand by
            wait_for(c.active_scheduler, 60, "an active scheduler")
            for n, code in c.exited().items():
                exits[n] = code
                c.start_standby()
        figures = {"restarts": len(outages), "down s": outages, "schedulers that exited": len(exits),
                   "AOF MiB": round(sum(f.stat().st_size for f in Path(c.redis.dir).glob("*.aof*")) / 2**20, 1)}
        return _finish(name, c, load, reference, started, figures)


def worker_freeze(s: Settings) -> Row:
    name = "worker-freeze"
    jobs, reference = _jobs(s, name, 48, 320)
    freezes = s.pick(1, 3)
    victims = []
    started = time.perf_counter()
    with ReliabilityCluster(s, name, scheduler_args=DEAD_AFTER) as c:
        load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
        for _ in _disturb_points(load, freezes):
            victim = c.busy_worker()
            victims.append(victim)
            c.signal(victim, signal.SIGSTOP)
            try:
                wait_for(lambda v=victim: v not in c.reports(), 30, "the frozen worker to be declared dead")
                time.sleep(0.5)
            finally:
                c.signal(victim, signal.SIGCONT)
        row = _finish(name, c, load, reference, started, {"freezes": freezes})
        # A thawed worker's first writes can come after the load is through: give them 10 s.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: all(c.events(v, "outputs.refused") for v in victims), 10, "the thawed workers' writes")
        refused = [len(c.events(v, "outputs.refused")) for v in victims]
        row.figures["writes refused after thawing"] = refused
        row.goals["every thawed worker was fenced off"] = all(refused)
    return row


def scheduler_partition(s: Settings) -> Row:
    """Each scheduler reaches Redis through a proxy of its own; the workers and gateways do
    not. Cutting the active one's proxy leaves it unable to renew its lease: it must stop
    placing before the lease lapses and the standby takes over, and stand by itself (its
    process alive: under ``up`` an exit stopped every process)."""
    name = "scheduler-partition"
    jobs, reference = _jobs(s, name, 64, 320)
    cuts = s.pick(1, 2)
    proxies: dict[str, TcpProxy] = {}  # a scheduler's Redis URL -> its proxy

    def via_proxy(url: str) -> str:
        p = TcpProxy(int(url.rsplit(":", 1)[1].split("/")[0])).start()
        proxies[p.url] = p
        return p.url

    stopped_first, stood_by, takeovers = [], [], []
    started = time.perf_counter()
    try:
        with ReliabilityCluster(s, name, scheduler_args=DEAD_AFTER, scheduler_redis_url=via_proxy) as c:
            load = Load(c.gateway_targets, jobs, CONCURRENCY).start()
            for _ in _disturb_points(load, cuts):
                active = wait_for(c.active_scheduler, 30, "an active scheduler")
                t = time.monotonic()
                proxies[c.scheduler_urls[active]].cut()
                proc = c.c.procs[active]
                wait_for(lambda a=active: any("after" in e for e in c.events(a, "scheduler.standby")), 30,
                         "the cut-off scheduler to stand by")
                new = wait_for(lambda a=active: (n := c.active_scheduler()) not in (None, a) and n, 60,
                               "the standby to take over")
                takeovers.append(time.monotonic() - t)
                stopped_first.append(_stopped_before(c, active, new))
                stood_by.append(proc.poll() is None)
                c.exited()
                c.start_standby()  # the cut-off one stands by, but cannot reach Redis
            figures = {"cuts": cuts, "cut-off schedulers alive, standing by": sum(stood_by),
                       "takeover s after the cut (max)": round(max(takeovers), 2)}
            goals = {"the cut-off scheduler stopped before the standby took over": all(stopped_first),
                     "the cut-off scheduler stood by instead of exiting": all(stood_by)}
            return _finish(name, c, load, reference, started, figures, goals)
    finally:
        for p in proxies.values():
            p.stop()


def _stopped_before(c: ReliabilityCluster, old: str, new: str) -> bool:
    """``old`` logged giving up its lease before ``new`` logged acquiring it (same machine, one clock)."""
    gave_up = c.events(old, "scheduler.lease_unsure", "scheduler.lease_lost")
    acquired = c.events(new, "scheduler.lease_acquired")
    return bool(gave_up and acquired) and gave_up[0]["timestamp"] < acquired[-1]["timestamp"]


def fuzz(s: Settings) -> Row:
    from .fuzz import run

    return run(s)


def cancels(s: Settings) -> Row:
    from .cancels import run

    return run(s)


def overload(s: Settings) -> Row:
    from .overload import run

    return run(s)


def soak(s: Settings) -> Row:
    from .soak import run

    return run(s)


SCENARIOS: dict[str, Callable[[Settings], Row]] = {
    "worker-kill": worker_kill,
    "scheduler-kill": scheduler_kill,
    "gateway-kill": gateway_kill,
    "redis-restart": redis_restart,
    "worker-freeze": worker_freeze,
    "scheduler-partition": scheduler_partition,
    "fuzz": fuzz,
    "cancels": cancels,
    "overload": overload,
    "soak": soak,
}


# -- the command ----------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    lines = ["| scenario | sent | completed | lost | duplicated | missing | differing | goals | s | figures |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        missed = [g for g, met in r.goals.items() if not met]
        goals = "met" if r.ok else "**missed**" + (f": {'; '.join(missed)}" if missed else "")
        figures = "; ".join(f"{k}: {v}" for k, v in r.figures.items())
        lines.append(f"| {r.scenario} | {r.sent} | {r.completed} | {r.lost} | {r.duplicated} | {r.missing} | "
                     f"{r.differing} | {goals} | {r.seconds:g} | {figures} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="run this one (repeatable; default all)")
    p.add_argument("--short", action="store_true", help="the CI form: small counts, a few minutes in all")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--log-dir", default=None, help="keep every process's log here (default: a temp dir)")
    p.add_argument("--sim-time-scale", type=float, default=1.0,
                   help="overload: simulated seconds per real second of its simulated workers (below 1: slower "
                        "steps, so ten times their rate fits a small machine's CPU)")
    p.add_argument("--soak-seconds", type=float, default=None,
                   help="soak: seconds of load (default 1800; --short 60)")
    p.add_argument("--soak-load", type=float, default=0.7, help="soak: the load as a fraction of capacity")
    p.add_argument("--soak-idle", type=float, default=None,
                   help="soak: idle seconds after the load before Redis is compared with its baseline "
                        "(default: past the finished requests' TTL; --short 5)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.sim_time_scale > 0:
        parser.error(f"--sim-time-scale must be positive, got {args.sim_time_scale}")
    if args.soak_seconds is not None and not args.soak_seconds > 0:
        parser.error(f"--soak-seconds must be a number of seconds above 0, got {args.soak_seconds}")
    if args.soak_idle is not None and not args.soak_idle >= 0:
        parser.error(f"--soak-idle must be a number of seconds >= 0, got {args.soak_idle}")
    if not 0 < args.soak_load <= 1:
        parser.error(f"--soak-load must be a fraction of capacity in (0, 1], got {args.soak_load}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagefleet-reliability-"))
    s = Settings(short=args.short, log_dir=log_dir, sim_time_scale=args.sim_time_scale,
                 soak_seconds=args.soak_seconds, soak_load=args.soak_load, soak_idle_s=args.soak_idle)
    # SIGTERM ends the bench as Ctrl-C does: through every ``finally``, so each scenario's
    # cluster and its redis-server are stopped (redis-server was left running, orphaned).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows = []
    for name in args.scenario or list(SCENARIOS):
        print(f"== {name}", flush=True)
        rows.append(SCENARIOS[name](s))
        print(table(rows[-1:]), flush=True)
    print()
    print(table(rows))
    print(f"\nlogs: {log_dir}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            **header("reliability", "pagefleet bench reliability"), "short": args.short, "rows": [dict(asdict(r), ok=r.ok) for r in rows]}, indent=2))
    return 0 if all(r.ok for r in rows) else 1
