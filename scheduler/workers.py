"""The worker table: what each worker last reported, and what was sent since.

Admission: a request fits on a worker when the worker's free blocks, minus the blocks
of its swapped-out sequences (they come back first), minus the blocks still owed to the
requests placed there, cover what the request will take from them. A placed request is
owed that much until a report shows it with device blocks, then whatever it has not grown
into yet (so a worker is not filled past what its running sequences will need a moment
later, which would only turn into preemptions there).

What a request takes, with prefix caching: its block table will have ``n =
blocks(tokens + headroom)`` blocks; the first ``k`` of them are on the worker already
(``prefix_index.Match.num_matched_blocks``), ``s <= k`` of those shared with sequences
placed there and not finished (``num_shared_blocks``: held, so not counted free). The
other ``k - s`` sit in the worker's prefix cache unused, and an unused cached block is
still counted in ``num_free_blocks`` (the worker evicts it on demand). The request needs
its uncached part, ``n - k`` blocks, from the available blocks other than the ``k - s``
cached ones it reuses (they stop being free), so it fits when
``n - k <= available - (k - s)``, i.e. ``n - s <= available``: counting the cached blocks
as both free and reusable would count them twice. ``n - s`` is what a placed request is
owed until a report shows it; from then on, ``n`` minus the blocks in its table (shared
or not): only growth takes new blocks. (A worker shares a block once it is computed, so
a burst placed before the first request's prefill is done may compute it more than once:
until the next report such requests take more than they are owed, and the worker's own
admission holds them back; ``s`` is an estimate, as every number here between reports.)

Score (larger wins): **the fraction of the worker's pool still free after placing the
request, minus 0.01 per request placed there** (counted as each is placed, not as reports
tell) - spread by memory and by requests, so that no worker takes a run of placements between
two of its reports.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from pagefleet.common.blocks import num_blocks_for
from pagefleet.protos import cluster_pb2

from .queue import Pending

# What a worker does (``pagefleet worker --role``): prefill only and hand the KV over, decode
# only (it receives KV, and prefills the prompts disaggregation leaves local), or both.
ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class Placed:
    """A request placed on a worker."""

    pending: Pending
    num_reserved_blocks: int  # its tokens plus headroom: the block table it grows into
    num_shared_blocks: int = 0  # of those, blocks expected shared with sequences running there
    reflected: bool = False  # a report showed it holding device blocks since it was sent
    # A report named it held since it was sent (with or without device blocks): from then on
    # a report that no longer names it, unfinished, shows it dropped. Before, not naming it
    # says nothing: the Assign may not have reached the worker's engine yet.
    listed: bool = False
    # The worker reported it finished; it stays placed (owed nothing) until its final write
    # is seen in Redis, so a worker dying before that write landed has it resumed.
    finished: bool = False
    placed_at: float = field(default_factory=time.monotonic)
    preempted_at: float = -math.inf  # never (a clock may start at 0: not "just preempted" then)


@dataclass(slots=True)
class WorkerEntry:
    """One worker as the scheduler sees it. ``placed`` is read freely but changed only by
    ``place`` / ``unplace`` / ``unplace_all`` / ``apply_report``, which keep
    ``num_owed_blocks_total`` current (so admission costs O(1) per worker, not O(placed))."""

    worker_id: str
    address: str
    channel: object = None
    stub: object = None
    report: cluster_pb2.OccupancyReport | None = None
    last_report_at: float = field(default_factory=time.monotonic)
    placed: dict[str, Placed] = field(default_factory=dict)
    num_assigned: int = 0
    alive: bool = True
    accepting: bool = True  # False once it refused an Assign (draining) before its report says so
    role: str = "both"  # one of ROLES, from its registration (see moves.py)
    assigns: object = None  # its assign_stream.AssignStream, opened with the first Assign
    # Blocks owed to all the requests placed here (see the module docstring).
    num_owed_blocks_total: int = field(default=0, init=False)
    # From the latest report, read once per report rather than once per decision.
    _num_reported_free: int = field(default=0, init=False, repr=False)  # free minus swapped
    _limits: tuple[int, int, int] = field(default=(0, 0, 1), init=False, repr=False)  # model len, seqs, blocks
    _priorities: Counter[int] = field(default_factory=Counter, init=False, repr=False)  # of placed requests
    # Every request the worker holds -> its device blocks, kept from its reports (whole or deltas).
    held: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if self.report is not None:
            self._take(self.report)
            self.num_owed_blocks_total = sum(self.num_owed_blocks(rid, pl) for rid, pl in self.placed.items())
        self._priorities.update(pl.pending.priority for pl in self.placed.values())

    def _take(self, r: cluster_pb2.OccupancyReport) -> None:
        self.report = r
        self._num_reported_free = r.num_free_blocks - r.num_swapped_blocks
        self._limits = (r.max_model_len, r.max_num_seqs, max(1, r.num_blocks))
        blocks = r.blocks_per_request
        if not r.holdings_delta:
            self.held = {rid: blocks.get(rid, 0) for rid in r.request_ids}
            return
        held = self.held
        for rid in r.released_request_ids:
            held.pop(rid, None)
        for rid in r.request_ids:
            held[rid] = 0
        for rid, n in blocks.items():
            if rid in held:
                held[rid] = n

    # -- the numbers admission uses ---------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.alive and self.accepting and self.report is not None and not self.report.draining

    @property
    def block_size(self) -> int:
        return self.report.block_size if self.report else 16

    @property
    def kv_layout(self) -> str:
        """What its KV pool's blocks hold (``OccupancyReport.kv_layout``; "" if it has no transport)."""
        return self.report.kv_layout if self.report else ""

    def num_owed_blocks(self, rid: str, pl: Placed) -> int:
        """Blocks ``pl`` may still claim on this worker beyond the device blocks it has now."""
        if pl.finished:
            return 0
        if not pl.reflected:
            return pl.num_reserved_blocks - pl.num_shared_blocks
        num_device_blocks = self.held.get(rid, 0)
        # None after it had some: swapped out (counted as swapped blocks) or queued again
        # inside the worker; either way not growing now.
        return max(0, pl.num_reserved_blocks - num_device_blocks) if num_device_blocks else 0

    @property
    def num_available_blocks(self) -> int:
        if self.report is None:
            return 0
        return self._num_reported_free - self.num_owed_blocks_total

    @property
    def load(self) -> int:
        """Requests placed here and not finished (running, waiting there, or not reported yet)."""
        return len(self.placed)

    def blocks_needed(self, p: Pending, headroom_tokens: int) -> int:
        """``n``: the block table of ``p``'s tokens plus headroom."""
        return num_blocks_for(p.num_tokens + min(p.num_remaining_tokens, headroom_tokens), self.block_size)

    def blocks_taken(self, p: Pending, headroom_tokens: int, num_shared_blocks: int = 0) -> int:
        """What placing ``p`` here takes from the available blocks: ``n - num_shared_blocks``."""
        return self.blocks_needed(p, headroom_tokens) - num_shared_blocks

    def fits(self, p: Pending, headroom_tokens: int, num_shared_blocks: int = 0) -> bool:
        if not self.ready:
            return False
        return self.has_room(p.num_tokens + p.num_remaining_tokens,
                             self.blocks_taken(p, headroom_tokens, num_shared_blocks))

    def has_room(self, num_total_tokens: int, num_blocks_taken: int) -> bool:
        """Whether a request of ``num_total_tokens`` (prompt + all it may generate) taking
        ``num_blocks_taken`` blocks fits here now; the caller has checked ``ready``."""
        max_model_len, max_num_seqs, _ = self._limits
        return (num_total_tokens <= max_model_len and len(self.placed) < max_num_seqs
                and num_blocks_taken <= self._num_reported_free - self.num_owed_blocks_total)

    def score(self, p: Pending, headroom_tokens: int, num_shared_blocks: int = 0) -> float:
        return self.score_after(self.blocks_taken(p, headroom_tokens, num_shared_blocks))

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt and all it may generate) it takes (0 before its first report)."""
        return self._limits[0]

    @property
    def pool_size(self) -> int:
        """Blocks in the worker's pool (1 before its first report)."""
        return self._limits[2]

    @property
    def spare(self) -> float:
        """``score_after(0)``: what the score of every request here shares; with one pool size
        for all, workers in this order are in the order of their scores for any request."""
        return self.score_after(0)

    def score_after(self, num_blocks_taken: int) -> float:
        """The fraction of the pool left after taking ``num_blocks_taken``, less 0.01 a request
        placed here (counted as each is placed: a worker's running count only changes with its
        reports, and ranking by it sent every placement between two reports to the one worker
        whose last report showed the fewest, ten and more in a row)."""
        left = self._num_reported_free - self.num_owed_blocks_total - num_blocks_taken
        return left / self._limits[2] - 0.01 * len(self.placed)

    # -- bookkeeping ---------------------------------------------------------------------
    def place(self, p: Pending, headroom_tokens: int, num_shared_blocks: int = 0, *,
              reflected: bool = False, now: float | None = None) -> Placed:
        """``reflected``: a report already shows it here (a takeover adopting it); so does
        holding device blocks for it in the latest report (a delta names it no more), and
        holding it at all makes it ``listed``.
        ``now``: the clock ``Placed.placed_at`` is on (default ``time.monotonic()``)."""
        rid = p.request_id
        self.unplace(rid)
        pl = self.placed[rid] = Placed(p, self.blocks_needed(p, headroom_tokens), num_shared_blocks,
                                       reflected=reflected or self.held.get(rid, 0) > 0,
                                       listed=reflected or rid in self.held,
                                       placed_at=time.monotonic() if now is None else now)
        self.num_owed_blocks_total += self.num_owed_blocks(rid, pl)
        self._priorities[p.priority] += 1
        self.num_assigned += 1
        return pl

    def unplace(self, rid: str) -> Placed | None:
        """``rid`` leaves this worker (finished, moved or refused); its entry, None if not here."""
        pl = self.placed.pop(rid, None)
        if pl is not None:
            self.num_owed_blocks_total -= self.num_owed_blocks(rid, pl)
            priority = pl.pending.priority
            self._priorities[priority] -= 1
            if not self._priorities[priority]:
                del self._priorities[priority]
        return pl

    def unplace_all(self) -> list[Placed]:
        """Every request leaves (the worker is dead); their entries."""
        placed = list(self.placed.values())
        self.placed.clear()
        self._priorities.clear()
        self.num_owed_blocks_total = 0
        return placed

    def check_integrity(self) -> None:
        """Raise if the running totals disagree with the placed requests (tests call this)."""
        owed = sum(self.num_owed_blocks(rid, pl) for rid, pl in self.placed.items())
        assert self.num_owed_blocks_total == owed, (self.worker_id, self.num_owed_blocks_total, owed)
        priorities = Counter(pl.pending.priority for pl in self.placed.values())
        assert self._priorities == priorities, (self.worker_id, self._priorities, priorities)
        assert all(pl.pending.request_id == rid for rid, pl in self.placed.items()), self.worker_id

    def holds_priority_below(self, priority: int) -> bool:
        """Whether a request placed here has a lower priority than ``priority`` (a possible victim)."""
        return any(q < priority for q in self._priorities)

    def apply_report(self, report: cluster_pb2.OccupancyReport,
                     now: float | None = None) -> tuple[list[str], list[str]]:
        """Take a report in; ``(vanished, orphans)``.

        ``vanished``: placed requests a report named held (``Placed.listed``) that the
        worker no longer holds without having reported them finished (dropped, or their
        notice lost): the caller resumes them from their output (or forgets them if it is
        complete). ``orphans``: requests the worker
        holds that were not placed there. Requests reported finished stay placed, owed
        nothing, until the caller sees their final write in Redis.

        A whole report is checked against every placed request; a delta
        (``holdings_delta``) against the requests it names, so its cost is what changed,
        and its orphans are the requests it names as newly held. ``now``: the clock
        ``last_report_at`` is on (default ``time.monotonic()``).
        """
        self.last_report_at = time.monotonic() if now is None else now
        placed, delta = self.placed, report.holdings_delta
        # What the checked requests are owed is taken out here and put back once they are updated.
        if delta:
            checked = {rid for ids in (report.finished_request_ids, report.released_request_ids,
                                       report.request_ids, report.blocks_per_request) for rid in ids if rid in placed}
            self.num_owed_blocks_total -= sum(self.num_owed_blocks(rid, placed[rid]) for rid in checked)
        else:
            checked = list(placed)
            self.num_owed_blocks_total = 0  # recounted whole
        self._take(report)
        self._mark_finished(report.finished_request_ids)
        held = self.held
        vanished = []
        for rid in checked:
            pl = placed[rid]
            if pl.finished:
                continue
            num_blocks = held.get(rid)
            if num_blocks is None:
                if pl.listed:
                    vanished.append(rid)
                continue
            pl.listed = True
            if num_blocks > 0:
                pl.reflected = True
        self.num_owed_blocks_total += sum(self.num_owed_blocks(rid, placed[rid]) for rid in checked)
        return vanished, [rid for rid in report.request_ids if rid not in placed] if delta else self.orphans()

    def _mark_finished(self, request_ids) -> None:
        for rid in request_ids:
            pl = self.placed.get(rid)
            if pl is not None:
                pl.finished = True

    def orphans(self) -> list[str]:
        """Requests the worker holds that were not placed there."""
        return [rid for rid in self.held if rid not in self.placed]

    def full_report(self) -> cluster_pb2.OccupancyReport | None:
        """The latest report with every request held (a delta filled in from ``held``)."""
        r = self.report
        if r is None or not r.holdings_delta:
            return r
        full = cluster_pb2.OccupancyReport()
        full.CopyFrom(r)
        full.holdings_delta = False
        del full.request_ids[:]
        del full.released_request_ids[:]
        full.blocks_per_request.clear()
        full.request_ids.extend(self.held)
        full.blocks_per_request.update({rid: n for rid, n in self.held.items() if n > 0})
        return full

    def to_proto(self) -> cluster_pb2.WorkerState:
        return cluster_pb2.WorkerState(
            worker_id=self.worker_id,
            address=self.address,
            report=self.full_report(),
            num_owed_blocks=self.num_owed_blocks_total,
            request_ids=list(self.placed),
            num_assigned=self.num_assigned,
        )


