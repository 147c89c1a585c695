"""The same trace through an ``Engine`` in this process: the baseline without the cluster's
path (``--compare-in-process``), and its TTFT for one-token requests (``--probe``).

The engine runs on a thread of its own, as in a worker. A request's clock starts at its
arrival time, or when a ``--max-concurrency`` slot freed up if it had to wait for one;
a step's tokens arrive when the step returns.
"""

from __future__ import annotations

import threading
import time

from .backends import Sampling
from .datasets import SampleRequest
from .loadgen import progress_bar
from .serve_metrics import RequestResult


def run_engine(engine, requests: list[SampleRequest], arrivals: list[float], max_concurrency: int | None,
               sampling: Sampling, *, label: str = "in-process", progress: bool = True,
               ) -> tuple[list[RequestResult], float]:
    from pagefleet import SamplingParams

    results = [RequestResult(prompt_len=r.prompt_len, expected_output_len=r.expected_output_len) for r in requests]
    last_seen: dict[int, float] = {}
    ids: dict[str, int] = {}
    bar = progress_bar(len(requests), label, progress)
    start = time.perf_counter()
    slot_freed = start
    num_held = 0  # requests [0, num_held) arrived while every --max-concurrency slot was taken
    nxt = live = 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(requests) and start + arrivals[nxt] <= now:
            if max_concurrency and live >= max_concurrency:
                while num_held < len(requests) and start + arrivals[num_held] <= now:
                    num_held += 1
                break
            req = requests[nxt]
            params = SamplingParams(max_tokens=req.expected_output_len, ignore_eos=sampling.ignore_eos,
                                    **({} if sampling.temperature is None else {"temperature": sampling.temperature}))
            ids[engine.add_request(req.prompt, params)] = nxt
            # A request that waited for a slot is sent when the slot freed (the step's end).
            results[nxt].start_time = last_seen[nxt] = slot_freed if nxt < num_held else start + arrivals[nxt]
            nxt += 1
            live += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.001, start + arrivals[nxt] - time.perf_counter())))
            continue
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            i = ids[d.request_id]
            r = results[i]
            if d.token_ids:
                if r.output_tokens == 0:
                    r.ttft = now - r.start_time
                else:
                    r.itl.append(now - last_seen[i])
                last_seen[i] = now
                r.output_tokens += len(d.token_ids)
                r.generated_text += d.text
            if d.finish_reason:
                r.latency = last_seen[i] - r.start_time
                r.success = d.finish_reason in ("stop", "length") and r.output_tokens > 0
                r.error = "" if r.success else f"finish reason {d.finish_reason}"
                live -= 1
                slot_freed = now
                bar.update(1)
    bar.close()
    return results, time.perf_counter() - start


def probe_engine(engine, prompts: list[SampleRequest]) -> list[float]:
    """TTFT of one-token requests, one after another (seconds)."""
    from pagefleet import SamplingParams

    out = []
    for req in prompts:
        t0 = time.perf_counter()
        engine.add_request(req.prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while not any(d.token_ids for d in engine.step()):
            pass
        out.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def on_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread of its own (as the worker runs its engine)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), name="engine")
    t.start()
    t.join()
    return out[0]
