"""``pagefleet bench host-path``: a worker's host work per output token, in one process.

What a worker does for each token outside the model's forward pass and the sampler's tensor
ops, without the Redis client, threads or the event loop (``bench token-path`` measures the
whole process): a simulated engine's step (scheduling, block bookkeeping, appending and
detokenizing each token, stop checks) with the step observer's metrics and the occupancy
snapshot (``EngineLoop._refresh``), and the step's write
as the engine loop builds it (``EngineLoop._encode``: the record a retry's replay keeps, and
the messages serialized as the writer sends them, one ``StepOutputs`` a gateway field).
``--batch`` requests of ``--prompt-len`` prompt tokens (no two sharing a prefix) and
``--max-tokens`` output tokens run to the end, ``--rounds`` times; the steps once every prompt is
computed are timed, and it prints CPU µs per token they made (``time.thread_time``: the one
thread that runs it all) in all and by part.

``--engine model`` runs the real engine on the CPU (``--model``, ``tiny`` by default; torch on
this one thread; its step inputs staged, as on every device; ``--device cuda`` on a GPU) with the forward
pass and the sampler excluded: the step's thread CPU less the model's
(``ModelRunner.last_model_cpu_seconds``) and the sampler's (``last_sample_cpu_seconds``: its
tensor ops and its one read of the ids). What is left is the host path the engine adds on any
device: building the step's inputs, scheduling and block
bookkeeping, appending and detokenizing each token, stop checks, the metrics, the snapshot and
the step's write. ``--engine sim`` (the default) is the simulated worker ``bench token-path``
runs; its model (the cost model of its step and its token draw, ``SimExecutor``'s
``last_model_cpu_seconds``) is left out the same way.

``--touch-mb N`` reads N MB between steps, outside the timing: what the Python host path costs
with cold caches, as after a forward pass on the CPU or, in a cluster, after the other
processes ran between two paced steps. ``--idle-ms N`` sleeps N ms between steps instead (or
as well): a worker paced by its device (a simulated one sleeps) finds its caches cold too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

from .results import header


def _engine(kind: str, model: str, batch: int, num_blocks: int, device: str = "cpu"):
    """The engine, and a function that takes the CPU seconds of the last step's forward pass and
    sampler (what is left out; zero for a simulated engine)."""
    if kind == "sim":
        from pagefleet.worker.sim import SimEngine

        engine = SimEngine("llama-3-8b-h100", time_scale=math.inf, max_num_seqs=batch, num_blocks=num_blocks,
                           block_size=16)
        executor = engine.executor

        def take_sim() -> float:  # the simulated model's (its cost model and token draw), read once
            seconds, executor.last_model_cpu_seconds = executor.last_model_cpu_seconds, 0.0
            return seconds

        return engine, take_sim
    from pagefleet.worker.engine import Engine

    engine = Engine(model, device=device, max_num_seqs=batch, num_blocks=num_blocks, block_size=16)
    runner = engine.executor.runner
    runner.profile = True

    def take() -> float:  # read once: a step that runs no model leaves nothing to subtract
        seconds = runner.last_model_cpu_seconds + runner.last_sample_cpu_seconds
        runner.last_model_cpu_seconds = runner.last_sample_cpu_seconds = 0.0
        return seconds

    return engine, take


@contextlib.contextmanager
def _one_torch_thread(kind: str):
    """The real engine's forward on this thread alone, where its CPU is subtracted (restored after)."""
    if kind == "sim":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(batch: int, max_tokens: int, prompt_len: int = 32, engine: str = "sim", model: str = "tiny",
            touch_mb: int = 0, idle_ms: float = 0.0, device: str = "cpu") -> dict:
    """``engine``: ``sim`` or ``model`` (the real engine on the CPU, its forward pass and
    sampler excluded). ``touch_mb``: read that many MB between steps, untimed (the caches as
    a forward pass on the CPU, or the other processes of a machine between paced steps, leave them);
    ``idle_ms``: sleep that long between steps (as a paced worker waits for its next step).
    ``max_tokens`` is at least 2: a request's first token comes with its prompt's step, untimed.
    ``device``: where the real engine runs (``cpu``, ``cuda``); its forward pass's CPU (launches
    and the wait for the device included) is left out either way."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (the first comes with the prompt), got {max_tokens}")
    with _one_torch_thread(engine):
        return _measure(batch, max_tokens, prompt_len, engine, model, touch_mb, idle_ms, device)


def _measure(batch: int, max_tokens: int, prompt_len: int, engine: str, model: str, touch_mb: int,
             idle_ms: float, device: str) -> dict:
    import numpy as np
    import prometheus_client

    from pagefleet.common import fencing
    from pagefleet.common.metrics import WorkerMetrics
    from pagefleet.common.sampling_params import SamplingParams
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.observe import WorkerObserver

    kind = engine
    engine, excluded = _engine(kind, model, batch, batch * ((prompt_len + max_tokens) // 16 + 2), device)
    observer = WorkerObserver("host-path", WorkerMetrics(prometheus_client.CollectorRegistry()))
    loop = EngineLoop(engine, emit=lambda b: None, notify=lambda: None)
    for i in range(batch):
        rid = f"r{i}"
        engine.add_request([1 + (i * 7 + j) % 250 for j in range(prompt_len)],  # no two share a prefix
                           SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.0, seed=i,
                                          ignore_eos=True),
                           request_id=rid)
        loop.hold(rid, "1-0", 1, fencing.steps_field("g"))
    tokens = 0
    step_s = write_s = model_s = 0.0
    clock = time.thread_time
    other = np.ones(touch_mb * 2**20 // 8) if touch_mb else None
    prompts_done = False  # the steps that compute prompts are run, not timed: decode steps are
    while engine.has_unfinished_requests():  # as EngineLoop._run does a step
        prompts_done = prompts_done or all(r.num_computed_tokens >= r.num_prompt_tokens
                                           for r in engine.requests.values())
        if other is not None:
            other.sum()
        if idle_ms:
            time.sleep(idle_ms / 1000)
        a = clock()
        probe = observer.before_step(engine)
        deltas = engine.step()
        b = clock()
        left_out = excluded()
        step = loop._encode(deltas)
        c = clock()
        rebuilt = loop._refresh(after_step=step is None or not step.finals)
        observer.after_step(probe, engine, deltas, loop.snapshot if rebuilt else None)
        d = clock()
        if prompts_done:
            step_s, write_s, model_s = step_s + (b - a) - left_out + (d - c), write_s + c - b, model_s + left_out
            tokens += sum(len(x.token_ids) for x in deltas)
    us = lambda s: round(1e6 * s / tokens, 2)  # noqa: E731
    return {"engine": kind, "device": device if kind == "model" else "sim", "batch": batch, "prompt_len": prompt_len, "touch_mb": touch_mb, "idle_ms": idle_ms,
            "tokens": tokens, "us_per_token": us(step_s + write_s),
            "step_us": us(step_s), "write_us": us(write_s), "excluded_us": us(model_s)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench host-path", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, action="append", help="running requests (repeatable; default 16 and 64)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32, help="each request's prompt (the context its steps read)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engine", default="sim", choices=("sim", "model"),
                   help="sim: the simulated worker, its simulated model (cost model, token draw) excluded; "
                        "model: the real engine on the CPU, its forward pass and sampler excluded")
    p.add_argument("--model", default="tiny", help="--engine model: the model (a name or a checkpoint folder)")
    p.add_argument("--device", default="cpu", help="--engine model: cpu or cuda (the forward's CPU is left out on either)")
    p.add_argument("--touch-mb", type=int, default=0,
                   help="read this many MB between steps, untimed: the caches as a forward pass on the CPU or "
                        "other processes between paced steps leave them")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="sleep this long between steps, untimed (a worker paced by its device waits between steps)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    batches = args.batch or [16, 64]
    if any(b < 1 for b in batches) or args.rounds < 1 or args.prompt_len < 1:
        p.error("--batch, --prompt-len and --rounds must be at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (a request's first token comes with its prompt's step, untimed)")
    if not 0 <= args.touch_mb <= 4096:
        p.error("--touch-mb must be between 0 and 4096")
    if not 0 <= args.idle_ms <= 1000:
        p.error("--idle-ms must be between 0 and 1000")
    rows = []
    for b in batches:
        for _ in range(args.rounds):
            try:
                r = measure(b, args.max_tokens, args.prompt_len, engine=args.engine, model=args.model,
                            touch_mb=args.touch_mb, idle_ms=args.idle_ms, device=args.device)
            except ValueError as e:  # the engine refuses what it cannot run (a prompt past its model's length)
                p.error(str(e))
            rows.append(r)
            model = "forward pass and sampler" if args.engine == "model" else "the simulated model"
            left_out = f"; {model}, left out: {r['excluded_us']:.2f}"
            touched = (f", {args.touch_mb} MB read between steps" if args.touch_mb else "") + (
                f", {args.idle_ms:g} ms idle between steps" if args.idle_ms else "")
            print(f"{args.engine} batch {b}{touched}: {r['us_per_token']:.2f} us/token (step and observer {r['step_us']:.2f}, "
                  f"the step's write {r['write_us']:.2f}{left_out})", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**header("host-path", "pagefleet bench host-path"), "rows": rows},
                                              indent=2))
    return 0
