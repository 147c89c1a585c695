"""Live migration of one request between two engines: Llumnix's multi-stage copy.

The source keeps decoding while the receiver reads the request's full blocks (their K/V
never change again); each stage reads what filled since the previous one. Once fewer
than ``final_stage_blocks`` blocks are left, the source freezes the request (the only
downtime), the receiver reads the rest (the partly filled last block included), checks
it, and takes the request over; only then does the source free its blocks. A migration
that still has ``final_stage_blocks`` or more to read after ``max_stages`` stages gives
up (the request never stopped: nothing was lost). ``max_stages=0`` is the blocking
stop-and-copy (freeze first, read everything), kept to measure against.

Contracts:

* The receiver allocates before the source frees: ``MigrationReceiver.read`` allocates
  the blocks a stage lands in (or answers None: no room, the migration gives up), and the
  source releases the request only after ``commit`` succeeded.
* The receiver looks the prompt's full blocks up in its prefix cache first; those it holds
  are not read again.
* Every migration has a deadline, and the receiver holds a lease it renews at every poll;
  past either, both sides reclaim their blocks (``abort``): the receiver's reservation is
  freed, the source thaws the request (or, if the source is gone, the scheduler resumes it
  from its tokens elsewhere). ``MigrationStats.num_expired`` counts these.
* ``commit`` takes the request over only when every read is ``DONE`` and the final
  stage's blocks match the source's checksums; the request's tokens, sampling settings
  (the seed: a draw depends on (seed, position) only) and its place travel in ``Handover``.
* Who owns the request in the cluster moves by fencing epoch (``common/fencing.py``): the
  receiver's take-over bumps the epoch before it writes; the source's writes after that
  are refused, so there is always exactly one writer.
* The source never waits long on its receiver: ``advance()`` runs on the source engine's
  thread between its steps, and a receiver in another process answers in its own time (a
  target frozen or slow must not stop every other request of the source). A receiver may
  answer ``poll`` with ``"PROC"`` and ``commit`` with None while its call is unanswered, and
  says so in ``waiting``; the final stage then goes on after the source's next step once
  ``final_wait_s`` passed without an answer. A commit in flight is always waited out (its
  call's own timeout bounds it): until it is answered, who owns the request is not known.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from pagefleet.common.sampling_params import SamplingParams

from .kv_transfer import KVTransport, Transfer

if TYPE_CHECKING:
    from .engine import Engine

log = structlog.get_logger("worker.migration")

FINAL_STAGE_BLOCKS = 16  # Llumnix: the last stage starts below 16 blocks
MAX_STAGES = 3  # ... and it gives up past 3 stages
DEADLINE_S = 30.0
LEASE_S = 5.0
# How long the final stage waits on an unanswered receiver before the source's next step.
FINAL_WAIT_S = 0.005
# What a receiver in another process raises once it is gone.
PEER_GONE = (ConnectionError, EOFError, OSError)


def checksums(cache: torch.Tensor, block_ids: list[int]) -> list[int]:
    """CRC-32 of each block's bytes over every layer, keys and values."""
    out = []
    for b in block_ids:
        data = cache[:, :, b].contiguous().view(torch.uint8).numpy()
        out.append(zlib.crc32(data))
    return out


