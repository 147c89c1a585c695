"""A fleet of simulated workers and the scheduler's policies, on one virtual clock.

What runs is the serving code itself, without its processes: per worker a ``SimEngine``
(the worker-side scheduler, block pool, prefix cache; step times from its profile), its
``EngineStats`` turned into ``OccupancyReport``s as the worker does (``worker/report.py``,
prefix-cache keys through ``KVEventLog``), and the cluster scheduler's own ledger
(``scheduler.ledger.Ledger``, the one the live scheduler drives: the global queue, the worker
table and admission, placement with the prefix index, rounds and directed preemption) on the
simulated clock. Events (arrivals, steps, reports, finishes, ticks) run in time order;
nothing sleeps, so an hour of a 64-GPU fleet takes minutes of one core.

What it leaves out, on purpose: gRPC and Redis. Each hop the real cluster makes through
them (an Assign, a finish seen in the done stream, a report on its stream) costs
``hop_s`` here; ``pagefleet bench scheduler`` measures the real ones. Reports go out every
``report_interval_s`` and after every step that changed which requests a worker holds (the
worker's "large change" notice).

``ideal=True`` is the bound a fleet cannot beat: one engine with the whole fleet's pool,
batch and token budget, each step costing ``a`` and the fleet's share of ``b`` and ``c``
(one queue, perfect balance, no fragmentation), fed directly.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from pagefleet.common.blocks import block_hashes
from pagefleet.common.sampling_params import SamplingParams
from pagefleet.protos import cluster_pb2, generation_pb2
from pagefleet.scheduler.ledger import Ledger, LedgerConfig
from pagefleet.scheduler.placement import PlacementConfig
from pagefleet.scheduler.workers import WorkerEntry
from pagefleet.worker.kv_events import KVEventLog
from pagefleet.worker.report import occupancy_report
from pagefleet.worker.sim import SimEngine
from pagefleet.worker.sim_profile import SimProfile, StepTimeModel

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float
    priority: int = 0
    deadline_s: float | None = None  # absolute, on the simulated clock


@dataclass(slots=True)
class Outcome:
    """What a client saw of one request (seconds on the simulated clock)."""

    arrival_s: float
    priority: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    num_tokens: int = 0
    finish_reason: str = ""  # "length" | "stop" | "deadline" | "" (unfinished when the run ended)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.num_tokens < 2:
            return 0.0 if self.finish_s is not None and self.num_tokens == 1 else None
        return (self.finish_s - self.first_token_s) / (self.num_tokens - 1)


@dataclass(slots=True)
class _Worker:
    engine: SimEngine
    entry: WorkerEntry
    events: object  # KVEventStream
    log: KVEventLog
    busy: bool = False  # a step event is pending
    seq: int = 0
    last_ids: frozenset = field(default_factory=frozenset)


@dataclass
class FleetConfig:
    num_workers: int = 64
    profile: SimProfile | None = None
    policy: str = "fcfs"
    placement: str = "prefix"
    headroom_tokens: int = 64
    preempt: bool = True  # directed preemption for higher priorities
    engine_args: dict = field(default_factory=lambda: dict(max_num_seqs=256, max_num_batched_tokens=2048))
    num_blocks: int | None = None  # per worker; None: the profile's
    report_interval_s: float = 0.1
    hop_s: float = 0.001  # one gRPC or Redis hop
    tick_s: float = 0.05
    ideal: bool = False


class FleetSim:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.outcomes: dict[str, Outcome] = {}
        self.ledger = Ledger(LedgerConfig(policy=cfg.policy, headroom_tokens=cfg.headroom_tokens, preempt=cfg.preempt,
                                          placement=PlacementConfig(cfg.placement)),
                             clock=self._clock, wall_clock=self._clock)
        n = 1 if cfg.ideal else cfg.num_workers
        self.workers = [self._make_worker(i) for i in range(n)]
        self._by_id = {w.entry.worker_id: w for w in self.workers}
        self._left = 0  # requests not over yet

    def _make_worker(self, i: int) -> _Worker:
        cfg, prof = self.cfg, self.cfg.profile
        args = dict(cfg.engine_args)
        blocks = cfg.num_blocks or prof.num_blocks(BLOCK_SIZE)
        if cfg.ideal:  # the whole fleet as one engine: its memory and batch, its GPUs' share of the work
            k = cfg.num_workers
            prof = dataclasses.replace(prof, kv_cache_bytes=prof.kv_cache_bytes * k,
                                       step=StepTimeModel(prof.step.a, prof.step.b / k, prof.step.c / k))
            blocks *= k
            args = {key: v * k for key, v in args.items()}
        engine = SimEngine(prof, time_scale=math.inf, block_size=BLOCK_SIZE, num_blocks=blocks,
                           num_swap_blocks=0, preemption="recompute", **args)
        log = KVEventLog(engine.kv)
        w = _Worker(engine, WorkerEntry(f"w{i:03d}", "sim"), log.subscribe(), log)
        if not cfg.ideal:
            self.ledger.add_worker(w.entry)
            self.ledger.on_report(w.entry, self._report(w))
        return w

    # -- the clock -----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, trace: list[TraceRequest], until_s: float) -> dict[str, Outcome]:
        for r in trace:
            self.outcomes[r.request_id] = Outcome(r.arrival_s, r.priority)
            self._at(r.arrival_s, self._arrive, r)
        if not self.cfg.ideal:
            for i, w in enumerate(self.workers):  # staggered, as real workers' timers are
                self._at(self.cfg.report_interval_s * (i + 1) / len(self.workers), self._report_tick, w)
            self._at(self.cfg.tick_s, self._tick)
        self._left = len(trace)
        while self._events and self._left:
            t, _, fn, args = heapq.heappop(self._events)
            if t > until_s:
                self.now = until_s
                break
            self.now = t
            fn(*args)
        return self.outcomes

    # -- arrivals and the scheduler ------------------------------------------------------------
    def _arrive(self, r: TraceRequest) -> None:
        sampling = generation_pb2.SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        msg = cluster_pb2.AssignRequest(
            request_id=r.request_id, prompt_token_ids=r.prompt_ids, sampling=sampling, priority=r.priority,
            deadline_unix_ms=int(r.deadline_s * 1000) if r.deadline_s is not None else 0,
            block_hashes=block_hashes(r.prompt_ids, BLOCK_SIZE), hash_block_size=BLOCK_SIZE,
        )
        if self.cfg.ideal:  # no scheduler: straight into the one engine
            self._at(self.now, self._assign, self.workers[0], msg)
            return
        self.ledger.take(r.request_id, "", msg)
        self._dispatch()

    def _dispatch(self) -> None:
        """The ledger's rounds, as the live scheduler runs them: each claim's Assign lands a
        hop later; a round that preempts marks its victims at once (the live scheduler decides
        no further round before its Preempt calls are answered) and they are preempted a hop later."""
        while True:
            d = self.ledger.decide_round()
            if not d.claims:
                return  # empty, or head of line: it waits for room
            for p, placement in d.claims:
                self._at(self.now + self.cfg.hop_s, self._assign, self._by_id[placement.worker.worker_id], p)
            for pl in d.victims:
                self.ledger.preempted(pl)
                w = self._by_id[d.claims[0][1].worker.worker_id]
                self._at(self.now + self.cfg.hop_s, self._preempt, w, pl.pending.request_id)

    def _tick(self) -> None:
        waited, running = self.ledger.expired()
        for p in waited:
            self.ledger.forget(p.request_id)
            self._end(p.request_id, "deadline")
        for rid in running:
            w = self.ledger.placed_on(rid)
            if w is not None:  # still running: cut off
                self._at(self.now + self.cfg.hop_s, self._abort, self._by_id[w.worker_id], rid)
                self.ledger.forget(rid)
                self._end(rid, "deadline")
        self._dispatch()
        self._at(self.now + self.cfg.tick_s, self._tick)

    def _end(self, rid: str, reason: str, at: float | None = None) -> None:
        """``rid`` is over for its client (the run stops when every request is)."""
        o = self.outcomes[rid]
        if not o.finish_reason:
            o.finish_reason, o.finish_s = reason, self.now if at is None else at
            self._left -= 1

    # -- the workers ---------------------------------------------------------------------------
    def _assign(self, w: _Worker, msg) -> None:
        if not self.cfg.ideal:  # msg is the ledger's claim: the worker accepts it
            p, msg = msg, msg.assign
            self.ledger.settled(p, w.entry, True)
        rid = msg.request_id
        if self.outcomes[rid].finish_reason:  # cut off (deadline) before it got here
            return
        params = SamplingParams(max_tokens=msg.sampling.max_tokens, ignore_eos=True)
        w.engine.add_request(list(msg.prompt_token_ids), params, request_id=rid, priority=msg.priority)
        self._kick(w)

    def _preempt(self, w: _Worker, rid: str) -> None:
        w.engine.preempt_request(rid)

    def _abort(self, w: _Worker, rid: str) -> None:
        w.engine.abort_request(rid)

    def _kick(self, w: _Worker) -> None:
        if not w.busy and w.engine.has_unfinished_requests():
            w.busy = True
            self._at(self.now, self._step, w)

    def _step(self, w: _Worker) -> None:
        e = w.engine
        if not e.has_unfinished_requests():
            w.busy = False
            return
        deltas = e.step()
        done_at = self.now + max(e.executor.last_step_s, 1e-4)  # nothing ran: look again soon
        for d in deltas:
            o = self.outcomes[d.request_id]
            if d.token_ids:
                if o.first_token_s is None:
                    o.first_token_s = done_at
                o.num_tokens += len(d.token_ids)
            if d.finish_reason and not o.finish_reason:
                self._end(d.request_id, d.finish_reason, done_at)
                if not self.cfg.ideal:
                    self._at(done_at + self.cfg.hop_s, self._forget_and_dispatch, d.request_id)
        if not self.cfg.ideal:
            ids = frozenset(e.requests)
            if ids != w.last_ids:  # the worker's "large change" notice: a report now
                w.last_ids = ids
                self._at(done_at + self.cfg.hop_s, self._deliver, w, self._report(w))
        self._at(done_at, self._step, w)

    def _forget_and_dispatch(self, rid: str) -> None:
        self.ledger.forget(rid)
        self._dispatch()

    def _report(self, w: _Worker) -> cluster_pb2.OccupancyReport:
        e = w.engine
        w.log.publish(e.kv)
        stored, evicted, reset = w.events.take()
        w.seq += 1
        return occupancy_report(e.stats(), worker_id=w.entry.worker_id, seq=w.seq, finished_request_ids=[],
                                max_num_seqs=e.scheduler.max_num_seqs, max_model_len=e.max_model_len, draining=False,
                                stored_block_hashes=stored, evicted_block_hashes=evicted, block_hashes_reset=reset)

    def _report_tick(self, w: _Worker) -> None:
        self._at(self.now + self.cfg.hop_s, self._deliver, w, self._report(w))
        self._at(self.now + self.cfg.report_interval_s, self._report_tick, w)

    def _deliver(self, w: _Worker, r: cluster_pb2.OccupancyReport) -> None:
        out = self.ledger.on_report(w.entry, r)
        # Gone from the worker before its done notice came (it finished, or was cut off): the live
        # scheduler would resume it, find its final write and forget it; here it is let go at once.
        for p in out.resume:
            self.ledger.forget(p.request_id)
        if out.room:
            self._dispatch()
