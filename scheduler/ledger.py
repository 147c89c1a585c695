"""The scheduler's decisions without I/O: one owner for every structure placement reads.

The ledger owns the global queue (``queue.GlobalQueue``), the worker table
(``workers.WorkerEntry`` by worker id, each with its placed requests), where each placed
request is (``where``), the prefix index's holds (``prefix_index.PrefixIndex``), the
deadlines of the running requests and the requests finished recently. Its operations are
synchronous and touch nothing outside it; each returns what the caller must do about the
world (fence and send claims, resume requests from their output, withdraw orphans, finish
requests past their deadline). The live scheduler (``core.ClusterScheduler``: Redis, fencing,
gRPC, timers, the lease), the fleet simulator and the tests all drive this one ledger.

Every request the ledger knows is in exactly one of three places:

* **queued**: waiting in ``queue``;
* **placed**: on one live worker's ``placed``, and ``where`` names that worker;
* **in hand**: neither, while the caller does I/O for it: resuming it (its worker died or
  dropped it, or a takeover found no worker holding it; ``resume`` queues it again) or
  finishing it (its deadline passed while it waited; ``forget`` ends it).

A request leaves the ledger only through ``forget`` (its final write is durable), which
remembers it among the recently finished (a report can list a request after its finish is
seen, and listing it is no orphan). ``check_integrity`` asserts all of this.

Clocks are passed in: ``clock`` (seconds, monotonic: report times, placement times,
preemption cooldowns, queue aging) and ``wall_clock`` (seconds since the epoch: the
requests' deadlines are absolute). The simulator passes its virtual clock for both.

Rounds: ``decide_round`` claims placements for the queue's heads while they fit, up to a
round (at least ``ROUND``, ``ROUND_PER_WORKER`` a worker in a larger fleet), each recorded on
its worker at once so the next decision sees it. A head that fits nowhere ends the round; if
nothing was claimed before it, the round places it by preempting lower-priority sequences
(``workers.pick_victims``) when preemption is on. Head of line: no request is overtaken.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagefleet.common.blocks import num_blocks_for
from pagefleet.protos import cluster_pb2

from .placement import Placement, PlacementConfig, Placer
from .prefix_index import DEFAULT_MAX_KEYS, PrefixIndex
from .queue import GlobalQueue, Pending
from .workers import Placed, WorkerEntry, pick_victims

# A round decides at least ROUND placements, and ROUND_PER_WORKER a worker in a larger fleet,
# so that a deep queue's round sends each worker a batch rather than one request (an
# AssignBatch costs the scheduler ~0.1 ms of gRPC whatever it carries). A round only grows
# when that many requests wait.
ROUND = 256
ROUND_PER_WORKER = 4
# Requests whose final write was seen, remembered this long (at most this many): a worker's
# report can reach the scheduler after the finish it predates (a gRPC stream and a Redis
# stream do not keep one order), and listing such a request is no orphan.
DONE_MEMORY = 65536


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    policy: str = "fcfs"  # the queue's: fcfs | priority | deadline
    aging_s: float = 10.0
    headroom_tokens: int = 64
    preempt: bool = True  # place a blocked head by preempting lower-priority sequences
    placement: PlacementConfig = PlacementConfig()
    prefix_index_size: int = DEFAULT_MAX_KEYS  # most cached block keys the index keeps
    done_memory: int = DONE_MEMORY


@dataclass(frozen=True, slots=True)
class Decision:
    """One round. ``claims``: requests claimed on their workers (already placed in the
    ledger): fence and send them, then report each answer with ``settled``. ``victims``
    (non-empty only when the round preempts): ``claims`` is then the one request placed by
    preempting these on its worker; send it first, then preempt them (``preempted``)."""

    claims: list[tuple[Pending, Placement]] = field(default_factory=list)
    victims: list[Placed] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Migration:
    """Move ``request_id``'s KV (``num_blocks`` device blocks) from ``source`` to ``target``,
    live (``worker/migration.py``); report the end with ``Ledger.migrated``. ``reason``:
    ``load`` (balance) or ``preempt`` (instead of a swap-out)."""

    request_id: str
    source: str
    target: str
    num_blocks: int
    reason: str = "load"


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What one report asks of the caller. ``resume``: placed requests the worker dropped
    without a finish (in hand now: resume them from their output). ``withdraw``: requests the
    worker runs that were never placed there (tell it to drop them). ``room``: placement may
    gain (a first report, a dropped request, or more blocks available than before)."""

    resume: list[Pending] = field(default_factory=list)
    withdraw: list[str] = field(default_factory=list)
    room: bool = False


