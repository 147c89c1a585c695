"""``pagefleet bench drain``: drain a worker under load, by migration and by recompute.

A local cluster (``pagefleet up``'s processes: Redis, scheduler, gateway, ``--workers``
workers of the tiny model on CPU, KV transfer over NIXL) runs ``--requests`` greedy requests
of ``--max-tokens`` tokens; once the busiest worker runs ``--at-least`` of them it is sent
SIGTERM, and it drains by each policy in turn (``--drain-policy``, a fresh cluster each):

* ``migrate``: the scheduler moves its requests to the other workers with their KV;
* ``recompute``: they get ``--drain-timeout`` seconds to finish, then are handed back and
  resumed elsewhere from their tokens (prompt and output computed again).

Reported per policy: the requests the worker held, how many moved with their KV, were
recomputed or finished there; the tokens computed again elsewhere (prompt + output of each
resumed request); each migration's downtime (the request frozen) and the drain's length;
and whether every output equals the undisturbed in-process run (greedy).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .results import header

PROMPTS = [f"request {i}: the quick brown fox {'jumps ' * (i % 4)}over the lazy dog" for i in range(64)]


def _events(log_dir: str, name: str) -> list[dict]:
    path = Path(log_dir) / f"{name}.log"
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def run_policy(policy: str, args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from pagefleet.client import Client
    from pagefleet.launcher import ClusterConfig, LocalCluster

    prompts = PROMPTS[: args.requests]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = str(Path(args.log_dir) / policy) if args.log_dir else tmp
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        cfg = ClusterConfig(port=0, log_dir=log_dir, device="cpu", num_workers=args.workers,
                            worker_args=["--num-blocks", str(args.num_blocks), "--kv-transfer", "nixl",
                                         "--drain-policy", policy, "--drain-timeout", str(args.drain_timeout)])
        cluster = LocalCluster(cfg)
        try:
            cluster.start(timeout_s=300)
            outs: list = []

            def load() -> None:
                with Client(cluster.gateway_target) as c, ThreadPoolExecutor(len(prompts)) as pool:
                    futs = [pool.submit(c.generate, p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                        timeout=600) for p in prompts]
                    outs.extend(f.result() for f in futs)

            t = threading.Thread(target=load)
            t.start()
            name = None
            while name is None and t.is_alive():
                for w in cluster.scheduler_state().workers:
                    if len(w.report.blocks_per_request) >= args.at_least:
                        name = w.worker_id
                time.sleep(0.01)
            t0 = time.monotonic()
            cluster.kill(name, signal.SIGTERM, wait_s=args.drain_timeout + 60)
            drain_s = time.monotonic() - t0
            t.join()
            worker, sched = _events(log_dir, name), _events(log_dir, "scheduler")
        finally:
            cluster.stop()
    (drained,) = [e for e in worker if e.get("event") == "worker.drained"]
    downtimes = [e["downtime_ms"] for e in worker if e.get("event") == "migration.ended" and e["outcome"] == "migrated"]
    resumed = [e for e in sched if e.get("event") == "request.placed" and e.get("num_resumed_tokens", 0) > 0]
    return {
        "policy": policy, "worker": name, "num_requests_held": drained["num_requests"],
        "num_migrated": drained["num_migrated"], "num_recomputed": drained["num_recomputed"],
        "num_finished_there": drained["num_finished"],
        "num_tokens_recomputed": sum(e["num_tokens"] for e in resumed),  # prompt and resumed output
        "downtime_ms": {"median": statistics.median(downtimes), "max": max(downtimes)} if downtimes else None,
        "num_bytes_moved": sum(e.get("num_bytes", 0) for e in sched if e.get("event") == "transfer.ended"
                               and e.get("outcome") == "migrated"),
        "drain_s": round(drain_s, 3),
        "outputs": [o.token_ids for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
        "prompts": prompts,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench drain", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="workers in the cluster (one is drained)")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens each request generates")
    p.add_argument("--at-least", type=int, default=3, help="drain once a worker runs this many requests")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="the drained worker's --drain-timeout")
    p.add_argument("--policies", default="migrate,recompute", help="drain policies to run, in order")
    p.add_argument("--log-dir", default=None, help="keep every process's log here, a folder per policy "
                                                   "(default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    if args.workers < 2 or not 1 <= args.at_least <= args.requests <= len(PROMPTS):
        p.error(f"need --workers >= 2 and 1 <= --at-least <= --requests <= {len(PROMPTS)}")
    if not set(policies) <= {"migrate", "recompute"}:
        p.error(f"--policies: migrate and/or recompute, got {args.policies!r}")
    runs = [run_policy(policy, args) for policy in policies]

    from pagefleet import Engine, SamplingParams

    engine = Engine(model="tiny", device="cpu")
    reference = [o.token_ids for o in engine.generate(
        runs[0]["prompts"], SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))]
    for r in runs:
        outputs = r.pop("outputs")
        r["tokens_identical"] = outputs == reference
        r["differing"] = [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]
        r.pop("prompts")
        print(json.dumps(r))
    out = header("drain", "pagefleet bench drain " + " ".join(argv or []))
    out.update(vars(args) | {"json": str(args.json) if args.json else None}, runs=runs)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(r["tokens_identical"] for r in runs) else 1
