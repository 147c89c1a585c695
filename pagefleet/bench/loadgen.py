"""When requests leave, and how many may be out at once (``vllm bench serve``'s traffic).

``--request-rate R`` spaces requests by gaps drawn from a gamma distribution of shape
``--burstiness b`` and mean ``1/R`` (``b = 1``: a Poisson process; ``b < 1`` burstier,
``b > 1`` more even), rescaled so the last leaves at ``n/R`` seconds as vLLM does; ``inf``
sends all at once. ``--max-concurrency C`` holds a request back while ``C`` are out, so
with both the real rate can fall below ``R``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from .datasets import SampleRequest
from .serve_metrics import RequestResult


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``n`` requests leaves."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if n == 0 or request_rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / request_rate) / times[-1]).tolist()


def progress_bar(total: int, label: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


async def run_trace(backend, requests: list[SampleRequest], arrivals: list[float], max_concurrency: int | None,
                    *, label: str = "", progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request at its time through ``backend``; the results (in request order)
    and the run's duration, from the start to the last response."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(len(requests), label, progress)

    async def one(req: SampleRequest) -> RequestResult:
        if gate is None:
            result = await backend.send(req)
        else:
            async with gate:
                result = await backend.send(req)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for req, at in zip(requests, arrivals, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def warm_up(backend, req: SampleRequest, num_warmups: int, max_concurrency: int | None) -> None:
    """vLLM's warm-up: ``num_warmups`` copies of the first request, within the concurrency.
    RuntimeError if one fails: the run would only measure errors."""
    if num_warmups > 0:
        results, _ = await run_trace(backend, [req] * num_warmups, [0.0] * num_warmups, max_concurrency,
                                     label="warm-up", progress=False)
        failed = [r.error for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} of {num_warmups} warm-up requests failed: {failed[0][:500]}")


async def probe_ttft(backend, prompts: list[SampleRequest]) -> list[float]:
    """TTFT of one-token requests sent one after another (seconds)."""
    out = []
    for req in prompts:
        r = await backend.send(req, max_tokens=1)
        if r.success:
            out.append(r.ttft)
    return out
