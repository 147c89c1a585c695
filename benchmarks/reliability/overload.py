"""``overload``: ten times the sustainable rate; the admitted are served as if unloaded,
the rest are refused at once with a ``RetryInfo``.

The workers run at most ``MAX_NUM_SEQS`` sequences each (the scheduler places no more
there), and the gateways refuse (``RESOURCE_EXHAUSTED``) while ``--max-queue`` requests
wait to be placed. Three phases on one cluster, every request the same shape:

1. unloaded: Poisson arrivals at a quarter of the rate the cluster sustains (estimated
   from its batch capacity), one attempt each: p99 TTFT and TPOT;
2. sustainable rate: a closed loop with as many clients as the workers have sequence
   slots: completions per second;
3. overload: Poisson arrivals at ten times that rate, one attempt each (no retries):
   admitted requests' p99 TTFT and TPOT against 1.5x the unloaded p99, refusals' latency
   (call to status, at the client) against 10 ms p99, and a ``RetryInfo`` on every refusal.

The admitted requests' tokens are checked against the reference like every row's.

The workers are simulated (``--engine sim``, profile ``SIM_PROFILE``: a Llama-3-8B on an
H100's step times, slept out, tokens from (seed, position)): the real worker service,
batch scheduler, block pool and report stream, but no model on the CPU. With two CPU
model engines the runner's two cores went to the engines at ten times the rate, and the
gateways, scheduler and load generator waited for the CPU (admitted p99 TTFT 1,090 ms
against 92 ms unloaded, refusals p99 255 ms, on a quiet 2-vCPU machine): that measured
the runner, not admission. On a GPU the engine's step runs on the device and its step
time grows little with the batch, as the profile's does. ``--sim-time-scale`` below 1 slows
the simulated steps, and with them the rates, for a machine whose CPU ten times the real rate
would saturate (each refusal costs a Python gateway about 1.5 ms of CPU).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import grpc

from pagefleet.client import AsyncClient

from .cluster import ReliabilityCluster, Row, Settings
from .load import (
    CHANNEL_OPTIONS,
    Job,
    Load,
    Outcome,
    Tally,
    make_jobs,
    reference_tokens,
    retry_delay_s,
)

SIM_PROFILE = "llama-3-8b-h100"
MAX_NUM_SEQS = 4
MAX_QUEUE = 1
SHAPE = dict(prompt_len=(16, 16), max_tokens=(24, 24))


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


class Arrivals:
    """``jobs`` sent at Poisson arrivals of ``rate`` per second, one attempt each, on one
    event loop; per job its outcome, and per refusal its latency and whether it carried a
    ``RetryInfo``."""

    def __init__(self, targets: list[str], jobs: list[Job], rate: float, seed: int = 0) -> None:
        self.targets, self.jobs, self.rate = targets, jobs, rate
        self.rng = random.Random(seed)
        self.outcomes = [Outcome(j) for j in jobs]
        self.refusals: list[tuple[float, bool]] = []  # (latency s, RetryInfo present)
        self.codes: dict[str, int] = {}

    def run(self) -> list[Outcome]:
        asyncio.run(self._main())
        return self.outcomes

    async def _main(self) -> None:
        clients = [AsyncClient(t, options=CHANNEL_OPTIONS) for t in self.targets]
        tasks = []
        at = time.perf_counter()
        for i, out in enumerate(self.outcomes):
            at += self.rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(self._one(clients[i % len(clients)], out)))
        await asyncio.gather(*tasks)
        for c in clients:
            await c.close()

    async def _one(self, client: AsyncClient, out: Outcome) -> None:
        out.sent_at = time.perf_counter()
        out.num_attempts = 1
        job = out.job
        try:
            async for msg in client.generate_stream(list(job.prompt_token_ids), timeout=120, **job.kwargs()):
                out.add(msg)
        except grpc.aio.AioRpcError as e:
            latency = time.perf_counter() - out.sent_at
            self.codes[e.code().name] = self.codes.get(e.code().name, 0) + 1
            out.error = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.refusals.append((latency, retry_delay_s(e) is not None))


def _latencies(outcomes: list[Outcome]) -> tuple[list[float], list[float]]:
    done = [o for o in outcomes if o.completed]
    return [o.ttft_s for o in done if o.ttft_s is not None], [o.tpot_s for o in done if o.tpot_s is not None]


def run(s: Settings) -> Row:
    name = "overload"
    unloaded_s, overload_s = s.pick(8.0, 30.0), s.pick(6.0, 30.0)
    started = time.perf_counter()
    num_workers = 2
    slots = MAX_NUM_SEQS * num_workers
    gateway_args = ["--max-queue", str(MAX_QUEUE), "--max-stream-len", str(slots)]
    worker_args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--engine", "sim", "--sim-profile", SIM_PROFILE,
                   "--time-scale", str(s.sim_time_scale)]
    with ReliabilityCluster(s, name, num_workers=num_workers, worker_args=worker_args,
                            gateway_args=gateway_args, standby=False) as c:
        # 2. sustainable rate first: phase 1's rate comes from it
        closed = make_jobs(s.pick(6, 20) * slots, f"{name}-closed", **SHAPE)
        t0 = time.perf_counter()
        Load(c.gateway_targets, closed, slots).start().join()
        rate = len(closed) / (time.perf_counter() - t0)
        # 1. unloaded
        n = max(20, int(rate / 4 * unloaded_s))
        unloaded = Arrivals(c.gateway_targets, make_jobs(n, f"{name}-unloaded", **SHAPE), rate / 4).run()
        base_ttft, base_tpot = _latencies(unloaded)
        # 3. overload
        over = Arrivals(c.gateway_targets, make_jobs(int(10 * rate * overload_s), f"{name}-over", **SHAPE), 10 * rate)
        outcomes = over.run()
        held = c.wait_idle()
    admitted = [o for o in outcomes if not o.error.startswith("RESOURCE_EXHAUSTED")]
    tally = Tally.of(admitted, reference_tokens([o.job for o in admitted], sim_profile=SIM_PROFILE))
    ttft, tpot = _latencies(admitted)
    refusal_s = [lat for lat, _ in over.refusals]
    leaked = {k: v for k, v in held.items() if k != "workers" and v}
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    figures = {
        "sim time scale": s.sim_time_scale,
        "sustainable req/s": round(rate, 1), "offered req/s": round(10 * rate, 1),
        "admitted": len(admitted), "refused": len(over.refusals),
        "unloaded p99 TTFT / TPOT ms": (ms(p99(base_ttft)), ms(p99(base_tpot))),
        "admitted p99 TTFT / TPOT ms": (ms(p99(ttft)), ms(p99(tpot))),
        "refusal p50 / p99 ms": (ms(statistics.median(refusal_s)) if refusal_s else None, ms(p99(refusal_s))),
    }
    other = {k: v for k, v in over.codes.items() if k != "RESOURCE_EXHAUSTED"}
    if other:
        figures["other errors"] = other
    if leaked:
        figures["held at the end"] = leaked
    goals = {
        "admitted p99 TTFT <= 1.5x unloaded": p99(ttft) <= 1.5 * p99(base_ttft),
        "admitted p99 TPOT <= 1.5x unloaded": p99(tpot) <= 1.5 * p99(base_tpot),
        "refusals p99 <= 10 ms": p99(refusal_s) <= 0.010,
        "every refusal carries RetryInfo": bool(over.refusals) and all(has for _, has in over.refusals),
        "nothing held at the end": not leaked,
    }
    return Row(name, **tally.figures(), seconds=round(time.perf_counter() - started, 1), figures=figures,
               goals=goals)
