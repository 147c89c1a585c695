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

Drops: a worker lets a placed request go without a finish only when it is told to (a cancel,
or a write of its refused: the request was moved or finished) or when its steps stream is
fenced (it was declared dead: it drops everything and writes on in a new stream). Its reports
show each drop (``dropped``: a request a report named held, with or without device blocks,
that a later one no longer names, unfinished); a drop before any report named the request
shows only in its worker's stream (declared dead, or a new stream in its row:
``worker_dead`` hands back everything placed there, named or not).

Rounds: ``decide_round`` claims placements for the queue's heads while they fit, up to a
round (at least ``ROUND``, ``ROUND_PER_WORKER`` a worker in a larger fleet), each recorded on
its worker at once so the next decision sees it. A head that fits nowhere ends the round; if
nothing was claimed before it, the round places it by preempting lower-priority sequences
(``workers.pick_victims``) when preemption is on. Head of line: no request is overtaken.

Moving KV (moves.py): with workers of role ``prefill`` the rounds disaggregate
conditionally; ``prefilled`` / ``decide_moves`` start transfers (to a decoding worker, off a
worker draining by migration, for load balance), ``transfer_done`` hands a request over,
``expired_transfers`` takes back those past their lease, ``called_off`` names those a death or
a drop ended. A request in transfer is placed on its source (``where``) and holds a
reservation on its target's ``placed``. Its source's reports may stop naming it before the
transfer's answer comes (the source lets it go at the handover): that is no drop; the answer
(``transfer_done``, ``transfer_refused``) or the deadline settles it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pagefleet.protos import cluster_pb2

from .moves import (
    MoveConfig,
    Transfer,
    balance_moves,
    best_target,
    decodes,
    drain_moves,
    exchanges_kv,
    prefills,
)
from .placement import Placement, PlacementConfig, Placer
from .prefix_index import DEFAULT_MAX_KEYS, PrefixIndex
from .queue import GlobalQueue, Pending
from .workers import Placed, WorkerEntry, pick_victims

# A round decides at least ROUND placements, and ROUND_PER_WORKER a worker in a larger fleet,
# so that a deep queue's round sends each worker a batch rather than one request (a message
# on its assign stream costs the scheduler ~0.1 ms of gRPC whatever it carries). A round only
# grows when that many requests wait.
ROUND = 256
ROUND_PER_WORKER = 4
# Requests whose final write was seen, remembered this long (at most this many): a worker's
# report can reach the scheduler after the finish it predates (a gRPC stream and a Redis
# stream do not keep one order), and listing such a request is no orphan. A report is a few
# hundred milliseconds old at most; a time bound, not only a count, lets the memory stop
# growing within minutes at any rate (a count alone filled for half an hour at 35 requests/s).
DONE_MEMORY = 65536
DONE_MEMORY_S = 120.0
# A request whose move was refused (no room after all, a pairing refused, a failed copy) is not
# moved again (a handoff to a decoding worker, load balance, a drain) for this long (seconds): no
# storm of doomed moves.
MOVE_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    policy: str = "fcfs"  # the queue's: fcfs | priority | deadline
    aging_s: float = 10.0
    headroom_tokens: int = 64
    preempt: bool = True  # place a blocked head by preempting lower-priority sequences
    model: str | None = None  # the shard's model: a request queued for another is refused
    placement: PlacementConfig = PlacementConfig()
    prefix_index_size: int = DEFAULT_MAX_KEYS  # most cached block keys the index keeps
    done_memory: int = DONE_MEMORY
    done_memory_s: float = DONE_MEMORY_S
    moves: MoveConfig = MoveConfig()  # disaggregation and migration (moves.py)


