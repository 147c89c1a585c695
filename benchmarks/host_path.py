"""``pagefleet bench host-path``: a worker's host work per output token, in one process.

What a worker does for each token outside the model's forward pass and the sampler's tensor
ops, without the Redis client, threads or the event loop (``bench token-path`` measures the
whole process): a simulated engine's step (scheduling, block bookkeeping, appending and
detokenizing each token, stop checks) with the step observer's metrics and the occupancy
snapshot (``EngineLoop._refresh``), and the step's write
as the engine loop builds it (``EngineLoop._encode``: the record a retry's replay keeps, and
the messages serialized as the writer sends them, one ``StepOutputs`` a gateway field).
``--batch`` requests of ``--max-tokens`` tokens run to the end, ``--rounds`` times; it prints
CPU µs per token (``time.process_time``) in all and by part.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from .results import header


def measure(batch: int, max_tokens: int, prompt_len: int = 32) -> dict:
    import prometheus_client

    from pagefleet.common import fencing
    from pagefleet.common.metrics import WorkerMetrics
    from pagefleet.common.sampling_params import SamplingParams
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.observe import WorkerObserver
    from pagefleet.worker.sim import SimEngine

    engine = SimEngine("llama-3-8b-h100", time_scale=math.inf, max_num_seqs=batch,
                       num_blocks=batch * ((prompt_len + max_tokens) // 16 + 2), block_size=16)
    observer = WorkerObserver("host-path", WorkerMetrics(prometheus_client.CollectorRegistry()))
    loop = EngineLoop(engine, emit=lambda b: None, notify=lambda: None)
    for i in range(batch):
        rid = f"r{i}"
        engine.add_request(list(range(1, prompt_len + 1)),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.0, seed=i),
                           request_id=rid)
        loop.assignments[rid] = ("1-0", 1, fencing.steps_field("g"))
    tokens = 0
    step_s = write_s = 0.0
    while engine.has_unfinished_requests():  # as EngineLoop._run does a step
        a = time.process_time()
        probe = observer.before_step(engine)
        deltas = engine.step()
        b = time.process_time()
        step = loop._encode(deltas)
        c = time.process_time()
        rebuilt = loop._refresh(after_step=step is None or not step.finals)
        observer.after_step(probe, engine, deltas, loop.snapshot if rebuilt else None)
        d = time.process_time()
        step_s, write_s = step_s + (b - a) + (d - c), write_s + c - b
        tokens += sum(len(x.token_ids) for x in deltas)
    us = lambda s: round(1e6 * s / tokens, 2)  # noqa: E731
    return {"batch": batch, "tokens": tokens, "us_per_token": us(step_s + write_s),
            "step_us": us(step_s), "write_us": us(write_s)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench host-path", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, action="append", help="running requests (repeatable; default 16 and 64)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    batches = args.batch or [16, 64]
    if any(b < 1 for b in batches) or args.max_tokens < 1 or args.rounds < 1:
        p.error("--batch, --max-tokens and --rounds must be at least 1")
    rows = []
    for b in batches:
        for _ in range(args.rounds):
            r = measure(b, args.max_tokens)
            rows.append(r)
            print(f"batch {b}: {r['us_per_token']:.2f} us/token (step and observer {r['step_us']:.2f}, "
                  f"the step's write {r['write_us']:.2f})", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**header("host-path", "pagefleet bench host-path"), "rows": rows},
                                              indent=2))
    return 0
