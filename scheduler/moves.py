"""KV that moves between workers: the policy, as pure functions over the worker table.

Three reasons to move a request's KV from the worker holding it (the *source*) to another
(the *target*), all decided by the ledger (``ledger.Ledger``) and carried out by its caller:

* ``disaggregation``: the request was prefilled on a worker of role ``prefill``; its KV
  goes to a worker that decodes (role ``decode`` or ``both``). Conditional, as NVIDIA Dynamo
  does it: a prompt of at most ``short_prompt_tokens`` tokens, or one whose prefix a decoding
  worker already caches (at least ``decode_cache_threshold`` of its blocks, by the prefix
  index), is placed on a decoding worker and prefilled there; so is any prompt while no
  prefill worker has room (``local_prefill_when_full``). A prefill worker has room while
  the prompts placed on it and not yet prefilled come to less than ``prefill_queue_tokens``
  (Dynamo's prefill-queue bound: its blocks would admit far more than it can prefill soon).
* ``balance`` (Llumnix): a worker past ``migrate_above`` occupancy sheds its running request
  with the fewest blocks (the cheapest to copy) to the emptiest worker that stays below
  ``migrate_below`` after taking it; off while ``migrate_above`` is None.
* ``preemption``: a victim the round chose (``workers.pick_victims``) goes to a worker that
  can hold it rather than being swapped out or recomputed (``migrate_victims``).
* ``drain``: a worker draining by migration (``pagefleet worker --drain-policy migrate``: its
  reports say ``drain_by_migration``) sheds every request it runs to the decoding worker with
  the most room that can hold it, ``DRAIN_TRANSFERS_PER_SOURCE`` at a time; a request no peer
  has room for stays (it finishes there, or is handed back and recomputed when the drain ends).

A move is a ``Transfer``. While it is in flight the request is **owned by its source only**
(``Ledger.where`` names the source; it goes on running or waiting there), and the target
holds a reservation: the request is on the target's ``placed`` as a request not yet
reflected, so admission counts the blocks it will take. The handover (``transfer_done``)
moves the ownership in one step; a transfer that outlives its deadline (``timeout_s``, a lease
the receiver renews) is taken back from both sides, and the request resumes from its tokens.
Occupancy is ``1 - num_available_blocks / pool_size``: blocks in use, swapped out and owed.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

from .queue import Pending
from .workers import Placed, WorkerEntry

REASONS = ("disaggregation", "balance", "preemption", "drain")
DRAIN_TRANSFERS_PER_SOURCE = 4  # moves in flight out of one draining worker


@dataclass(frozen=True, slots=True)
class MoveConfig:
    short_prompt_tokens: int = 256  # prompts this short prefill on a decoding worker
    decode_cache_threshold: float = 0.5  # a decoding worker caching this share of the prompt's blocks prefills it
    local_prefill_when_full: bool = True  # no prefill worker has room: prefill on a decoding worker
    prefill_queue_tokens: int = 16384  # a prefill worker with this many prompt tokens to prefill takes no more
    migrate_above: float | None = None  # occupancy past which a worker sheds a request (None: no balance moves)
    migrate_below: float = 0.7  # the target's occupancy after taking it must stay below this
    migrate_victims: bool = False  # a preemption victim moves to a worker with room instead
    max_transfers_per_source: int = 1  # moves in flight out of one worker (balance and preemption)
    timeout_s: float = 5.0  # a transfer's lease: renewed by the receiver, else taken back

    def __post_init__(self) -> None:
        if self.prefill_queue_tokens < 1:
            raise ValueError(f"prefill_queue_tokens must be >= 1, got {self.prefill_queue_tokens}")
        if self.short_prompt_tokens < 0:
            raise ValueError(f"short_prompt_tokens must be >= 0, got {self.short_prompt_tokens}")
        if not 0.0 <= self.decode_cache_threshold <= 1.0:
            raise ValueError(f"decode_cache_threshold must be between 0 and 1, got {self.decode_cache_threshold}")
        if self.migrate_above is not None and not 0.0 < self.migrate_below <= self.migrate_above <= 1.0:
            raise ValueError("migration thresholds need 0 < migrate_below <= migrate_above <= 1, got "
                             f"{self.migrate_below} and {self.migrate_above}")
        if self.max_transfers_per_source < 1 or not self.timeout_s > 0:
            raise ValueError("max_transfers_per_source must be >= 1 and timeout_s > 0")


@dataclass(slots=True)
class Transfer:
    """A request's KV on its way from ``source`` to ``target`` (see the module docstring)."""

    pending: Pending
    source: WorkerEntry
    target: WorkerEntry
    reason: str  # one of REASONS
    deadline: float  # on the ledger's clock
    num_blocks: int  # the source's device blocks for it when the move was decided

    @property
    def request_id(self) -> str:
        return self.pending.request_id

    def __repr__(self) -> str:
        return (f"Transfer({self.request_id!r}, {self.source.worker_id} -> {self.target.worker_id}, {self.reason}, "
                f"deadline={self.deadline}, num_blocks={self.num_blocks})")


