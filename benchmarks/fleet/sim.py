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
``hop_s`` here; ``pagefleet bench scheduler`` measures the real ones. Reports go out as a
worker sends them (``worker/service.py``): every ``report_interval_s`` while the worker stepped
since its last report (a busy worker's), every ``heartbeat_s`` while it did not (an idle one's:
the scheduler's ``report_interval`` of its ``--dead-after``, 0.25 s at the default 2 s), and at
once after a step that changed which requests it holds (the worker's "large change" notice) or
ended a prompt on a prefill worker.

``ideal=True`` is the bound a fleet cannot beat: one engine with the whole fleet's pool,
batch and token budget, each step costing ``a`` and the fleet's share of ``b`` and ``c``
(one queue, perfect balance, no fragmentation), fed directly.

KV that moves (``FleetConfig.num_prefill_workers``, ``FleetConfig.moves``): the ledger decides
(``scheduler/moves.py``), the simulator carries it out. A request placed on a worker of role
``prefill`` runs there for its first token only; its KV then waits on that worker for a
decoding worker. A transfer takes the profile's ``kv_transfer_seconds`` of its tokens,
one at a time on each worker's link (a worker sending or receiving one transfer waits for
it to end before the next starts), and holds blocks on both sides until the handover: the
receiver allocates the request's blocks when the copy starts, the sender frees its own only
once the target has taken the request over. A running request (a load-balance or preemption
move) goes on decoding on its source during the copy, as in Llumnix's multi-stage copy; then
it stops there for a final stage that copies the tokens it made meanwhile (its downtime) and
resumes on the target. At the handover the received blocks enter the target's prefix cache
under the request's keys, so the target computes only the last, partial block again.
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
from pagefleet.scheduler.moves import MoveConfig, Transfer
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
    steps_at_report: int = -1  # the engine's steps when its last timed report went (-1: none yet)
    last_ids: frozenset = field(default_factory=frozenset)
    prefill_only: set[str] = field(default_factory=set)  # run here for their first token, then moved
    sending: dict[str, int] = field(default_factory=dict)  # stopped here, blocks held for a transfer out
    receiving: dict[str, Transfer] = field(default_factory=dict)  # blocks allocated for a transfer in
    link_free_at: float = 0.0  # when its current transfer (in or out) ends


@dataclass(slots=True)
class MoveStats:
    """What the moves cost: counts by reason, bytes, and the downtime of running requests moved."""

    started: dict[str, int] = field(default_factory=dict)
    num_done: int = 0
    num_expired: int = 0
    num_refused: int = 0  # the target's pool had not the room the ledger believed
    bytes_moved: int = 0
    transfer_s: list[float] = field(default_factory=list)  # start of the copy to the handover
    downtime_s: list[float] = field(default_factory=list)  # a running request's final stage


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
    report_interval_s: float = 0.1  # a busy worker's reports (it stepped since the last one)
    heartbeat_s: float = 0.25  # an idle worker's (``scheduler.core.report_interval`` of --dead-after 2)
    hop_s: float = 0.001  # one gRPC or Redis hop
    tick_s: float = 0.05
    ideal: bool = False
    num_prefill_workers: int = 0  # > 0: that many workers of role prefill, the others decode
    moves: MoveConfig = MoveConfig()


class FleetSim:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.outcomes: dict[str, Outcome] = {}
        if not (cfg.report_interval_s > 0 and cfg.heartbeat_s > 0):
            raise ValueError(f"report_interval_s and heartbeat_s must be above 0, got {cfg.report_interval_s} "
                             f"and {cfg.heartbeat_s}")
        if not 0 <= cfg.num_prefill_workers < max(1, cfg.num_workers):
            raise ValueError(f"num_prefill_workers must leave at least one decoding worker, got {cfg.num_prefill_workers}")
        self.ledger = Ledger(LedgerConfig(policy=cfg.policy, headroom_tokens=cfg.headroom_tokens, preempt=cfg.preempt,
                                          placement=PlacementConfig(cfg.placement), moves=cfg.moves),
                             clock=self._clock, wall_clock=self._clock)
        self.moves = MoveStats()
        self._trace: dict[str, TraceRequest] = {}
        self._moved: dict[str, list[int]] = {}  # request -> its output when its move began (resumed from it)
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
        role = "both" if cfg.ideal or not cfg.num_prefill_workers else ("prefill" if i < cfg.num_prefill_workers
                                                                         else "decode")
        w = _Worker(engine, WorkerEntry(f"w{i:03d}", "sim", role=role), log.subscribe(), log)
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
            self._trace[r.request_id] = r
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
            for p, _ in d.refused:  # no worker could ever take it: ended, as the scheduler ends it
                self.ledger.forget(p.request_id)
                self._end(p.request_id, "error")
            if not d.claims:
                if d.refused:
                    continue
                return  # empty, or head of line: it waits for room
            for p, placement in d.claims:
                self._at(self.now + self.cfg.hop_s, self._assign, self._by_id[placement.worker.worker_id], p)
            for pl in d.victims:
                self.ledger.preempted(pl)
                w = self._by_id[d.claims[0][1].worker.worker_id]
                self._at(self.now + self.cfg.hop_s, self._preempt, w, pl.pending.request_id)
            for t in d.moves:
                self._start_move(t)

    def _tick(self) -> None:
        self._moves_tick()
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
        out = list(msg.output_token_ids)  # resumed (a transfer expired): it goes on after these
        max_tokens = msg.sampling.max_tokens
        if w.entry.role == "prefill":  # its first token here, the rest where its KV goes
            max_tokens = len(out) + 1
            w.prefill_only.add(rid)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        w.engine.add_request(list(msg.prompt_token_ids), params, request_id=rid, priority=msg.priority,
                             output_token_ids=out)
        self._kick(w)

    def _preempt(self, w: _Worker, rid: str) -> None:
        w.engine.preempt_request(rid)

    def _abort(self, w: _Worker, rid: str) -> None:
        w.engine.abort_request(rid)
        if rid in w.sending:  # cut off while its KV waited to move
            self._release(w, rid, True)
            self._moved.pop(rid, None)

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
        prefilled = False
        for d in deltas:
            o = self.outcomes[d.request_id]
            if d.token_ids:
                if o.first_token_s is None:
                    o.first_token_s = done_at
                o.num_tokens += len(d.token_ids)
            if d.finish_reason and d.request_id in w.prefill_only:
                w.prefill_only.discard(d.request_id)
                known = self.ledger.known.get(d.request_id)
                if known is None:  # handed back meanwhile and finished elsewhere: nothing waits for it
                    continue
                if o.num_tokens < self._trace[d.request_id].max_tokens:  # prefilled: its KV waits here
                    prefilled = True
                    before = known.assign.output_token_ids  # resumed after these
                    self._hold_for_transfer(w, d.request_id, [*before, *d.token_ids])
                    self._at(done_at + self.cfg.hop_s, self._prefilled, d.request_id)
                    continue
            if d.finish_reason and not o.finish_reason:
                self._end(d.request_id, d.finish_reason, done_at)
                if not self.cfg.ideal:
                    self._at(done_at + self.cfg.hop_s, self._forget_and_dispatch, d.request_id)
        if not self.cfg.ideal:
            ids = self._held_ids(w)
            # The worker's "large change" notice, or a prompt ended on a prefill worker: a report now.
            if ids != w.last_ids or prefilled:
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
        stats = e.stats()
        for rid in (*w.sending, *w.receiving):  # a worker holds what it sends and what it receives
            stats.request_ids.append(rid)
            stats.blocks_per_request[rid] = len(e.kv.block_tables.get(_buffer(rid, rid in w.sending), ()))
        return occupancy_report(stats, worker_id=w.entry.worker_id, seq=w.seq, finished_request_ids=[],
                                max_num_seqs=e.scheduler.max_num_seqs, max_model_len=e.max_model_len, draining=False,
                                stored_block_hashes=stored, evicted_block_hashes=evicted, block_hashes_reset=reset)

    def _report_tick(self, w: _Worker) -> None:
        """A timed report; the next one sooner if the worker stepped since the last (busy)."""
        steps = w.engine.scheduler.num_steps_total
        busy, w.steps_at_report = steps != w.steps_at_report, steps
        self._at(self.now + self.cfg.hop_s, self._deliver, w, self._report(w))
        self._at(self.now + (self.cfg.report_interval_s if busy else self.cfg.heartbeat_s), self._report_tick, w)

    def _deliver(self, w: _Worker, r: cluster_pb2.OccupancyReport) -> None:
        out = self.ledger.on_report(w.entry, r)
        # Gone from the worker before its done notice came (it finished, or was cut off): the live
        # scheduler would resume it, find its final write and forget it; here it is let go at once.
        for p in out.resume:
            self.ledger.forget(p.request_id)
        if out.room:
            self._dispatch()

    # -- moving KV -----------------------------------------------------------------------------
    def _held_ids(self, w: _Worker) -> frozenset:
        return frozenset(w.engine.requests).union(w.sending, w.receiving)

    def _hold_for_transfer(self, w: _Worker, rid: str, out: list[int]) -> None:
        """``rid`` stopped on ``w`` with output ``out``: its blocks stay held for its transfer
        out (the engine let it go; an allocation of as many stands for its KV)."""
        self._moved[rid] = out
        w.engine.kv.allocate_slots(_buffer(rid, True), len(self._trace[rid].prompt_ids) + len(out))
        w.sending[rid] = len(w.engine.kv.block_tables.get(_buffer(rid, True), ()))

    def _prefilled(self, rid: str) -> None:
        if rid not in self.ledger.where:  # cut off meanwhile (_abort let its blocks go)
            return
        for t in self.ledger.prefilled(rid):
            self._start_move(t)

    def _moves_tick(self) -> None:
        for t in self.ledger.expired_transfers():  # both sides drop it; it resumes from its tokens
            self.moves.num_expired += 1
            src, dst = self._by_id[t.source.worker_id], self._by_id[t.target.worker_id]
            out = self._stop(src, t.request_id)
            self._release(src, t.request_id, True)
            self._moved.pop(t.request_id, None)
            self._drop_received(dst, t)
            if not self.ledger.resume(t.pending, out):
                self.ledger.forget(t.request_id)
        for t in self.ledger.called_off():
            self._drop_received(self._by_id[t.target.worker_id], t)
        for t in self.ledger.decide_moves():
            self._start_move(t)

    def _start_move(self, t: Transfer) -> None:
        """The copy of ``t`` starts once both links are free; the target's blocks are taken now."""
        rid = t.request_id
        src, dst = self._by_id[t.source.worker_id], self._by_id[t.target.worker_id]
        self.moves.started[t.reason] = self.moves.started.get(t.reason, 0) + 1
        num_tokens = self._num_tokens(src, rid)
        if num_tokens is None or not self._receive(dst, t, num_tokens):
            return
        start = max(self.now + self.cfg.hop_s, src.link_free_at, dst.link_free_at)
        end = start + self.cfg.profile.kv_transfer_seconds(num_tokens)
        src.link_free_at = dst.link_free_at = end
        self.moves.bytes_moved += num_tokens * self.cfg.profile.kv_bytes_per_token
        self._at(end, self._copied, t, num_tokens, self.now)

    def _num_tokens(self, w: _Worker, rid: str) -> int | None:
        """``rid``'s tokens on ``w`` now (None if it is no longer there: it finished)."""
        req = w.engine.requests.get(rid)
        if req is not None:
            return req.num_tokens
        if rid in w.sending:
            return len(self._trace[rid].prompt_ids) + len(self._moved[rid])
        return None

    def _receive(self, dst: _Worker, t: Transfer, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` of ``t``'s request on ``dst``; False (the move refused) if
        its pool has not the room."""
        if dst.engine.kv.allocate_slots(_buffer(t.request_id, False), num_tokens) is None:
            self._drop_received(dst, t)
            self.ledger.transfer_refused(t.request_id)
            self.moves.num_refused += 1
            return False
        dst.receiving[t.request_id] = t
        return True

    def _copied(self, t: Transfer, num_copied: int, began: float) -> None:
        """The first stage is done: a request still running stops for the final stage."""
        rid = t.request_id
        src, dst = self._by_id[t.source.worker_id], self._by_id[t.target.worker_id]
        if self.ledger.transfers.get(rid) is not t or dst.receiving.get(rid) is not t:
            self._drop_received(dst, t)
            return
        if rid not in src.sending:
            if rid not in src.engine.requests:  # it finished meanwhile: the move is called off soon
                return
            self._hold_for_transfer(src, rid, self._stop(src, rid))
            num_tokens = len(self._trace[rid].prompt_ids) + len(self._moved[rid])
            if not self._receive(dst, t, num_tokens):
                return
            final = self.cfg.profile.kv_transfer_seconds(num_tokens - num_copied) + self.cfg.hop_s
            self.moves.downtime_s.append(final)
            self.moves.bytes_moved += (num_tokens - num_copied) * self.cfg.profile.kv_bytes_per_token
            self._at(self.now + final, self._handover, t, began)
            return
        self._handover(t, began)

    def _stop(self, w: _Worker, rid: str) -> list[int]:
        """``rid`` stops running on ``w`` (if it runs there); its output so far."""
        req = w.engine.requests.get(rid)
        if req is None:
            return list(self._moved.get(rid, ()))
        out = list(req.output_token_ids)
        w.engine.abort_request(rid)
        return out

    def _handover(self, t: Transfer, began: float) -> None:
        rid = t.request_id
        src, dst = self._by_id[t.source.worker_id], self._by_id[t.target.worker_id]
        if dst.receiving.get(rid) is not t or not self.ledger.transfer_done(rid):
            self._drop_received(dst, t)
            return
        self._release(src, rid, True)
        out = self._moved.pop(rid)
        r = self._trace[rid]
        e = dst.engine
        e.add_request(list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), request_id=rid,
                      priority=r.priority, output_token_ids=out)
        # The blocks received enter the prefix cache under the request's keys; its admission finds them.
        buffer = _buffer(rid, False)
        table = e.kv.block_tables.get(buffer, [])
        req = e.requests[rid]
        num_full = min(len(table), req.num_tokens // BLOCK_SIZE)
        for block, key in zip(table[:num_full], e.kv._keys(req, num_full), strict=False):
            e.kv.pool.cache(block, key)
        e.kv.free(buffer)
        del dst.receiving[rid]
        self.moves.num_done += 1
        self.moves.transfer_s.append(self.now - began)
        self._kick(dst)

    def _release(self, w: _Worker, rid: str, sending: bool) -> None:
        w.engine.kv.free(_buffer(rid, sending))
        (w.sending if sending else w.receiving).pop(rid, None)

    def _drop_received(self, dst: _Worker, t: Transfer) -> None:
        """What ``dst`` received of ``t`` goes (only ``t``'s: a later move of the request may be under way)."""
        if dst.receiving.get(t.request_id) is t:
            self._release(dst, t.request_id, False)


def _buffer(rid: str, sending: bool) -> str:
    """The block table that stands for ``rid``'s KV while it moves (on its source or its target)."""
    return f"kv-{'out' if sending else 'in'}:{rid}"