@dataclass(slots=True)
class Handover:
    """The final stage's control message: what the receiver needs to run the request on."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    priority: int
    num_computed_tokens: int
    final_block_ids: list[int]  # the source's blocks read in the final stage
    final_checksums: list[int]


@dataclass(slots=True)
class Lease:
    """A deadline for the whole migration and a lease the receiver renews."""

    deadline: float
    lease_s: float
    expires: float = 0.0

    @classmethod
    def start(cls, deadline_s: float = DEADLINE_S, lease_s: float = LEASE_S, now: float | None = None) -> Lease:
        if deadline_s <= 0 or lease_s <= 0:
            raise ValueError(f"deadline_s and lease_s must be > 0, got {deadline_s}, {lease_s}")
        now = time.monotonic() if now is None else now
        return cls(now + deadline_s, lease_s, now + lease_s)

    def renew(self, now: float | None = None) -> None:
        self.expires = (time.monotonic() if now is None else now) + self.lease_s

    def expired(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now >= self.deadline or now >= self.expires


class MigrationReceiver:
    """The receiving side of one migration, on the receiving engine's loop.

    Its blocks sit in the engine's KV manager under the request id, outside every queue,
    until ``commit`` runs the request or ``abort`` frees them.
    """

    def __init__(self, engine: Engine, transport: KVTransport, peer: str, request_id: str,
                 prompt_token_ids: list[int], *, lease: Lease | None = None) -> None:
        if request_id in engine.requests or request_id in engine.kv.block_tables:
            raise ValueError(f"request_id {request_id!r} is already on this engine")
        self.engine, self.transport, self.peer, self.request_id = engine, transport, peer, request_id
        self.lease = lease or Lease.start()  # renewed by every call of the source's
        self.transfers: list[Transfer] = []
        self.num_blocks = 0  # blocks of the table that hold (or are being read into) K/V
        self.num_cached_blocks = 0  # of those, found in the prefix cache: never read
        self.state = "open"
        kv = engine.kv
        probe = engine._make_request(prompt_token_ids, SamplingParams(max_tokens=1), request_id, 0, None)
        prefix = kv.match_prefix(probe, len(prompt_token_ids) // kv.block_size)
        if prefix.block_ids:
            kv.allocate_slots(request_id, prefix.num_tokens, prefix)  # touches the hits: they stay
            self.num_blocks = self.num_cached_blocks = len(prefix.block_ids)

    def read(self, first: int, remote_block_ids: list[int]) -> int | None:
        """Read the source's blocks ``first, first+1, ...`` of the request (ids
        ``remote_block_ids``); those already here (prefix cache) are skipped. The number of
        blocks read, or None (nothing changed) if the pool cannot hold them."""
        self._check_open()
        if first != self.num_blocks and first > self.num_cached_blocks:
            raise ValueError(f"stage starts at block {first}, expected {self.num_blocks}")
        skip = max(0, self.num_cached_blocks - first)
        remote = list(remote_block_ids[skip:])
        if not remote:
            return 0
        kv, bs = self.engine.kv, self.engine.block_size
        new = kv.allocate_slots(self.request_id, (self.num_blocks + len(remote)) * bs)
        if new is None or len(new) != len(remote):
            return None
        self.transfers.append(self.transport.read(self.peer, remote, new))
        self.num_blocks += len(remote)
        self.lease.renew()
        return len(remote)

    def poll(self) -> str:
        """``"DONE"`` once every read landed, ``"PROC"``, or ``"ERR"``; renews the lease."""
        self._check_open()
        self.transport.progress()
        states = {self.transport.poll(t) for t in self.transfers}
        self.lease.renew()
        return "ERR" if "ERR" in states else "PROC" if "PROC" in states else "DONE"

    def pump(self) -> bool:
        """Move the reads in flight along; True while any is. Without a progress thread a
        read advances only when its reader calls this (or ``poll``): call it in a tight
        loop while it answers True, not once per step (that leaves a read at a few MB/s)."""
        if self.state != "open":
            return False
        self.transport.progress()
        return any(self.transport.poll(t) == "PROC" for t in self.transfers)

    def commit(self, h: Handover) -> bool:
        """Take the request over: True once it runs here. False (and aborted) when a read
        failed, a block is missing, or a final block's checksum differs from the source's."""
        req = self.verify(h)
        if req is None:
            return False
        self.adopt(req)
        return True

    def verify(self, h: Handover):
        """The request ready to run here (not yet running: ``adopt`` runs it), once every read
        landed and the final blocks match the source's checksums; None (and aborted) if not,
        or if the handover is no request this engine can run."""
        self._check_open()
        if h.request_id != self.request_id:
            raise ValueError(f"handover for {h.request_id!r}, migrating {self.request_id!r}")
        kv = self.engine.kv
        table = kv.block_tables.get(self.request_id, [])
        while (state := self.poll()) == "PROC":
            pass
        need = kv.num_blocks_for(h.num_computed_tokens)
        start = need - len(h.final_block_ids)
        read = [i for i in range(start, need) if i >= self.num_cached_blocks]  # not found cached here
        if (state != "DONE" or self.num_blocks != need or len(table) != need
                or checksums(self.engine.kv_cache, [table[i] for i in read])
                != [h.final_checksums[i - start] for i in read]):
            self.abort()
            return None
        try:
            req = self.engine._make_request(h.prompt_token_ids, h.params, h.request_id, h.priority,
                                            h.output_token_ids)
        except ValueError:
            self.abort()
            return None
        req.num_computed_tokens = h.num_computed_tokens
        return req

    def adopt(self, req) -> None:
        """Run ``req`` (from ``verify``) here: the migration is committed."""
        self._check_open()
        self.engine.import_request(req)
        self.state = "committed"

    def expire_if_due(self, now: float | None = None) -> bool:
        """Abort (freeing every block) if the source fell silent past the lease or the
        deadline passed; True if this call aborted. The owner's loop calls it."""
        if self.state != "open" or not self.lease.expired(now):
            return False
        self.abort()
        self.state = "expired"
        return True

    def abort(self) -> None:
        """Free every block of the reservation (idempotent), but never one a read may still
        write: those are set aside for good (``KVCacheManager.set_aside``)."""
        if self.state == "open":
            kv = self.engine.kv
            for t in self.transfers:
                if not self.transport.cancel(t):
                    kv.set_aside(self.request_id, t.local_block_ids)
                    log.error("migration.blocks_set_aside", request_id=self.request_id,
                              num_blocks=len(t.local_block_ids), reason="a cancelled read did not end")
            kv.free(self.request_id)
            self.state = "aborted"

    def _check_open(self) -> None:
        if self.state != "open":
            raise RuntimeError(f"migration of {self.request_id!r} is {self.state}")