def decodes(w: WorkerEntry) -> bool:
    return w.role != "prefill"


def prefills(w: WorkerEntry) -> bool:
    return w.role != "decode"


def occupancy(w: WorkerEntry, num_more_blocks: int = 0) -> float:
    """The share of ``w``'s pool in use, swapped out or owed (after ``num_more_blocks`` more)."""
    return 1.0 - (w.num_available_blocks - num_more_blocks) / w.pool_size


def fits_moved(w: WorkerEntry, p: Pending, headroom_tokens: int) -> bool:
    """Whether ``w`` can take ``p``'s KV now (its blocks plus headroom), as admission counts."""
    return w.ready and w.has_room(p.num_tokens + p.num_remaining_tokens, w.blocks_taken(p, headroom_tokens))


def exchanges_kv(a: WorkerEntry, b: WorkerEntry) -> bool:
    """Whether KV can move between ``a`` and ``b``: their pools' blocks mean the same thing (the
    layouts they report are equal; a worker that reports none, an older one, is not refused here:
    its target checks the pairing when they meet)."""
    la, lb = a.kv_layout, b.kv_layout
    return not la or not lb or la == lb


def best_target(workers: Iterable[WorkerEntry], p: Pending, source: WorkerEntry, headroom_tokens: int,
                below: float = 1.0) -> WorkerEntry | None:
    """The decoding worker other than ``source`` with the most room left after taking ``p``,
    if that leaves it below ``below`` occupancy (None if none can), its KV layout ``source``'s."""
    best, best_occ = None, below
    for w in workers:
        if w is source or not decodes(w) or not fits_moved(w, p, headroom_tokens) or not exchanges_kv(source, w):
            continue
        occ = occupancy(w, w.blocks_taken(p, headroom_tokens))
        if occ < best_occ:
            best, best_occ = w, occ
    return best


def movable(w: WorkerEntry, owned: dict[str, str], moving: Container[str]) -> list[Placed]:
    """Requests ``w`` owns and runs with device blocks, not finished and not in ``moving``
    (moving already, or not to be moved now)."""
    wid = w.worker_id
    return [pl for rid, pl in w.placed.items()
            if owned.get(rid) == wid and rid not in moving and not pl.finished and w.held.get(rid, 0) > 0]


def balance_moves(workers: list[WorkerEntry], owned: dict[str, str], moving: Container[str], sending: dict[str, int],
                  cfg: MoveConfig, headroom_tokens: int) -> list[tuple[Placed, WorkerEntry, WorkerEntry]]:
    """Load-balance moves, one at most per overloaded source: ``(request, source, target)``,
    the fullest sources first. ``sending``: transfers in flight by source id. The caller
    records each move before the next is chosen (this only chooses; targets are checked
    against the table as it is)."""
    if cfg.migrate_above is None:
        return []
    out = []
    over = sorted((w for w in workers if w.ready and occupancy(w) > cfg.migrate_above
                   and sending.get(w.worker_id, 0) < cfg.max_transfers_per_source),
                  key=occupancy, reverse=True)
    chosen_targets: set[str] = set()
    for src in over:
        cands = sorted(movable(src, owned, moving), key=lambda pl: (src.held[pl.pending.request_id], -pl.placed_at))
        for pl in cands[:4]:  # the cheapest few: a larger one rarely fits where a smaller did not
            tgt = best_target((w for w in workers if w.worker_id not in chosen_targets), pl.pending, src,
                              headroom_tokens, cfg.migrate_below)
            if tgt is not None:
                out.append((pl, src, tgt))
                chosen_targets.add(tgt.worker_id)
                break
    return out


def drains_by_migration(w: WorkerEntry) -> bool:
    """Whether ``w``'s latest report asks for its requests to be moved away (draining by migration)."""
    r = w.report
    return w.alive and r is not None and r.draining and r.drain_by_migration


def drain_moves(workers: list[WorkerEntry], owned: dict[str, str], moving: Container[str], sending: dict[str, int],
                headroom_tokens: int) -> Iterator[tuple[Placed, WorkerEntry, WorkerEntry]]:
    """Moves off the workers draining by migration: ``(request, source, target)``, the requests
    with the most blocks first (the most to recompute), each to the decoding worker with the most
    room left after taking it; at most ``DRAIN_TRANSFERS_PER_SOURCE`` in flight out of a source
    (``sending``: in flight by source id). One at a time: each target is checked against the
    table as it is when the move is asked for, so the caller records each move (its
    reservation) before it asks for the next, and a target is not promised the same room twice."""
    for src in workers:
        if not drains_by_migration(src):
            continue
        room = DRAIN_TRANSFERS_PER_SOURCE - sending.get(src.worker_id, 0)
        for pl in sorted(movable(src, owned, moving), key=lambda pl: -src.held[pl.pending.request_id]):
            if room <= 0:
                break
            tgt = best_target(workers, pl.pending, src, headroom_tokens)
            if tgt is not None:
                yield pl, src, tgt
                room -= 1
