"""The reliability suite's load: jobs with client-chosen ids, clients that fail over to
another gateway, and the accounting of what came back against an undisturbed reference.

A ``Job`` is one request with its own id, greedy or seeded-sampled (a seeded request's
tokens depend on its seed and their positions only, so both kinds have one right answer).
``Load`` runs jobs from ``concurrency`` asyncio tasks on a thread of its own (the caller
is free to kill processes meanwhile). A task sends its job to one gateway; on
``UNAVAILABLE`` (gateway gone, Redis away at enqueue) it sends the same id to the next
gateway, which relays the request's output from the start instead of generating again.
Tokens are assembled by index (``Outcome.add``), so a retry's replay is harmless and a
token that comes back different is caught.

``Tally.of`` counts, against the reference (``reference_tokens``: the same jobs on an
in-process engine, run to completion with nothing disturbed):

* completed: the stream ended with ``length`` or ``stop``; lost: every other job (error,
  abort, a status that is not a retry, or no end before the job's deadline);
* duplicated: an index that arrived again with a different token, or a token past
  ``max_tokens``;
* missing: reference tokens a completed stream never delivered (it ended early or left a gap);
* differing: delivered tokens that are not the reference's.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pagefleet.client import FINISH_NAMES, AsyncClient
from pagefleet.protos import generation_pb2 as pb

# Clients reconnect quickly to a gateway that comes back (gRPC's default backoff grows to 2 minutes).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
SEEDED = dict(temperature=0.9, top_p=0.95)
# Token ids the prompts are drawn from (the tiny model's byte vocabulary, special ids left out).
PROMPT_IDS = (3, 256)


@dataclass(frozen=True, slots=True)
class Job:
    """One request; ``seed`` None: greedy, else sampled with ``SEEDED`` and this seed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int | None = None
    priority: int = 0

    def kwargs(self) -> dict:
        """``AsyncClient.generate_stream`` keyword arguments (the prompt aside)."""
        sampling = dict(temperature=0.0) if self.seed is None else dict(SEEDED, seed=self.seed)
        return dict(max_tokens=self.max_tokens, ignore_eos=True, priority=self.priority,
                    request_id=self.request_id, **sampling)

    def sampling_params(self):
        from pagefleet.common.sampling_params import SamplingParams

        sampling = dict(temperature=0.0) if self.seed is None else dict(SEEDED, seed=self.seed)
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, **sampling)


def make_jobs(n: int, tag: str, *, seed: int = 0, prompt_len: tuple[int, int] = (8, 40),
              max_tokens: tuple[int, int] = (16, 48), priorities: Sequence[int] = (0,)) -> list[Job]:
    """``n`` jobs, alternately greedy and seeded, ids ``<tag>-<i>`` (unique per run: ``tag``
    should name the run, since an id is an idempotency key for minutes)."""
    rng = random.Random(f"{tag}/{seed}")
    jobs = []
    for i in range(n):
        prompt = tuple(rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*prompt_len)))
        jobs.append(Job(f"{tag}-{i}", prompt, rng.randint(*max_tokens),
                        None if i % 2 == 0 else rng.randrange(1 << 62), rng.choice(priorities)))
    return jobs


def reference_tokens(jobs: Sequence[Job], model: str = "tiny", sim_profile: str | None = None
                     ) -> dict[str, list[int]]:
    """Each job's tokens from an in-process engine, all run together, nothing disturbed
    (``sim_profile``: a simulated engine's, for a cluster of ``--engine sim`` workers)."""
    from pagefleet.common.blocks import num_blocks_for

    size = 16
    num_blocks = sum(num_blocks_for(len(j.prompt_token_ids) + j.max_tokens, size) for j in jobs)
    common = dict(block_size=size, num_blocks=num_blocks, max_num_seqs=max(1, len(jobs)))
    if sim_profile is not None:
        import math

        from pagefleet.worker.sim import SimEngine

        engine = SimEngine(sim_profile, model, time_scale=math.inf, **common)
    else:
        from pagefleet.worker.engine import Engine

        engine = Engine(model, device="cpu", **common)
    outs = engine.generate([list(j.prompt_token_ids) for j in jobs], [j.sampling_params() for j in jobs])
    return {j.request_id: o.token_ids for j, o in zip(jobs, outs, strict=True)}