class Receiver(Protocol):
    """``MigrationReceiver``'s face to the source (local, or its proxy in another process).
    A proxy whose calls answer later: ``read`` answers the blocks it asked for (the count
    read is settled in ``num_unread`` once known), ``poll`` answers ``"PROC"`` and ``commit``
    None (call again with the same handover) while its call is unanswered, and ``waiting``
    is True while one is; ``abort`` does not wait."""

    def read(self, first: int, remote_block_ids: list[int]) -> int | None: ...
    def poll(self) -> str: ...
    def commit(self, h: Handover) -> bool | None: ...
    def abort(self) -> None: ...


@dataclass(slots=True)
class MigrationStats:
    """What one migration did. ``downtime_steps``: source steps the request missed."""

    outcome: str = "running"  # running | migrated | gave_up | failed | expired
    num_stages: int = 0
    num_blocks_read: int = 0
    num_bytes: int = 0
    downtime_s: float = 0.0  # the request frozen: from the final stage's start to the handover
    stage_blocks: list[int] = field(default_factory=list)


class LiveMigration:
    """The source side of one migration, driven from the source engine's loop: call
    ``advance()`` between steps until it returns something other than ``"running"``.
    ``progress``: the source transport's ``progress`` (called while it waits on reads)."""

    def __init__(self, engine: Engine, request_id: str, receiver: Receiver, *,
                 final_stage_blocks: int = FINAL_STAGE_BLOCKS, max_stages: int = MAX_STAGES,
                 lease: Lease | None = None, progress=None, final_wait_s: float = FINAL_WAIT_S) -> None:
        if final_stage_blocks < 1 or max_stages < 0 or not final_wait_s >= 0:
            raise ValueError(f"final_stage_blocks must be >= 1, max_stages >= 0 and final_wait_s >= 0, got "
                             f"{final_stage_blocks}, {max_stages}, {final_wait_s}")
        if request_id not in engine.requests:
            raise ValueError(f"request {request_id!r} is not on this engine")
        self.engine, self.request_id, self.receiver = engine, request_id, receiver
        self.final_stage_blocks, self.max_stages = final_stage_blocks, max_stages
        self.lease = lease or Lease.start()
        # The source's transport progress (its pool is read: NIXL needs both sides to move).
        self.progress = progress or (lambda: None)
        self.num_sent = 0  # leading blocks handed to the receiver
        self.in_flight = False
        self.frozen = False  # the request is stopped here for the final stage
        # ``final_wait_s``: how long the final stage waits on a receiver that does not answer
        # before it lets the source step (``math.inf``: until it answers or its lease ends).
        self.final_wait_s = final_wait_s
        self._frozen_at = 0.0
        self._final_ids: list[int] = []  # the blocks the final stage reads
        self._handover: Handover | None = None  # built once the final stage landed: committing
        self.stats = MigrationStats()
        # A request preempted here meanwhile (recomputed or swapped out) lost the blocks the
        # stages read: another request may have written them while a read was in flight, and
        # only the final stage's are checked at the handover. The migration then fails.
        self._req = engine.requests[request_id]
        self._num_preemptions = self._req.num_preemptions

    def advance(self) -> str:
        """One move: poll the stage in flight, start the next, or run the final stage."""
        s = self.stats
        if s.outcome != "running":
            return s.outcome
        if self._handover is not None:  # committing: whatever happened here, its answer settles it
            return self._go_final()
        req = self.engine.requests.get(self.request_id)
        # Finished (or aborted) here meanwhile; or another request under its id since (placed
        # here again): its blocks are not the ones read.
        if req is not self._req or req.status.is_finished:
            return self._end("failed")
        if req.num_preemptions != self._num_preemptions:  # its blocks were freed: what was read is stale
            return self._end("failed")
        if self.lease.expired():
            return self._end("expired")
        try:
            if self.frozen:
                return self._go_final()
            return self._advance(req)
        except PEER_GONE:
            return self._end("failed")

    def _advance(self, req) -> str:
        s = self.stats
        if self.in_flight:
            state = self._poll()
            if state == "PROC":
                return "running"
            if state == "ERR":
                return self._end("failed")
            self.in_flight = False
        bs = self.engine.block_size
        table = self.engine.kv.block_tables.get(self.request_id, [])
        stable = min(req.num_computed_tokens // bs, len(table))
        left = stable - self.num_sent
        if left < self.final_stage_blocks or s.num_stages >= self.max_stages:
            if left >= self.final_stage_blocks and self.max_stages:
                return self._end("gave_up")
            return self._final()
        if self._read(table[self.num_sent : stable]) is None:
            return self._end("failed")
        self.in_flight = True
        return "running"

    def run(self, step=None) -> MigrationStats:
        """Advance to the end; ``step()`` (the source's step) runs between moves."""
        while self.advance() == "running":
            if step is not None:
                step()
        return self.stats

    def _final(self) -> str:
        """Freeze the request and start reading what is left of it (``_go_final`` goes on)."""
        engine = self.engine
        req = engine.freeze_request(self.request_id)
        if req is None:  # not running (preempted or swapped meanwhile): try later
            return "running"
        self.frozen, self._frozen_at = True, time.perf_counter()
        table = engine.kv.block_tables[self.request_id]
        end = engine.kv.num_blocks_for(req.num_computed_tokens)
        self._final_ids = table[self.num_sent : end]
        if self._read(self._final_ids) is None:
            return self._end("failed")
        return self._go_final()

    def _go_final(self) -> str:
        """The final stage once frozen: wait for its reads, then commit; ``"running"`` when
        the receiver left its call unanswered ``final_wait_s`` (the source steps meanwhile)."""
        engine, s = self.engine, self.stats
        answered = time.perf_counter()
        try:
            while True:
                if self._handover is None:
                    state = self._poll()
                    if state == "ERR":
                        return self._end("failed")
                    if state == "DONE":
                        req = self._req
                        self._handover = Handover(
                            req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), req.params,
                            req.priority, req.num_computed_tokens, list(self._final_ids),
                            checksums(engine.kv_cache, self._final_ids))
                if self._handover is not None and (ok := self.receiver.commit(self._handover)) is not None:
                    break
                now = time.perf_counter()
                if not getattr(self.receiver, "waiting", False):
                    answered = now
                elif now - answered >= self.final_wait_s:
                    return "running"
                if self._handover is None and self.lease.expired():
                    return self._end("failed")
                time.sleep(0.0005)  # leave the CPU to the reader (a tight loop of polls starves it)
        except PEER_GONE:  # the receiver is gone: the request stays here (fencing settles a late commit)
            ok = False
        s.downtime_s = time.perf_counter() - self._frozen_at
        if not ok:
            return self._end("failed")
        self.frozen = False
        if engine.requests.get(self.request_id) is self._req:  # (not if it ended here meanwhile)
            engine.release_request(self.request_id)  # it lives on there
        self._count_unread()
        s.outcome = "migrated"
        return s.outcome

    def fail(self) -> None:
        """End the migration after an error on this side: the request runs on here, unless
        its commit is in flight: that is waited out (its call's timeout bounds the wait), and
        the target may own it then (``stats.outcome`` says ``migrated``)."""
        if self.stats.outcome != "running":
            return
        if self._handover is not None:
            self.final_wait_s = math.inf
            try:
                self._go_final()
                return
            except Exception:  # (a bug: the request stays here, as for any other failure)
                log.exception("migration.commit_wait_failed", request_id=self.request_id)
        self._end("failed")

    def _read(self, ids: list[int]) -> int | None:
        n = self.receiver.read(self.num_sent, ids)
        if n is None:
            return None
        s = self.stats
        s.num_stages += 1
        s.stage_blocks.append(len(ids))
        s.num_blocks_read += n
        s.num_bytes += n * self._block_bytes()
        self.num_sent += len(ids)
        self.lease.renew()
        return n

    def _poll(self) -> str:
        self.progress()
        state = self.receiver.poll()
        if state != "ERR" and not getattr(self.receiver, "waiting", False):  # an answer, not a call unanswered
            self.lease.renew()
        return state

    def _block_bytes(self) -> int:
        c = self.engine.kv_cache
        return c[:, :, 0].numel() * c.element_size()

    def _end(self, outcome: str) -> str:
        """The migration ends without a handover: the receiver lets go, the request runs on here."""
        with_suppressed(self.receiver.abort)
        self._thaw()
        self._count_unread()
        self.stats.outcome = outcome
        return outcome

    def _thaw(self) -> None:
        if self.frozen:
            self.frozen = False
            if self.engine.requests.get(self.request_id) is self._req:  # (not if it ended here meanwhile)
                self.engine.thaw_request(self.request_id)

    def _count_unread(self) -> None:
        """Blocks a receiver answered later found cached there (never read): not counted."""
        n = getattr(self.receiver, "num_unread", 0)
        if n:
            self.stats.num_blocks_read -= n
            self.stats.num_bytes -= n * self._block_bytes()


def with_suppressed(fn) -> None:
    """Run ``fn``, ignoring a failure (the peer may be gone: its blocks go with it)."""
    with contextlib.suppress(Exception):  # best effort on a path that is already failing
        fn()