@dataclass(frozen=True, slots=True)
class Decision:
    """One round. ``claims``: requests claimed on their workers (already placed in the
    ledger): fence and send them, then report each answer with ``settled``. ``victims``
    (non-empty only when the round preempts): ``claims`` is then the one request placed by
    preempting these on its worker; send it first, then preempt them (``preempted``)."""

    claims: list[tuple[Pending, Placement]] = field(default_factory=list)
    victims: list[Placed] = field(default_factory=list)
    # Victims moved instead of preempted (``MoveConfig.migrate_victims``): start these transfers.
    moves: list[Transfer] = field(default_factory=list)
    # Heads no worker could ever take (past every worker's context or pool): in hand, to be
    # finished with the error given (they would hold the queue back for good).
    refused: list[tuple[Pending, str]] = field(default_factory=list)


# A request whose deadline passed before it was placed is finished with this error.
DEADLINE_WAITING = "deadline exceeded while waiting"
# How long a dead worker's context and pool still count for what the fleet could take: one
# restarted (a container, a pod) is back well within it; one scaled away stops counting.
DEAD_WORKER_LIMITS_S = 300.0


def _fits_no_worker(p: Pending, limits: Iterable[tuple[int, int]]) -> str:
    """Why no decoding worker seen could ever take ``p``, even empty ("" if one could, or if
    none has reported yet): ``limits`` are each decoding worker's (context, whole pool in
    tokens), of those up and of those dead for less than ``DEAD_WORKER_LIMITS_S`` (one may come
    back). One worker must hold both: a long context on one and a large pool on another take
    nothing neither takes alone. The gateway checks a request against its own
    ``--max-model-len``, which the workers' may be below."""
    limits = list(limits)
    if not limits:
        return ""
    total = p.num_tokens + p.num_remaining_tokens
    if any(total <= context and total <= pool for context, pool in limits):
        return ""
    longest = max(context for context, _ in limits)
    if total > longest:
        return (f"the request needs {total} tokens (its prompt and max_tokens); the longest any worker "
                f"takes is {longest}: lower max_tokens or shorten the prompt")
    pool = max(pool for context, pool in limits if context >= total)
    return (f"the request needs {total} tokens of KV cache; the largest whole pool of a worker whose context "
            f"takes it holds {pool}: lower max_tokens or shorten the prompt")


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
        # Each decoding worker's (context, whole pool in tokens, when it died or None while up):
        # what a request must fit on one worker (``_fits_no_worker``).
        self._limits: dict[str, tuple[int, int, float | None]] = {}
        self._done_recently: dict[str, float] = {}  # id -> when it finished; insertion-ordered: the oldest go first
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_reassigned = 0
        # KV moves (moves.py): in flight by request id; prefilled requests waiting for a decoding
        # worker; transfers called off (a side died or dropped it) the caller has not yet taken.
        self.transfers: dict[str, Transfer] = {}
        self._awaiting_decode: dict[str, None] = {}
        self._called_off: list[Transfer] = []
        self.num_transfers_done = 0
        self.num_transfers_expired = 0
        self._move_refused: dict[str, float] = {}  # request id -> when its last move was refused

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

    def placed_on(self, request_id: str) -> WorkerEntry | None:
        """The live worker ``request_id`` is placed on; None if it is queued, in hand or unknown."""
        wid = self.where.get(request_id)
        return self.workers.get(wid) if wid is not None else None

    def is_new(self, request_id: str) -> bool:
        """Whether an entry naming ``request_id`` is a request to take in: neither known nor
        finished recently (a re-read entry of one whose final write landed is not run again)."""
        return request_id not in self.known and request_id not in self._done_recently

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
        self._watch_deadline(p)  # it runs there (no Assign to settle): its deadline is watched now
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
        done, now = self._done_recently, self.clock()
        done.pop(request_id, None)
        done[request_id] = now
        horizon = now - self.cfg.done_memory_s
        while done and (len(done) > self.cfg.done_memory or next(iter(done.values())) < horizon):
            del done[next(iter(done))]
        self.known.pop(request_id, None)
        self._in_hand.discard(request_id)
        self.queue.remove(request_id)
        if request_id in self.transfers:
            self._call_off(request_id)
        self._awaiting_decode.pop(request_id, None)
        self._move_refused.pop(request_id, None)
        self.index.release(request_id)
        if (w := self.placed_on(request_id)) is not None:
            w.unplace(request_id)
        self.where.pop(request_id, None)

    # -- placing ---------------------------------------------------------------------------------
    def _refuse(self, p: Pending, why: str) -> tuple[Pending, str]:
        """``p`` out of the queue and in hand, to be finished with ``why`` (``Decision.refused``)."""
        self.queue.remove(p.request_id)
        self._in_hand.add(p.request_id)
        return p, why

    def decide_round(self) -> Decision:
        """Claim placements for the queue's heads while they fit, a round at most; a head
        that fits nowhere ends the round, and is placed by preemption if nothing was claimed
        before it (see the module docstring). An empty decision: the queue is empty, or its
        head waits until a report shows room."""
        if self.queue.peek() is None:
            return Decision()
        live = list(self.workers.values())
        choose = self._chooser(live)  # valid while only this round's claims change the workers
        claims: list[tuple[Pending, Placement]] = []
        refused: list[tuple[Pending, str]] = []
        headroom = self.cfg.headroom_tokens
        size = max(ROUND, ROUND_PER_WORKER * len(self.workers))
        now_ms = int(self.wall_clock() * 1000)
        t0 = time.perf_counter()
        while len(claims) < size and (p := self.queue.peek()) is not None:
            if p.deadline_unix_ms and p.deadline_unix_ms <= now_ms:  # its time ran out in the queue: never run
                refused.append(self._refuse(p, DEADLINE_WAITING))
                continue
            if self.cfg.model and p.assign.model and p.assign.model != self.cfg.model:
                # Another model's answer would be worse than none: the gateway's map of models
                # to shards is not the schedulers'.
                refused.append(self._refuse(p, f"this shard serves model {self.cfg.model!r}, not {p.assign.model!r}: "
                                               "the gateways' --shards (or order of --model) disagree with the "
                                               "schedulers'"))
                continue
            placement = choose(p, headroom)
            t0 = self._timed(t0)
            if placement is None and (why := _fits_no_worker(p, self._fleet_limits())):
                refused.append(self._refuse(p, why))
                continue
            if placement is None:
                if claims or not self.cfg.preempt:
                    break
                found = pick_victims(live, p, headroom, now=self.clock())
                if found is None:
                    break
                w, victims = found
                placement = Placement(w, "preempt")
                self._claim(p, placement)
                decision = self._preempting(live, p, placement, victims)
                decision.refused.extend(refused)
                return decision
            self._claim(p, placement)
            claims.append((p, placement))
        return Decision(claims, refused=refused)

    def _chooser(self, live: list[WorkerEntry]) -> Callable[[Pending, int], Placement | None]:
        """Where a head goes: one round over every worker, or, once any worker has a role
        other than ``both``, conditional disaggregation over two rounds (moves.py): a short
        prompt, or one a decoding worker caches enough of, goes to a decoding worker; any
        other to a prefill worker, or to a decoding one while no prefill worker has room
        (``local_prefill_when_full``). A round's workers of role ``both`` are in both rounds."""
        if all(w.role == "both" for w in live):
            return self.placer.round(live).choose
        mc = self.cfg.moves
        decoders = [w for w in live if decodes(w)]
        queued = {w.worker_id: self._num_prefill_tokens(w) for w in live if w.role == "prefill"}
        prefillers = [w for w in live if prefills(w) and queued.get(w.worker_id, 0) < mc.prefill_queue_tokens]
        rounds = [self.placer.round(prefillers), self.placer.round(decoders)]

        def choose(p: Pending, headroom: int) -> Placement | None:
            pre, dec = rounds
            if p.num_tokens <= mc.short_prompt_tokens or self._cached_enough(decoders, p):
                return dec.choose(p, headroom)
            placement = pre.choose(p, headroom)
            if placement is not None and (wid := placement.worker.worker_id) in queued:
                queued[wid] += p.num_tokens
                if queued[wid] >= mc.prefill_queue_tokens:  # full now: the rest of the round goes elsewhere
                    prefillers.remove(placement.worker)
                    rounds[0] = self.placer.round(prefillers)
            if placement is None and mc.local_prefill_when_full:
                placement = dec.choose(p, headroom)
            return placement

        return choose

    def _num_prefill_tokens(self, w: WorkerEntry) -> int:
        """The tokens of the prompts placed on ``w`` it has not prefilled yet (nor handed on)."""
        return sum(pl.pending.num_tokens for rid, pl in w.placed.items()
                   if not pl.finished and rid not in self._awaiting_decode and rid not in self.transfers)

    def _cached_enough(self, decoders: list[WorkerEntry], p: Pending) -> bool:
        """Whether a decoding worker holds ``decode_cache_threshold`` of ``p``'s prompt blocks."""
        matches = self.placer.matches(decoders, p)
        best = max((m.num_matched_blocks for m in matches.values()), default=0)
        return best > 0 and best >= self.cfg.moves.decode_cache_threshold * len(p.assign.block_hashes)

    def _preempting(self, live: list[WorkerEntry], p: Pending, placement: Placement,
                    victims: list[Placed]) -> Decision:
        """The round that places ``p`` by preempting ``victims``: with ``migrate_victims``, each
        victim another worker can hold moves there instead (``Decision.moves``)."""
        if not self.cfg.moves.migrate_victims:
            return Decision([(p, placement)], victims)
        w, kept, moved = placement.worker, [], []
        for v in victims:
            target = best_target(live, v.pending, w, self.cfg.headroom_tokens)
            if target is None or v.pending.request_id in self.transfers or v.pending.request_id in self._awaiting_decode:
                kept.append(v)
                continue
            v.preempted_at = self.clock()  # not chosen again before the cooldown either way
            moved.append(self._start(v.pending, w, target, "preemption"))
        return Decision([(p, placement)], kept, moved)

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
        if not self.is_placed(rid, w.worker_id) or self.workers.get(w.worker_id) is not w:
            return  # (an answer of a dead entry of the id, re-placed on a new one meanwhile, too)
        if accepted:
            self._watch_deadline(p)
            return
        w.accepting = False
        w.unplace(rid)
        self.index.release(rid)
        del self.where[rid]
        self.queue.push(p)

    def _watch_deadline(self, p: Pending) -> None:
        """Watch ``p``'s deadline while it runs (``expired``). The heap drops the entries of
        requests no longer known when it holds twice as many as there are known requests, so
        far deadlines of finished requests do not pile up."""
        if not p.assign.deadline_unix_ms:
            return
        heapq.heappush(self._deadlines, (p.assign.deadline_unix_ms, p.request_id))
        if len(self._deadlines) > 2 * len(self.known) + 64:  # the known: in hand too (being resumed)
            live = {(d, rid) for d, rid in self._deadlines if rid in self.known}
            self._deadlines = sorted(live)  # a sorted list is a heap; one entry a request and deadline

    def preempted(self, victim: Placed) -> None:
        """Its worker swapped (or will recompute) ``victim`` for a higher priority: it stays
        placed there, and is not chosen again before the cooldown."""
        victim.preempted_at = self.clock()
        self.num_preemptions += 1

    # -- moving KV (moves.py) ---------------------------------------------------------------------
    @property
    def num_in_transfer(self) -> int:
        return len(self.transfers)

    def prefilled(self, request_id: str) -> list[Transfer]:
        """``request_id``'s prefill is done on its prefill worker: it waits there for a decoding
        worker. Returns the transfers to decoding workers that can start now (its own, if one
        has room, after those of requests prefilled before it; the rest start in a later
        ``decide_moves``). Nothing changes unless it is placed on a worker of role ``prefill``."""
        wid = self.where.get(request_id)
        if wid is None or self.workers[wid].role != "prefill" or request_id in self.transfers:
            return []
        self._awaiting_decode[request_id] = None
        return self._handovers()

    def decide_moves(self) -> list[Transfer]:
        """Transfers to start now: prefilled requests to decoding workers (in the order they
        were prefilled, while one fits), the requests of workers draining by migration, then
        load-balance moves (``MoveConfig.migrate_above``).
        Each is recorded at once (its target's reservation placed); the caller starts the copy
        and reports its end with ``transfer_done`` (or lets the deadline take it back)."""
        moves = self._handovers()
        sending = Counter(t.source.worker_id for t in self.transfers.values())
        # Moving, refused a moment ago, or prefilled and waiting for a decoding worker (its own move)
        busy = self.transfers.keys() | self._refused_recently() | self._awaiting_decode.keys()
        for pl, source, target in drain_moves(list(self.workers.values()), self.where, busy, sending,
                                              self.cfg.headroom_tokens):
            moves.append(self._start(pl.pending, source, target, "drain"))
            sending[source.worker_id] += 1
        busy = self.transfers.keys() | self._move_refused.keys() | self._awaiting_decode.keys()
        for pl, source, target in balance_moves([w for w in self.workers.values() if decodes(w)], self.where,
                                                busy, sending, self.cfg.moves, self.cfg.headroom_tokens):
            moves.append(self._start(pl.pending, source, target, "balance"))
        return moves

    def _refused_recently(self) -> set[str]:
        """Requests whose move was refused less than ``MOVE_RETRY_S`` ago (the older ones forgotten)."""
        now = self.clock()
        for rid in [rid for rid, at in self._move_refused.items() if now - at >= MOVE_RETRY_S]:
            del self._move_refused[rid]
        return set(self._move_refused)

    def _handovers(self) -> list[Transfer]:
        if not self._awaiting_decode:
            return []
        decoders = [w for w in self.workers.values() if decodes(w)]
        # By the sources' KV layouts: a prompt's KV goes to a worker whose blocks mean the same.
        rounds = {}
        full: set[str] = set()  # layouts whose first waiting request fits nowhere now
        refused = self._refused_recently()
        moves = []
        for rid in list(self._awaiting_decode):
            if rid in refused:
                continue  # waits out MOVE_RETRY_S; those prefilled after it need not
            if rid not in self.where or rid in self.transfers:  # no longer waiting there (cannot happen: kept tidy)
                del self._awaiting_decode[rid]
                continue
            p = self.known[rid]
            source = self.workers[self.where[rid]]
            layout = source.kv_layout
            if layout in full:
                continue  # behind one of its layout that fits nowhere: waits with it
            rnd = rounds.get(layout)
            if rnd is None:
                peers = [w for w in decoders if exchanges_kv(source, w)]
                if decoders and not peers:  # decoding workers, none can take its blocks: it decodes where it is
                    del self._awaiting_decode[rid]
                    continue
                rnd = rounds[layout] = self.placer.round(peers)
            placement = rnd.choose(p, self.cfg.headroom_tokens)
            if placement is None:
                full.add(layout)  # nothing fits (or no decoding worker is up yet): the later ones of its layout wait
                continue
            del self._awaiting_decode[rid]
            moves.append(self._start(p, self.workers[self.where[rid]], placement.worker, "disaggregation",
                                     placement.num_shared_blocks))
        return moves

    def _start(self, p: Pending, source: WorkerEntry, target: WorkerEntry, reason: str,
               num_shared_blocks: int = 0) -> Transfer:
        """Record a move: ``target`` holds a reservation for ``p``; ``source`` still owns it."""
        rid = p.request_id
        target.place(p, self.cfg.headroom_tokens, num_shared_blocks, now=self.clock())
        t = Transfer(p, source, target, reason, self.clock() + self.cfg.moves.timeout_s, source.held.get(rid, 0))
        self.transfers[rid] = t
        return t

    def renew_transfer(self, request_id: str) -> bool:
        """The receiver renews the lease of ``request_id``'s transfer; False if none is in flight."""
        t = self.transfers.get(request_id)
        if t is None:
            return False
        t.deadline = self.clock() + self.cfg.moves.timeout_s
        return True

    def transfer_done(self, request_id: str) -> bool:
        """Every block arrived and was checked: ``request_id`` is owned by its target from now
        on (the caller tells the source to let it go). False, and nothing changes, if the
        transfer is no longer in flight (taken back, called off or never started): the caller
        tells the target to drop what it received."""
        t = self.transfers.pop(request_id, None)
        if t is None:
            return False
        t.source.unplace(request_id)
        self.index.release(request_id)
        self.where[request_id] = t.target.worker_id
        self._hold(t.target, t.pending)
        self.num_transfers_done += 1
        return True

    def transfer_refused(self, request_id: str) -> bool:
        """The target could not take ``request_id`` (no room after all, or it refused the
        pairing): the move is off, the source keeps it (a prefilled request waits for another
        decoding worker). False if no transfer of it is in flight."""
        if request_id not in self.transfers:
            return False
        self._call_off(request_id)
        self._called_off.pop()  # the caller knows: nothing to tell the target
        self._move_refused[request_id] = self.clock()  # not moved again for MOVE_RETRY_S
        return True

    def expired_transfers(self) -> list[Transfer]:
        """Transfers past their deadline, taken back from both sides: each request is in hand
        (the caller tells both workers to drop it and resumes it from its tokens)."""
        now = self.clock()
        out = [t for t in self.transfers.values() if t.deadline <= now]
        for t in out:
            rid = t.request_id
            del self.transfers[rid]
            t.target.unplace(rid)
            t.source.unplace(rid)
            self.index.release(rid)
            del self.where[rid]
            self._in_hand.add(rid)
        self.num_transfers_expired += len(out)
        return out

    def handover_found(self, p: Pending, target: WorkerEntry) -> bool:
        """``p`` is in hand because its source died while moving it to ``target``, and Redis
        names ``target`` its owner (the handover landed before the source's answer could come):
        it is placed there, counted as a handover, not a reassignment. False (nothing changes)
        if ``p`` is not in hand or ``target`` is not a live worker of the table."""
        rid = p.request_id
        if rid not in self._in_hand or self.workers.get(target.worker_id) is not target:
            return False
        self._in_hand.discard(rid)
        target.place(p, self.cfg.headroom_tokens, now=self.clock())
        self._hold(target, p)
        self.where[rid] = target.worker_id
        self._watch_deadline(p)
        self.num_reassigned -= 1
        self.num_transfers_done += 1
        return True

    def called_off(self) -> list[Transfer]:
        """Transfers ended without a handover since the last call (a side died or dropped the
        request, or it finished): the caller tells the target to drop what it received."""
        out, self._called_off = self._called_off, []
        return out

    def _call_off(self, request_id: str) -> None:
        t = self.transfers.pop(request_id)
        t.target.unplace(request_id)
        self._called_off.append(t)
        if t.reason == "disaggregation" and self.where.get(request_id) == t.source.worker_id:
            self._awaiting_decode[request_id] = None  # still prefilled there: wait for another

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
        for rid in report.finished_request_ids:  # its blocks run no more: shared with no running sequence
            if self.where.get(rid) == w.worker_id:
                self.index.release(rid)
        if decodes(w):  # what a request must fit, on some worker it can finish on (``_fits_no_worker``)
            self._limits[w.worker_id] = (w.max_model_len, w.pool_size * w.block_size, None)
        self.index.apply_events(w.worker_id, report.stored_block_hashes, report.evicted_block_hashes,
                                report.block_hashes_reset)
        for rid in vanished:
            t = self.transfers.get(rid)
            if t is not None and w is t.target:  # the target dropped what it received: the move is off
                self._call_off(rid)
        # Gone from its source while in transfer: handed over, or dropped there; the transfer's
        # answer (or its deadline) settles which, not this report.
        resume = self.dropped(w, [rid for rid in vanished if rid not in self.transfers])
        withdraw = [] if self.adopting else self._orphans(orphans)
        return ReportOutcome(resume, withdraw, room is None or bool(vanished) or w.num_available_blocks > room)

    def dropped(self, w: WorkerEntry, request_ids: list[str]) -> list[Pending]:
        """``w`` let these requests go without a finish (its report no longer names them, or
        names them released): each still placed there, and not reported finished, leaves it
        with its prefix holds and is in hand, returned for the caller to resume from its
        output. The others (moved, finished, never placed there) stay as they are."""
        resume = []
        for rid in request_ids:
            pl = w.placed.get(rid)
            if pl is None or pl.finished or self.where.get(rid) != w.worker_id:
                continue
            w.unplace(rid)
            self.index.release(rid)
            del self.where[rid]
            self._awaiting_decode.pop(rid, None)
            self._in_hand.add(rid)
            resume.append(pl.pending)
        return resume

    def finish_unconfirmed(self, rid: str) -> Pending | None:
        """``rid``'s worker reported it finished, but Redis holds no finish of it long after
        (its final write was refused: the assignment it ran under was lost in a Redis
        failover). Taken back in hand to resume, as a request dropped without a finish; None if
        it is not placed as finished."""
        wid = self.where.get(rid)
        w = self.workers.get(wid) if wid else None
        pl = w.placed.get(rid) if w is not None else None
        if pl is None or not pl.finished:
            return None
        if rid in self.transfers:  # a move of it is off (its target is told to drop what it got)
            self._call_off(rid)
        w.unplace(rid)
        self.index.release(rid)
        del self.where[rid]
        self._awaiting_decode.pop(rid, None)
        self._in_hand.add(rid)
        return pl.pending

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
            if (limits := self._limits.get(w.worker_id)) is not None:
                self._limits[w.worker_id] = (*limits[:2], self.clock())
        for rid in [rid for rid, t in self.transfers.items() if w in (t.source, t.target)]:
            self._call_off(rid)
        resume = []
        for pl in w.unplace_all():
            rid = pl.pending.request_id
            if self.where.get(rid) == w.worker_id:
                del self.where[rid]
                self._awaiting_decode.pop(rid, None)
                self._in_hand.add(rid)
                resume.append(pl.pending)
        self.num_reassigned += len(resume)
        return resume

    def _fleet_limits(self) -> Iterator[tuple[int, int]]:
        """(context, pool) of each decoding worker up, or dead for less than ``DEAD_WORKER_LIMITS_S``
        (the others are forgotten here)."""
        now = self.clock()
        for worker_id, (context, pool, died) in list(self._limits.items()):
            if died is not None and now - died > DEAD_WORKER_LIMITS_S:
                del self._limits[worker_id]
                continue
            yield context, pool

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
        running: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self.where and rid not in running:  # (watched again after a handover: once)
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
                t = self.transfers.get(rid)
                if t is not None and t.target is w:  # a reservation: owned by the source only
                    assert self.known.get(rid) is pl.pending is t.pending, f"{rid}'s reservation on {wid}"
                    continue
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
        for rid, t in self.transfers.items():  # in transfer: owned by exactly one worker, its source
            assert t.request_id == rid and t.source is not t.target, rid
            assert self.where.get(rid) == t.source.worker_id, f"{rid} in transfer but not owned by its source"
            assert self.workers.get(t.target.worker_id) is t.target and rid in t.target.placed, \
                f"{rid}'s target holds no reservation"
        for rid in self._awaiting_decode:
            assert rid not in self.transfers and rid in self.where, f"{rid} awaits a decoding worker but is not placed"
