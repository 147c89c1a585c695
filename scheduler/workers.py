"""The worker table: what each worker last reported, and what was sent since.

Admission: a request fits on a worker when the worker's free blocks, minus the blocks
of its swapped-out sequences (they come back first), minus the blocks still owed to the
requests placed there, cover the request's tokens plus ``headroom_tokens`` of its
expected output. A placed request is owed its own tokens plus headroom: all of it until
a report shows it with device blocks, then whatever it has not grown into yet (so a worker
is not filled past what its running sequences will need a moment later, which would
only turn into preemptions there).

Score (larger wins): **the fraction of the worker's pool still free after placing the
request, minus a small penalty per running sequence** - spread by memory, break ties
towards the less busy worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagefleet.common.blocks import num_blocks_for
from pagefleet.protos import cluster_pb2

from .queue import Pending


@dataclass(slots=True)
class Placed:
    """A request placed on a worker."""

    pending: Pending
    num_reserved_blocks: int  # its tokens plus headroom, set aside at placement (see num_owed_blocks)
    reflected: bool = False  # seen in a report since it was sent
    placed_at: float = field(default_factory=time.monotonic)
    preempted_at: float = 0.0


@dataclass(slots=True)
class WorkerEntry:
    worker_id: str
    address: str
    channel: object = None
    stub: object = None
    report: cluster_pb2.OccupancyReport | None = None
    last_report_at: float = field(default_factory=time.monotonic)
    placed: dict[str, Placed] = field(default_factory=dict)
    num_assigned: int = 0
    alive: bool = True

    # -- the numbers admission uses ---------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.alive and self.report is not None and not self.report.draining

    @property
    def block_size(self) -> int:
        return self.report.block_size if self.report else 16

    def num_owed_blocks(self, rid: str, pl: Placed) -> int:
        """Blocks ``pl`` may still claim on this worker beyond the device blocks it has now."""
        if not pl.reflected:
            return pl.num_reserved_blocks
        num_device_blocks = self.report.blocks_per_request.get(rid, 0) if self.report else 0
        # None after it had some: swapped out (counted as swapped blocks) or queued again
        # inside the worker; either way not growing now.
        return max(0, pl.num_reserved_blocks - num_device_blocks) if num_device_blocks else 0

    @property
    def num_owed_blocks_total(self) -> int:
        """Blocks owed to all the requests placed here."""
        return sum(self.num_owed_blocks(rid, pl) for rid, pl in self.placed.items())

    @property
    def num_available_blocks(self) -> int:
        r = self.report
        if r is None:
            return 0
        return r.num_free_blocks - r.num_swapped_blocks - self.num_owed_blocks_total

    def blocks_needed(self, p: Pending, headroom_tokens: int) -> int:
        return num_blocks_for(p.num_tokens + min(p.num_remaining_tokens, headroom_tokens), self.block_size)

    def fits(self, p: Pending, headroom_tokens: int) -> bool:
        r = self.report
        if not self.ready or p.num_tokens + p.num_remaining_tokens > r.max_model_len:
            return False
        if len(self.placed) >= r.max_num_seqs:
            return False
        return self.blocks_needed(p, headroom_tokens) <= self.num_available_blocks

    def score(self, p: Pending, headroom_tokens: int) -> float:
        r = self.report
        left = self.num_available_blocks - self.blocks_needed(p, headroom_tokens)
        return left / max(1, r.num_blocks) - 0.01 * r.num_running

    # -- bookkeeping ---------------------------------------------------------------------
    def place(self, p: Pending, headroom_tokens: int) -> None:
        self.placed[p.request_id] = Placed(p, self.blocks_needed(p, headroom_tokens))
        self.num_assigned += 1

    def apply_report(self, report: cluster_pb2.OccupancyReport) -> tuple[list[str], list[str]]:
        """Take a report in; ``(finished, orphans)``: placed requests that are done, and
        requests the worker holds that were not placed there."""
        self.report = report
        self.last_report_at = time.monotonic()
        reported_ids = set(report.request_ids)
        finished = [rid for rid in report.finished_request_ids if rid in self.placed]
        for rid in finished:
            del self.placed[rid]
        for rid, pl in list(self.placed.items()):
            if rid in reported_ids:
                if report.blocks_per_request.get(rid, 0) > 0:
                    pl.reflected = True
            elif pl.reflected:  # it was there and is gone: finished, its notice lost
                del self.placed[rid]
                finished.append(rid)
        orphans = [rid for rid in reported_ids if rid not in self.placed]
        return finished, orphans

    def to_proto(self) -> cluster_pb2.WorkerState:
        return cluster_pb2.WorkerState(
            worker_id=self.worker_id,
            address=self.address,
            report=self.report,
            num_owed_blocks=self.num_owed_blocks_total,
            request_ids=list(self.placed),
            num_assigned=self.num_assigned,
        )


def pick_worker(workers: list[WorkerEntry], p: Pending, headroom_tokens: int) -> WorkerEntry | None:
    """The worker with the best score among those that fit; None if none fits."""
    fitting = [w for w in workers if w.fits(p, headroom_tokens)]
    if not fitting:
        return None
    return max(fitting, key=lambda w: w.score(p, headroom_tokens))


def pick_victims(
    workers: list[WorkerEntry], p: Pending, headroom_tokens: int, cooldown_s: float = 1.0
) -> tuple[WorkerEntry, list[Placed]] | None:
    """The worker where preempting the fewest lower-priority running sequences makes room.

    Victims go lowest priority first, then most recently placed (least work lost).
    """
    now = time.monotonic()
    best: tuple[WorkerEntry, list[Placed]] | None = None
    for w in workers:
        if not w.ready:
            continue
        need = w.blocks_needed(p, headroom_tokens)
        avail = w.num_available_blocks
        candidates = sorted(
            (pl for pl in w.placed.values()
             if pl.pending.priority < p.priority and now - pl.preempted_at > cooldown_s
             and w.report.blocks_per_request.get(pl.pending.request_id, 0) > 0),
            key=lambda pl: (pl.pending.priority, -pl.placed_at),
        )
        chosen: list[Placed] = []
        for pl in candidates:
            if avail >= need:
                break
            chosen.append(pl)
            rid = pl.pending.request_id
            avail += w.report.blocks_per_request.get(rid, 0) + w.num_owed_blocks(rid, pl)
        if avail >= need and chosen and (best is None or len(chosen) < len(best[1])):
            best = (w, chosen)
    return best