@dataclass(slots=True)
class Outcome:
    """What the client saw of one job, assembled by token index."""

    job: Job
    tokens: dict[int, int] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str = ""
    num_conflicts: int = 0  # indices that arrived again with a different token
    num_attempts: int = 0
    sent_at: float = 0.0  # time.perf_counter() of the first attempt
    first_token_at: float | None = None
    finished_at: float | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        now = time.perf_counter()
        for i, t in enumerate(msg.token_ids, msg.index):
            old = self.tokens.setdefault(i, t)
            if old != t:
                self.num_conflicts += 1
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_NAMES[msg.finish_reason]
            self.error = msg.error
            self.finished_at = now

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop")

    @property
    def num_extra(self) -> int:
        """Tokens past ``max_tokens``."""
        return sum(1 for i in self.tokens if i >= self.job.max_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_at is None or self.finished_at is None or len(self.tokens) < 2:
            return None
        return (self.finished_at - self.first_token_at) / (len(self.tokens) - 1)


@dataclass(slots=True)
class Tally:
    sent: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    missing: int = 0
    differing: int = 0
    num_retries: int = 0  # attempts beyond each job's first
    errors: Counter = field(default_factory=Counter)  # why lost jobs were lost
    lost_ids: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, outcomes: Sequence[Outcome], reference: dict[str, list[int]]) -> Tally:
        t = cls(sent=len(outcomes))
        for o in outcomes:
            want = reference[o.job.request_id]
            t.num_retries += max(0, o.num_attempts - 1)
            t.duplicated += o.num_conflicts + o.num_extra
            t.differing += sum(1 for i, tok in o.tokens.items() if i < len(want) and want[i] != tok)
            if o.completed:
                t.completed += 1
                t.missing += sum(1 for i in range(len(want)) if i not in o.tokens)
            else:
                t.lost += 1
                t.errors[o.error or o.finish_reason or "no end"] += 1
                t.lost_ids.append(o.job.request_id)
        return t

    def figures(self) -> dict:
        return dict(sent=self.sent, completed=self.completed, lost=self.lost, duplicated=self.duplicated,
                    missing=self.missing, differing=self.differing)


def retry_delay_s(err: grpc.aio.AioRpcError) -> float | None:
    """The ``RetryInfo`` delay a refusal carries, None if it carries none."""
    from google.rpc import error_details_pb2, status_pb2

    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for d in status.details:
                info = error_details_pb2.RetryInfo()
                if d.Unpack(info):
                    return info.retry_delay.ToTimedelta().total_seconds()
    return None


class Load:
    """``jobs`` through the gateways at ``targets`` from ``concurrency`` tasks, on a thread.

    ``start()``, then ``wait_fraction()`` to time a disturbance, then ``join()`` for the
    outcomes (in job order). A job not ended ``request_timeout_s`` after it was first sent
    is given up (lost).
    """

    def __init__(self, targets: Sequence[str], jobs: Sequence[Job], concurrency: int,
                 request_timeout_s: float = 120.0) -> None:
        self.targets = list(targets)
        self.jobs = list(jobs)
        self.concurrency = concurrency
        self.request_timeout_s = request_timeout_s
        self.outcomes = [Outcome(j) for j in self.jobs]
        self.num_done = 0
        self.codes: Counter = Counter()  # status codes that made a client retry
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def wait_fraction(self, fraction: float, timeout_s: float = 300.0) -> None:
        """Until ``fraction`` of the jobs have ended."""
        deadline = time.monotonic() + timeout_s
        while self.num_done < fraction * len(self.jobs) and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.num_done} of {len(self.jobs)} jobs ended in {timeout_s}s")
            time.sleep(0.02)

    def join(self, timeout_s: float | None = None) -> list[Outcome]:
        self._thread.join(timeout_s if timeout_s is not None else self.request_timeout_s * 2 + 60)
        if self._thread.is_alive():
            raise TimeoutError("the load did not end")
        return self.outcomes

    async def _main(self) -> None:
        clients = [AsyncClient(t, options=CHANNEL_OPTIONS) for t in self.targets]
        todo: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(self.jobs)):
            todo.put_nowait(i)

        async def client_task(k: int) -> None:
            while not todo.empty():
                i = todo.get_nowait()
                await self._run(clients, self.outcomes[i], first=(k + i) % len(clients))
                self.num_done += 1

        try:
            await asyncio.gather(*(client_task(k) for k in range(self.concurrency)))
        finally:
            for c in clients:
                await c.close()

    async def _run(self, clients: list[AsyncClient], out: Outcome, first: int) -> None:
        job = out.job
        out.sent_at = time.perf_counter()
        deadline = out.sent_at + self.request_timeout_s
        g, delay = first, 0.05
        while out.finish_reason is None:
            left = deadline - time.perf_counter()
            if left <= 0:
                out.error = f"no end within {self.request_timeout_s:g}s"
                return
            out.num_attempts += 1
            try:
                async for msg in clients[g].generate_stream(list(job.prompt_token_ids), timeout=left, **job.kwargs()):
                    out.add(msg)
                if out.finish_reason is None:
                    out.error = "the stream ended without a finish reason"
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE:  # this gateway (or its Redis) is away: the next one
                    g = (g + 1) % len(clients)
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    delay = retry_delay_s(e) or delay
                else:
                    out.error = f"{code.name}: {e.details()}"
                    return
                self.codes[code.name] += 1
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