class Ledger:
    """Read freely: ``queue``, ``workers``, ``where``, ``known``, ``index``, ``num_*``;
    change only through the methods (they keep the structures consistent together)."""

    def __init__(self, config: LedgerConfig = LedgerConfig(), *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, adopting: bool = False,
                 on_decision: Callable[[float], None] | None = None) -> None:
        self.cfg = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.adopting = adopting  # a takeover is reading the pending entries: orphans wait for it
        self._on_decision = on_decision  # seconds one placement decision took (a histogram)
        self.queue = GlobalQueue(config.policy, config.aging_s)
        self.workers: dict[str, WorkerEntry] = {}
        self.index = PrefixIndex(config.prefix_index_size)
        self.placer = Placer(config.placement, self.index)
        self.known: dict[str, Pending] = {}  # every unfinished request: queued, placed or in hand
        self.where: dict[str, str] = {}  # request id -> the worker it is placed on
        self._in_hand: set[str] = set()
        self._deadlines: list[tuple[int, str]] = []  # (deadline_unix_ms, request id) of placed requests
        self._done_recently: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_reassigned = 0

    # -- the public state ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    @property
    def num_known(self) -> int:
        """Requests taken in and not finished (each one's stream entry is still pending)."""
        return len(self.known)

    @property
    def num_placed(self) -> int:
        return len(self.where)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_prefix_index_keys(self) -> int:
        return self.index.num_keys

    def finished_recently(self, request_id: str) -> bool:
        return request_id in self._done_recently

    def is_placed(self, request_id: str, worker_id: str) -> bool:
        """Whether ``request_id`` is still placed on ``worker_id`` (not moved, finished or dead)."""
        return self.where.get(request_id) == worker_id

    # -- requests in ---------------------------------------------------------------------------
    def _new(self, request_id: str, entry_id: str, assign: cluster_pb2.AssignRequest) -> Pending:
        assert request_id not in self.known, request_id
        p = Pending(request_id, entry_id, assign, next(self._seq), enqueued_at=self.clock())
        self.known[request_id] = p
        return p

    def take(self, request_id: str, entry_id: str, assign: cluster_pb2.AssignRequest) -> Pending | None:
        """A new request: queued. None (nothing changes) if it is known already."""
        if request_id in self.known:
            return None
        p = self._new(request_id, entry_id, assign)
        self.queue.push(p)
        return p

    def take_over(self, request_id: str, entry_id: str, assign: cluster_pb2.AssignRequest,
                  holder: WorkerEntry | None) -> Pending | None:
        """A pending request re-read at takeover: placed on ``holder`` (the worker whose report
        lists it; None returned), or, with no holder, in hand and returned: it may have run
        somewhere, so the caller resumes it from its output. Must not be known already."""
        p = self._new(request_id, entry_id, assign)
        if holder is None:
            self._in_hand.add(request_id)
            return p
        holder.place(p, self.cfg.headroom_tokens, reflected=True, now=self.clock())
        self._hold(holder, p)
        self.where[request_id] = holder.worker_id
        return None

    def holders(self) -> dict[str, WorkerEntry]:
        """Request id -> the worker whose latest report lists it (for a takeover)."""
        return {rid: w for w in self.workers.values() for rid in w.held}

    def adopted(self) -> list[tuple[WorkerEntry, list[str]]]:
        """The takeover has read every pending entry: each worker with the orphans its reports
        named meanwhile (a delta names each once), to withdraw now."""
        self.adopting = False
        found = [(w, self._orphans(w.orphans())) for w in self.workers.values()]
        return [(w, rids) for w, rids in found if rids]

    def resume(self, p: Pending, emitted: list[int]) -> bool:
        """``p`` (in hand) goes back to the queue to go on after the tokens it emitted. False
        if it has nothing left to generate (it stays in hand: the caller finishes it). A
        request forgotten meanwhile is not queued again (True: nothing to do)."""
        if p.request_id not in self._in_hand:
            return True
        del p.assign.output_token_ids[:]
        p.assign.output_token_ids.extend(emitted)
        if p.num_remaining_tokens == 0:
            return False
        self._in_hand.discard(p.request_id)
        self.queue.push(p)
        return True

    def forget(self, request_id: str) -> None:
        """``request_id`` is finished (its final write is durable): drop every trace of it."""
        self._done_recently[request_id] = None
        if len(self._done_recently) > self.cfg.done_memory:
            del self._done_recently[next(iter(self._done_recently))]
        self.known.pop(request_id, None)
        self._in_hand.discard(request_id)
        self.queue.remove(request_id)
        self.index.release(request_id)
        wid = self.where.pop(request_id, None)
        w = self.workers.get(wid) if wid else None
        if w is not None:
            w.unplace(request_id)

    # -- placing ---------------------------------------------------------------------------------
    def decide_round(self) -> Decision:
        """Claim placements for the queue's heads while they fit, a round at most; a head
        that fits nowhere ends the round, and is placed by preemption if nothing was claimed
        before it (see the module docstring). An empty decision: the queue is empty, or its
        head waits until a report shows room."""
        live = list(self.workers.values())
        rnd = self.placer.round(live)  # valid while only this round's claims change the workers
        claims: list[tuple[Pending, Placement]] = []
        headroom = self.cfg.headroom_tokens
        size = max(ROUND, ROUND_PER_WORKER * len(self.workers))
        t0 = time.perf_counter()
        while len(claims) < size and (p := self.queue.peek()) is not None:
            placement = rnd.choose(p, headroom)
            t0 = self._timed(t0)
            if placement is None:
                if claims or not self.cfg.preempt:
                    break
                found = pick_victims(live, p, headroom, now=self.clock())
                if found is None:
                    break
                w, victims = found
                placement = Placement(w, "preempt")
                self._claim(p, placement)
                return Decision([(p, placement)], victims)
            self._claim(p, placement)
            claims.append((p, placement))
        return Decision(claims)

    def _timed(self, t0: float) -> float:
        t1 = time.perf_counter()
        if self._on_decision is not None:
            self._on_decision(t1 - t0)
        return t1

    def _claim(self, p: Pending, placement: Placement) -> None:
        """Take ``p`` off the queue onto the placement's worker (reports and fencing confirm it)."""
        w = placement.worker
        self.queue.remove(p.request_id)
        w.place(p, self.cfg.headroom_tokens, placement.num_shared_blocks, now=self.clock())
        self._hold(w, p)
        self.where[p.request_id] = w.worker_id

    def _hold(self, w: WorkerEntry, p: Pending) -> None:
        """Record optimistically that ``w`` will hold ``p``'s prompt blocks (reports correct it)."""
        if p.assign.block_hashes and p.assign.hash_block_size == w.block_size:
            self.index.hold(w.worker_id, p.request_id, p.assign.block_hashes)

    def settled(self, p: Pending, w: WorkerEntry, accepted: bool) -> None:
        """``w`` answered ``p``'s Assign. Accepted: ``p`` runs there (its deadline is watched).
        Refused (draining): ``w`` takes no more before its report says so, and ``p`` goes back
        to the queue, for another worker. No-op if ``p`` is no longer placed on ``w``."""
        rid = p.request_id
        if not self.is_placed(rid, w.worker_id):
            return
        if accepted:
            if p.assign.deadline_unix_ms:
                heapq.heappush(self._deadlines, (p.assign.deadline_unix_ms, rid))
            return
        w.accepting = False
        w.unplace(rid)
        self.index.release(rid)
        del self.where[rid]
        self.queue.push(p)

    def preempted(self, victim: Placed) -> None:
        """Its worker swapped (or will recompute) ``victim`` for a higher priority: it stays
        placed there, and is not chosen again before the cooldown."""
        victim.preempted_at = self.clock()
        self.num_preemptions += 1

    # -- migration (KV moved between workers; the caller runs it) ----------------------------------
    def plan_migrations(self, *, high: float = 0.9, low: float = 0.5, max_moves: int = 1) -> list[Migration]:
        """Load balance: for each ready worker whose pool is more than ``high`` used while
        another is less than ``low`` used, move the request there that holds the fewest device
        blocks (the cheapest to copy) and frees enough to matter; at most ``max_moves``.
        Changes nothing: the caller runs each and reports it with ``migrated``."""
        if not 0 <= low < high <= 1 or max_moves < 1:
            raise ValueError(f"need 0 <= low < high <= 1 and max_moves >= 1, got {low}, {high}, {max_moves}")
        ready = [w for w in self.workers.values() if w.ready]
        used = {w.worker_id: 1 - w.num_available_blocks / w.pool_size for w in ready}
        plans: list[Migration] = []
        for src in sorted(ready, key=lambda w: -used[w.worker_id]):
            if used[src.worker_id] <= high or len(plans) == max_moves:
                break
            movable = sorted((n, rid) for rid, n in src.held.items()
                             if n and rid in src.placed and not src.placed[rid].finished)
            for n, rid in movable:
                target = self.migration_target(rid, n, exclude=src.worker_id, below=low, used=used)
                if target is not None:
                    plans.append(Migration(rid, src.worker_id, target.worker_id, n))
                    break
        return plans

    def migration_target(self, rid: str, num_blocks: int, *, exclude: str, below: float = 1.0,
                         used: dict[str, float] | None = None) -> WorkerEntry | None:
        """The ready worker other than ``exclude`` with the most room that can hold ``rid``'s
        ``num_blocks`` blocks plus its headroom and is less than ``below`` used; None if none.
        Preemption asks it first (``reason="preempt"``): a victim another worker can hold
        moves there with its KV instead of being swapped out or recomputed."""
        p = self.known.get(rid)
        if p is None:
            return None
        headroom = min(p.num_remaining_tokens, self.cfg.headroom_tokens)
        best = None
        for w in self.workers.values():
            if w.worker_id == exclude or not w.ready:
                continue
            u = used[w.worker_id] if used is not None else 1 - w.num_available_blocks / w.pool_size
            need = num_blocks + num_blocks_for(headroom, w.block_size)
            if u < below and w.has_room(p.num_tokens + p.num_remaining_tokens, need) and (
                    best is None or w.spare > best.spare):
                best = w
        return best

    def migrated(self, m: Migration, ok: bool) -> None:
        """``m`` ended: moved (``ok``: the request is placed on the target now), or not (it
        stays on the source, untouched). No-op if the request is no longer on the source."""
        if not ok or self.where.get(m.request_id) != m.source or m.target not in self.workers:
            return
        src, dst = self.workers[m.source], self.workers[m.target]
        pl = src.unplace(m.request_id)
        self.index.release(m.request_id)
        dst.place(pl.pending, self.cfg.headroom_tokens, now=self.clock())
        self._hold(dst, pl.pending)
        self.where[m.request_id] = m.target

    # -- workers ---------------------------------------------------------------------------------
    def add_worker(self, w: WorkerEntry) -> None:
        """A worker discovered (one with its id must have been declared dead first)."""
        assert w.worker_id not in self.workers, w.worker_id
        self.workers[w.worker_id] = w

    def on_report(self, w: WorkerEntry, report: cluster_pb2.OccupancyReport) -> ReportOutcome:
        """Take one of ``w``'s reports in (see ``ReportOutcome``)."""
        if not w.alive:
            return ReportOutcome()
        room = w.num_available_blocks if w.report is not None else None
        vanished, orphans = w.apply_report(report, now=self.clock())
        self.index.apply_events(w.worker_id, report.stored_block_hashes, report.evicted_block_hashes,
                                report.block_hashes_reset)
        resume = []
        for rid in vanished:  # dropped without a finish reported: resume (or forget) it
            pl = w.unplace(rid)
            self.index.release(rid)
            if self.where.get(rid) == w.worker_id:
                del self.where[rid]
                self._in_hand.add(rid)
                resume.append(pl.pending)
        withdraw = [] if self.adopting else self._orphans(orphans)
        return ReportOutcome(resume, withdraw, room is None or bool(vanished) or w.num_available_blocks > room)

    def _orphans(self, rids: list[str]) -> list[str]:
        """A finished request a stale report still lists is no orphan."""
        return [rid for rid in rids if rid not in self._done_recently]

    def worker_dead(self, w: WorkerEntry) -> list[Pending] | None:
        """``w`` is dead: it leaves the table, and its requests are in hand, returned for the
        caller to resume elsewhere. None if it was declared dead already."""
        if not w.alive:
            return None
        w.alive = False
        if self.workers.get(w.worker_id) is w:
            del self.workers[w.worker_id]
            self.index.remove_worker(w.worker_id)
        resume = []
        for pl in w.unplace_all():
            rid = pl.pending.request_id
            if self.where.get(rid) == w.worker_id:
                del self.where[rid]
                self._in_hand.add(rid)
                resume.append(pl.pending)
        self.num_reassigned += len(resume)
        return resume

    # -- time ------------------------------------------------------------------------------------
    def silent_workers(self, dead_after_s: float) -> list[WorkerEntry]:
        """Workers without a report for longer than ``dead_after_s`` (the caller declares them dead)."""
        now = self.clock()
        return [w for w in self.workers.values() if now - w.last_report_at > dead_after_s]

    def expired(self) -> tuple[list[Pending], list[str]]:
        """Requests past their deadline: ``(waited, running)``. The waiting ones are taken
        out of the queue into hand (the caller finishes them with an error); the running ones
        stay placed (the caller cancels them)."""
        now_ms = int(self.wall_clock() * 1000)
        waited = self.queue.pop_expired(now_ms)
        self._in_hand.update(p.request_id for p in waited)
        running = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self.where:
                running.append(rid)
        return waited, running

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise if the structures disagree (tests call this after every step)."""
        placed: dict[str, str] = {}
        for wid, w in self.workers.items():
            assert w.alive and w.worker_id == wid, wid
            w.check_integrity()
            for rid, pl in w.placed.items():
                assert rid not in placed, f"{rid} placed on {placed[rid]} and {wid}"
                assert self.known.get(rid) is pl.pending, f"{rid} placed on {wid} but not known as placed there"
                placed[rid] = wid
        assert placed == self.where, "where and the workers' placed requests disagree"
        queued = {p.request_id for p in self.queue.ordered()}
        assert len(queued) == len(self.queue)
        assert all(self.known.get(rid) is self.queue.get(rid) for rid in queued), "a queued request not the one known"
        in_hand, where = self._in_hand, set(self.where)
        assert not (queued & where or queued & in_hand or in_hand & where), "a request in two places"
        assert queued | where | in_hand == set(self.known), "a known request is nowhere (or one nowhere known)"
        self.index.check_integrity()
        for rid in self.index.held_request_ids:
            assert self.index.holder(rid) == self.where.get(rid), f"{rid}'s keys held where it is not placed"
        assert len(self._done_recently) <= self.cfg.done_memory