def pick_victims(
    workers: list[WorkerEntry], p: Pending, headroom_tokens: int, cooldown_s: float = 1.0,
    now: float | None = None,
) -> tuple[WorkerEntry, list[Placed]] | None:
    """The worker where preempting the fewest lower-priority running sequences makes room: the
    blocks ``p`` needs, and a seat where all ``max_num_seqs`` are taken.

    Victims go lowest priority first, then most recently placed (least work lost).
    ``now``: the clock ``Placed.preempted_at`` is on (default ``time.monotonic()``).
    """
    now = time.monotonic() if now is None else now
    best: tuple[WorkerEntry, list[Placed]] | None = None
    for w in workers:
        if not w.ready or not w.holds_priority_below(p.priority):
            continue
        if p.num_tokens + p.num_remaining_tokens > w.max_model_len:  # past its context: no preemption makes it fit
            continue
        need = w.blocks_needed(p, headroom_tokens)
        avail = w.num_available_blocks
        candidates = sorted(
            (pl for pl in w.placed.values()
             if pl.pending.priority < p.priority and now - pl.preempted_at > cooldown_s
             and w.held.get(pl.pending.request_id, 0) > 0),
            key=lambda pl: (pl.pending.priority, -pl.placed_at),
        )
        seat_needed = len(w.placed) >= w._limits[1]  # every seat taken: a victim must give one up
        chosen: list[Placed] = []
        for pl in candidates:
            if avail >= need and (chosen or not seat_needed):
                break
            chosen.append(pl)
            rid = pl.pending.request_id
            avail += w.held.get(rid, 0) + w.num_owed_blocks(rid, pl)
        if avail >= need and chosen and (best is None or len(chosen) < len(best[1])):
            best = (w, chosen)
    return best
