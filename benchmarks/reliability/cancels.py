"""``cancels``: requests cancelled at random moments; no worker may keep a block.

Two small-pool workers (32 blocks of 16 tokens, a swap pool, ``--preemption swap``) and a
scheduler with little headroom and directed preemption by priority: sequences outgrow
their pool, so some are swapped out when their cancel comes. Each request is cancelled
after a random delay (none at all, up to 50 ms, up to 1 s, or 1 to 4 s), half by a
``Cancel`` call to the *other* gateway, half by dropping the stream. Meanwhile workers are
killed (and replaced), so some cancels find their request being re-assigned.

The moment of each cancel is read from the scheduler's view (sampled every 50 ms) and
what the client had received: queued (not on a worker yet), prefilling (on a worker, no
token yet), decoding, swapped (held by a worker with no device blocks while it has
sequences swapped out), re-assigned (on the worker just killed, not yet placed again).

Counted: a cancelled stream must end (``abort``, or ``length`` if it finished first;
``lost`` otherwise); tokens duplicated (an index twice with different tokens, or past
``max_tokens``); tokens differing from the reference, on a sample of the requests (200 in
the full form); and,
at the end, blocks and requests still held by any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
import time
from collections import Counter

import grpc

from pagefleet.client import AsyncClient
from pagefleet.protos import cluster_pb2, cluster_pb2_grpc

from .cluster import ReliabilityCluster, Row, Settings
from .load import CHANNEL_OPTIONS, Job, Outcome, make_jobs, reference_tokens

CONCURRENCY = 24
WORKER_ARGS = ["--num-blocks", "32", "--num-swap-blocks", "512", "--preemption", "swap"]
SCHEDULER_ARGS = ["--dead-after", "1.0", "--headroom-tokens", "8", "--preempt-mode", "swap"]


class Views:
    """The scheduler's view, sampled; ``moment(rid)`` classifies a request's state now."""

    def __init__(self) -> None:
        self.waiting: set[str] = set()
        self.with_blocks: set[str] = set()
        self.held: dict[str, bool] = {}  # request id -> its worker has sequences swapped out
        self.reassigning: set[str] = set()  # on a worker that was just killed
        self.lock = threading.Lock()

    def update(self, state: cluster_pb2.SchedulerState) -> None:
        held, blocks = {}, set()
        for w in state.workers:
            r = w.report
            blocks.update(r.blocks_per_request)
            held.update((rid, r.num_swapped > 0) for rid in r.request_ids)
        with self.lock:
            self.waiting = set(state.waiting_request_ids)
            self.with_blocks, self.held = blocks, held
            self.reassigning -= set(held)

    def worker_killed(self, request_ids) -> None:
        with self.lock:
            self.reassigning |= set(request_ids)

    def moment(self, rid: str, out: Outcome) -> str:
        with self.lock:
            if rid in self.reassigning:
                return "re-assigned"
            if rid in self.held and rid not in self.with_blocks and self.held[rid]:
                return "swapped"
            if out.tokens:
                return "decoding"
            if rid in self.with_blocks or rid in self.held:
                return "prefilling"
            return "queued"


class CancelStorm:
    """Sends ``jobs`` and cancels each at a random moment, on a thread of its own."""

    def __init__(self, targets: list[str], scheduler_target, jobs: list[Job], seed: int = 0) -> None:
        self.targets = targets
        self.scheduler_target = scheduler_target  # () -> host:port of the active scheduler
        self.jobs = jobs
        self.rng = random.Random(seed)
        self.views = Views()
        self.outcomes = [Outcome(j) for j in jobs]
        self.moments: Counter = Counter()
        self.ways: Counter = Counter()
        self.num_done = 0
        self.num_failed_cancels = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="cancels", daemon=True)

    def start(self) -> CancelStorm:
        self._thread.start()
        return self

    def wait_fraction(self, fraction: float) -> None:
        """Until ``fraction`` of the jobs have ended (or the storm stopped)."""
        while self.num_done < fraction * len(self.jobs) and self._thread.is_alive():
            time.sleep(0.05)

    def join(self, timeout_s: float) -> list[Outcome]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the cancel storm did not end")
        return self.outcomes

    async def _main(self) -> None:
        clients = [AsyncClient(t, options=CHANNEL_OPTIONS) for t in self.targets]
        sampler = asyncio.create_task(self._sample())
        todo = iter(range(len(self.jobs)))

        async def client_task(k: int) -> None:
            for i in todo:
                await self._one(clients, self.outcomes[i], k)
                self.num_done += 1

        try:
            await asyncio.gather(*(client_task(k) for k in range(CONCURRENCY)))
        finally:
            sampler.cancel()
            for c in clients:
                await c.close()

    async def _sample(self) -> None:
        while True:
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                async with grpc.aio.insecure_channel(self.scheduler_target()) as ch:
                    while True:
                        state = await cluster_pb2_grpc.SchedulerStub(ch).GetState(cluster_pb2.GetStateRequest(),
                                                                                  timeout=2)
                        if not state.active:
                            break
                        self.views.update(state)
                        await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)

    async def _one(self, clients: list[AsyncClient], out: Outcome, k: int) -> None:
        job = out.job
        here, other = clients[k % 2], clients[(k + 1) % 2]
        out.sent_at = time.perf_counter()
        call = here.generate_stream(list(job.prompt_token_ids), timeout=120, **job.kwargs())
        reader = asyncio.create_task(self._read(call, out))
        r = self.rng.random()
        delay = (0.0 if r < 0.2 else self.rng.uniform(0, 0.05) if r < 0.45 else self.rng.uniform(0.05, 1.0)
                 if r < 0.85 else self.rng.uniform(1.0, 4.0))
        await asyncio.sleep(delay)
        self.moments["finished first" if out.finish_reason else self.views.moment(job.request_id, out)] += 1
        if self.rng.random() < 0.5:
            self.ways["Cancel call"] += 1
            for attempt in range(20):
                try:
                    await other.cancel(job.request_id)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05 * (attempt + 1))
            else:
                self.num_failed_cancels += 1
            await asyncio.wait([reader], timeout=60)
            if not reader.done():
                reader.cancel()
                out.error = "no end within 60 s of its cancel"
        else:
            self.ways["stream dropped"] += 1
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            out.finish_reason = out.finish_reason or "dropped"

    @staticmethod
    async def _read(call, out: Outcome) -> None:
        out.num_attempts = 1
        try:
            async for msg in call:
                out.add(msg)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                out.error = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            pass


def run(s: Settings) -> Row:
    name = "cancels"
    num_cancels = s.pick(100, 10_000)
    kills = s.pick(1, 4)
    jobs = make_jobs(num_cancels, name, prompt_len=(8, 64), max_tokens=(32, 160), priorities=(0, 0, 1, 2))
    step = max(1, len(jobs) // s.pick(20, 200))  # the jobs whose tokens are checked
    reference = reference_tokens(jobs[::step])
    started = time.perf_counter()
    with ReliabilityCluster(s, name, worker_args=WORKER_ARGS, scheduler_args=SCHEDULER_ARGS) as c:
        def scheduler_target() -> str:
            active = c.active_scheduler() or "scheduler"
            return f"127.0.0.1:{c.c.scheduler_ports[active]}"

        storm = CancelStorm(c.gateway_targets, scheduler_target, jobs).start()
        preemptions = 0
        for k in range(kills):
            storm.wait_fraction((k + 1) / (kills + 1))
            reports = c.reports()
            victim = max((w for w in reports if w in c.c.procs), key=lambda w: len(reports[w].request_ids))
            preemptions += reports[victim].num_preemptions
            storm.views.worker_killed(reports[victim].request_ids)
            c.c.kill(victim, signal.SIGKILL)
            c.c.add_worker()
        outcomes = storm.join(timeout_s=3600)
        held = c.wait_idle()
        left = c.stream_entries() if held["stream_entries"] else []
        state = c.state()
        preemptions += sum(w.report.num_preemptions for w in state.workers)
        num_reassigned = state.num_reassigned
    checked = {o.job.request_id: o for o in outcomes if o.job.request_id in reference}
    lost = [o for o in outcomes if o.error or o.finish_reason not in ("abort", "length", "stop", "dropped")]
    ended = Counter(o.finish_reason for o in outcomes)
    leaked = {k: v for k, v in held.items() if k != "workers" and v}
    figures = {"cancel moments": dict(storm.moments.most_common()), "ways": dict(storm.ways),
               "stream ends": dict(ended.most_common()), "preemptions": preemptions,
               "workers killed": kills, "requests resumed elsewhere": num_reassigned,
               "tokens checked against the reference": sum(len(o.tokens) for o in checked.values())}
    if lost:
        figures["lost because"] = dict(Counter(o.error or str(o.finish_reason) for o in lost).most_common(3))
        figures["lost, e.g."] = [o.job.request_id for o in lost[:3]]
    if storm.num_failed_cancels:
        figures["Cancel calls that failed"] = storm.num_failed_cancels
    figures["held at the end"] = leaked or "nothing"
    if left:
        figures["left in the requests stream"] = left
    differing = sum(1 for rid, o in checked.items() for i, t in o.tokens.items()
                    if i < len(reference[rid]) and reference[rid][i] != t)
    missing = sum(o.job.max_tokens - len(o.tokens) for o in outcomes if o.finish_reason == "length")
    goals = {"0 blocks leaked on any worker": not leaked}
    return Row(name, sent=len(outcomes), completed=len(outcomes) - len(lost), lost=len(lost),
               duplicated=sum(o.num_conflicts + o.num_extra for o in outcomes), missing=missing,
               differing=differing, seconds=round(time.perf_counter() - started, 1), figures=figures, goals=goals)
