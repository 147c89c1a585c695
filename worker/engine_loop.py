"""The engine's own thread: commands in, steps run, messages and occupancy out.

gRPC handlers never touch the engine: they ``call`` a function that runs on this thread
between two steps and get a ``concurrent.futures.Future``. After every step the loop
hands the step's messages to ``emit``, encoded here straight from the step's deltas (one
``StepWrite``: the steps entry's bytes, the finals; the writer only sends it), and
refreshes ``snapshot`` (``EngineStats``, what the reports carry); ``notify`` is called when
occupancy changed a lot. Every occupancy stream
``subscribe``s to the ids of requests that finish, and to ``kv_events`` (the prefix cache's
keys stored and evicted), so a report carries what changed since the previous one and
nothing older.

Directed preemption (``preempt``) keeps the sequence on this worker, off the device; it
resumes here when room returns.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future

import structlog

from pagefleet.common.fencing import step_piece, steps_field
from pagefleet.common.redis import OutEntry
from pagefleet.common.sampling_proto import from_proto
from pagefleet.common.service import name_os_thread
from pagefleet.common.step_write import Final, StepEncoder, StepWrite
from pagefleet.protos import cluster_pb2

from .kv_events import KVEventLog
from .outputs import EngineStats

log = structlog.get_logger("worker.engine")

_PREEMPT_MODES = {
    cluster_pb2.PREEMPT_MODE_UNSPECIFIED: "auto",
    cluster_pb2.PREEMPT_MODE_AUTO: "auto",
    cluster_pb2.PREEMPT_MODE_SWAP: "swap",
    cluster_pb2.PREEMPT_MODE_RECOMPUTE: "recompute",
}


# A request's owner record in Redis is renewed by every this many of its messages.
TTL_REFRESH_MESSAGES = 512

# The snapshot (``EngineStats``: what the reports carry) is rebuilt after a step when the
# requests held changed, the free blocks moved by a twentieth of the pool, or it is this old;
# a report reads a snapshot at most this much older than it.
SNAPSHOT_MAX_AGE_S = 0.02

# Finished request ids one occupancy stream may fall behind by before the oldest are dropped
# (the scheduler then learns of those from the request ids its reports no longer carry).
MAX_UNREPORTED_FINISHED = 100_000

_UNASSIGNED = ("", 0, "o")


class Held:
    """A request this loop writes for: its assignment (the entry in the Redis requests stream,
    acknowledged with its last write; the epoch its writes are fenced with; the steps entry
    field of its gateway) and the marks of what it wrote here.

    What its final write keeps for a retry's replay (``record``: everything written here since
    its assignment) is read back from the request itself when it is needed: its output token
    ids from ``index`` to ``end``, its detokenizer's ``num_written_pieces`` pieces of text from
    the mark ``num_pieces`` on (a message that finishes nothing carries one piece, or none when
    its text is empty), its logprobs; nothing is copied a token. The marks follow what was
    written, not what the engine made: a step that failed half-way made tokens never written."""

    __slots__ = ("end", "entry_id", "epoch", "field", "index", "num_messages", "num_pieces",
                 "num_written_pieces", "request", "text_lengths")

    def __init__(self, entry_id: str, epoch: int, field: str, request=None) -> None:
        self.entry_id, self.epoch, self.field = entry_id, epoch, field
        self.request = request  # the engine's Request (None: not known, the record is the final message alone)
        self.index = -1  # the index of its first message written here (-1: none yet)
        self.end = 0  # the index after its last message written here
        self.num_messages = 0
        self.num_pieces = request.detokenizer.num_pieces if request is not None else 0
        self.num_written_pieces = 0
        # The characters of text each token written here brought, from ``index`` on (a message's
        # text is its first token's): the record carries them, so a reader may take it from any
        # token on. One C array entry a token, appended as a message is written.
        self.text_lengths = array("I")

    @property
    def assignment(self) -> tuple[str, int, str]:
        return self.entry_id, self.epoch, self.field

    def record(self, last: OutEntry | None = None) -> OutEntry | None:
        """Everything written here, ``last`` (the final message, not written yet) included, as one
        message (None if there is nothing)."""
        req = self.request
        index = self.index if self.index >= 0 else last.index if last is not None else -1
        if req is None or index < 0:
            return last
        end = self.end if self.index >= 0 else index
        text = req.detokenizer.text_since(self.num_pieces, self.num_written_pieces)
        lengths = self.text_lengths.tolist()  # the characters of text each token brought
        finish_reason = error = ""
        stop = None
        if last is not None:
            if last.token_ids:
                end = last.index + len(last.token_ids)
                lengths += [len(last.text)] + [0] * (len(last.token_ids) - 1)
            # (a last message of no token: its text comes after every token, past the lengths' sum)
            text += last.text
            finish_reason, error, stop = last.finish_reason, last.error, last.stop
        if len(lengths) != end - index or sum(lengths) > len(text):
            lengths = []  # not one a token (never seen): the record's text is not cut, as before
        lps = req.output_logprobs
        if lps:
            base = len(req.output_token_ids) - len(lps)  # the output index of lps[0]
            lps = lps[max(0, index - base):end - base] or None
        return OutEntry(index, req.output_token_ids[index:end], text, finish_reason, error, lps or None,
                        lengths or None, stop)


class EngineLoop:
    def __init__(self, engine, emit: Callable[[StepWrite], None], notify: Callable[[], None],
                 observer=None, room: threading.Event | None = None,
                 idle: Callable[[], None] | None = None) -> None:
        """``room``: cleared while the output writer is full; no step runs until it is set again.
        ``idle``: called on this thread while it has no step to run (the writer then reads the
        replies its last steps are owed)."""
        self.engine = engine
        self.observer = observer  # observe.WorkerObserver: metrics and spans
        self.emit = emit
        self.notify = notify
        self.room = room
        self.idle = idle
        # request id -> its assignment and the marks of what it wrote here
        self.held: dict[str, Held] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._paused = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # One queue of finished request ids per occupancy stream (appended on this thread).
        self._subscribers: tuple[collections.deque[str], ...] = ()
        self._subscribers_lock = threading.Lock()
        self.kv_events = KVEventLog(engine.kv)  # published on this thread, in _refresh
        self.snapshot: EngineStats = engine.stats()
        self._snapshot_at = 0.0  # time.monotonic() when it was built
        self._last_notified: tuple[int, frozenset[str]] = (-1, frozenset())
        # request id -> its live migration out of here (migration.LiveMigration), advanced
        # between steps, and the future its stats go to when it ends
        self._migrations: dict[str, tuple[object, Future]] = {}
        # On a worker of role prefill (set by its owner): the requests whose prompt is computed,
        # refreshed with the snapshot, for the reports
        self.track_prefilled = False
        self.prefilled_ids: tuple[str, ...] = ()
        self._refresh(force_notify=True)

    # -- life --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the engine thread between steps."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    @property
    def num_requests(self) -> int:
        """Requests the engine holds (running, waiting or swapped)."""
        return len(self.engine.requests)

    def subscribe(self) -> collections.deque[str]:
        """A queue that receives the id of every request that finishes from now on."""
        q: collections.deque[str] = collections.deque(maxlen=MAX_UNREPORTED_FINISHED)
        with self._subscribers_lock:
            self._subscribers = (*self._subscribers, q)
        return q

    def unsubscribe(self, q: collections.deque[str]) -> None:
        with self._subscribers_lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not q)

    # -- the thread --------------------------------------------------------------------
    def pause(self) -> None:
        """Run no more steps (commands still run): the held requests are being handed back.
        Migrations out of here end first (the requests stay here, to be resumed elsewhere)."""
        self._paused = True
        for rid, (mig, fut) in list(self._migrations.items()):
            mig.fail()  # (a commit in flight is waited out: the target may own the request then)
            del self._migrations[rid]
            if mig.stats.outcome == "migrated":
                self._migrated(rid)
            fut.set_result(mig.stats)
        if self.observer:  # their spans here end: they go on elsewhere
            for rid, req in list(self.engine.requests.items()):
                self.observer.removed(rid, "handed_back", req.num_output_tokens)

    def _run(self) -> None:
        name_os_thread("engine")
        while not self._stop.is_set():
            busy = not self._paused and self.engine.has_unfinished_requests()
            if not busy and self.idle is not None:
                self.idle()
            self._run_commands(block=not busy and not self._migrations)
            if self._stop.is_set():
                break
            if self._migrations:
                self._advance_migrations()
            if self._paused or not self.engine.has_unfinished_requests():
                continue
            if self.room is not None and not self.room.wait(0.05):
                continue  # back-pressure: the writer is full (Redis away); commands still run
            try:
                probe = self.observer.before_step(self.engine) if self.observer else None
                deltas = self.engine.step()
                step = self._encode(deltas)
                if step is not None:
                    self.emit(step)
                rebuilt = self._refresh(after_step=step is None or not step.finals)
                if self.observer:
                    self.observer.after_step(probe, self.engine, deltas, self.snapshot if rebuilt else None)
            except Exception as e:  # a bug must not leave clients waiting forever
                log.exception("engine.step_failed")
                self._fail_all(f"engine step failed: {e}")
                continue
            if not deltas:
                time.sleep(0.001)  # nothing schedulable this step (e.g. waiting for swap-in room)
        if self.observer:
            self.observer.stopped()

    def _run_commands(self, block: bool) -> None:
        if not block and self._commands.empty():  # most steps: nothing queued (no exception raised for it)
            return
        try:
            item = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        if self._refresh() and self.observer and not self.engine.has_unfinished_requests():
            # No step follows to set the gauges (the last requests were cancelled or dropped):
            # they show the engine as it is, not as its last step left it.
            self.observer.metrics.observe_stats(self.snapshot)

    def _encode(self, deltas) -> StepWrite | None:
        """The step's messages as one write (None if it has none); each request's marks (``Held``)
        move past its message (what its final write keeps for a retry's replay is read back to there)."""
        enc = StepEncoder()
        held = self.held
        for d in deltas:
            if d.finish_reason:
                entry = OutEntry(d.index, list(d.token_ids), d.text, d.finish_reason, d.error or "",
                                 logprobs=d.logprobs, stop=d.stop)
                enc.finish(self._final(d.request_id, entry))
                continue
            token_ids, text = d.token_ids, d.text
            if not token_ids and not text:
                continue
            rid = d.request_id
            h = held.get(rid)
            if h is None:
                h = self._hold_unassigned(rid, text)
            if h.index < 0:
                h.index = d.index
                enc.first.append(rid)
            h.end = d.index + len(token_ids)
            if text:
                h.num_written_pieces += 1
            h.text_lengths.append(len(text))
            if len(token_ids) > 1:
                h.text_lengths.extend([0] * (len(token_ids) - 1))  # the others': none
            h.num_messages += 1
            if h.num_messages % TTL_REFRESH_MESSAGES == 0:
                enc.refresh.append(rid)
            enc.add(h.field, rid, d.index, token_ids, text, d.logprobs)
        return enc.build()

    def _hold_unassigned(self, rid: str, text: str) -> Held:
        """A request that writes with no assignment (its engine driven directly, as a bench
        does): held from its first message, which ``text`` is."""
        h = self.held[rid] = Held(*_UNASSIGNED, self.engine.requests.get(rid))
        if text and h.request is not None:
            h.num_pieces -= 1  # the message's text is the detokenizer's last piece
        return h

    def _final(self, rid: str, entry: OutEntry) -> Final:
        """``rid``'s last message, with the record of everything written for it here (it is
        forgotten on this worker from here on)."""
        h = self.held.pop(rid, None)
        if h is None:
            h = Held(*_UNASSIGNED)
        record = h.record(entry)
        self._finished(rid)
        return Final(rid, h.epoch, h.entry_id, entry.finish_reason, h.field, step_piece(rid, entry),
                     step_piece(rid, record))

    def _finished(self, request_id: str) -> None:
        for q in self._subscribers:
            q.append(request_id)

    def _fail_all(self, error: str) -> None:
        batch = []
        for rid in list(self.engine.requests):
            d = self.engine.abort_request(rid)
            index = d.index if d is not None else 0
            batch.append(self._final(rid, OutEntry(index, [], "", "error", error)))
            if self.observer:
                self.observer.removed(rid, "error", index, error)
        self.held.clear()  # a request the failed step finished left the engine unwritten: resumed elsewhere
        if batch:
            self.emit(finals_write(batch))
        self._refresh()

    # -- migrations (migration_rpc.py) ------------------------------------------------------
    def migrate(self, migration) -> Future:
        """Advance ``migration`` (a ``LiveMigration`` of a request here) between steps until it
        ends; a future of its ``MigrationStats``. Run on this thread (``call``)."""
        fut: Future = Future()
        if migration.request_id in self._migrations:
            raise ValueError(f"{migration.request_id!r} is migrating already")
        # Running from the start: a caller that goes away (its Migrate call's deadline, its
        # scheduler gone) cannot cancel it, so the migration ends as migrations end (its lease
        # bounds it) and setting its outcome cannot raise on this thread.
        fut.set_running_or_notify_cancel()
        self._migrations[migration.request_id] = (migration, fut)
        return fut

    def is_migrating(self, request_id: str) -> bool:
        return request_id in self._migrations

    def _advance_migrations(self) -> None:
        for rid, (mig, fut) in list(self._migrations.items()):
            try:
                outcome = mig.advance()
            except Exception as e:  # a bug: the request stays here (thawed), the caller hears of it
                log.exception("migration.failed", request_id=rid)
                mig.fail()  # (a commit in flight is waited out: the target may own the request then)
                del self._migrations[rid]
                if mig.stats.outcome == "migrated":
                    self._migrated(rid)
                    fut.set_result(mig.stats)
                else:
                    fut.set_exception(e)
                continue
            if outcome == "running":
                continue
            del self._migrations[rid]
            if outcome == "migrated":
                self._migrated(rid)
            fut.set_result(mig.stats)
            self._refresh(force_notify=True)

    def _migrated(self, request_id: str) -> None:
        """A migration of ``request_id`` handed it over: forget it here, unless another
        request under its id is here now (the migrated one was aborted here meanwhile)."""
        if request_id not in self.engine.requests:
            self._handed_over(request_id)

    def _handed_over(self, request_id: str) -> None:
        """``request_id`` runs on another worker now (its engine here let it go): forget it,
        writing nothing; not reported finished (the reports show it gone, the scheduler knows why)."""
        self.held.pop(request_id, None)
        if self.observer:
            self.observer.removed(request_id, "migrated")

    def assignment(self, request_id: str) -> tuple[str, int, str]:
        """``request_id``'s (entry id, epoch, steps field); ("", 0, "o") if unassigned."""
        h = self.held.get(request_id)
        return _UNASSIGNED if h is None else h.assignment

    def record_piece(self, request_id: str) -> bytes:
        """Everything this worker wrote for ``request_id`` since its assignment, as one
        ``StepOutputs`` piece (empty if nothing): what a handover records in Redis."""
        h = self.held.get(request_id)
        record = h.record() if h is not None else None
        if record is None or not record.token_ids:
            return b""
        return step_piece(request_id, record)

    def set_epoch(self, request_id: str, epoch: int) -> None:
        """``request_id``'s writes go under ``epoch`` from now on (it took the request back)."""
        h = self.held.get(request_id)
        if h is None:
            h = self.held[request_id] = Held(*_UNASSIGNED, self.engine.requests.get(request_id))
        h.epoch = epoch

    def hold(self, request_id: str, entry_id: str, epoch: int, field: str) -> None:
        """Write for ``request_id`` (in the engine now) under this assignment from its next message
        on; what was held for an earlier run of the same id (one that ended unwritten) is dropped."""
        h = self.held.get(request_id)
        req = self.engine.requests.get(request_id)
        if h is None or h.request is not req:
            self.held[request_id] = Held(entry_id, epoch, field, req)
        else:
            h.entry_id, h.epoch, h.field = entry_id, epoch, field

    def adopt(self, request_id: str, entry_id: str, epoch: int, field: str, assign=None) -> None:
        """A request migrated in (its engine runs it already) is written under ``epoch``;
        ``assign``: an ``AssignRequest`` describing it, for the metrics and traces."""
        self.hold(request_id, entry_id, epoch, field)
        if self.observer and assign is not None:
            self.observer.assigned(assign)
        self._refresh(force_notify=True)

    # -- occupancy -----------------------------------------------------------------------
    def _refresh(self, force_notify: bool = False, after_step: bool = False) -> bool:
        """Rebuild the snapshot (on the engine thread) and notify the reports if it changed
        much; whether it was rebuilt. ``after_step``: called after a step that finished no
        request, so the snapshot is kept unless the requests held, the free blocks or its
        age (``SNAPSHOT_MAX_AGE_S``) say otherwise: building it is O(requests), a step's
        bookkeeping is not."""
        engine = self.engine
        self.kv_events.publish(engine.kv)
        big = max(1, engine.kv.num_blocks // 20)  # free blocks moved this much: the reports hear of it
        last_free, last_ids = self._last_notified
        if (after_step and not force_notify and not self.track_prefilled
                and len(engine.requests) == len(last_ids)
                and abs(engine.kv.num_free_blocks - self.snapshot.num_free_blocks) < big
                and time.monotonic() - self._snapshot_at < SNAPSHOT_MAX_AGE_S):
            return False
        snap = self.snapshot = engine.stats()
        self._snapshot_at = time.monotonic()
        prefilled = self.prefilled_ids
        if self.track_prefilled:
            self.prefilled_ids = tuple(rid for rid, r in engine.requests.items()
                                       if r.num_output_tokens and r.num_computed_tokens >= r.num_tokens - 1)
        ids = frozenset(snap.request_ids)
        # A prefill that ends is reported at once: its transfer starts from the report.
        if (force_notify or ids != last_ids or abs(snap.num_free_blocks - last_free) >= big
                or self.prefilled_ids != prefilled):
            self._last_notified = (snap.num_free_blocks, ids)
            self.notify()
        return True

    # -- commands (run on the engine thread via `call`) -----------------------------------
    def assign(self, msg: cluster_pb2.AssignRequest, parent=None) -> None:
        """``parent``: the trace context of the scheduler's Assign call."""
        rid = msg.request_id
        if rid in self.engine.requests:  # a repeated Assign (the scheduler retried): already here
            entry_id, epoch, _ = self.assignment(rid)
            if msg.epoch > epoch:  # re-placed here while it runs here (it came by migration): write under it
                self.hold(rid, msg.entry_id or entry_id, msg.epoch, steps_field(msg.reply_to))
            return
        try:
            self.engine.add_request(
                list(msg.prompt_token_ids),
                from_proto(msg.sampling),
                request_id=rid,
                priority=msg.priority,
                output_token_ids=list(msg.output_token_ids) or None,
            )
        except Exception as e:  # bad input (ValueError) or a bug: the request fails alone, visibly
            log.warning("request.refused", request_id=rid, error=str(e))
            entry = OutEntry(len(msg.output_token_ids), [], "", "error", str(e))
            p = step_piece(rid, entry)
            self.emit(finals_write([Final(rid, msg.epoch, msg.entry_id, "error", steps_field(msg.reply_to), p, p)]))
            self._finished(rid)
            return
        self.hold(rid, msg.entry_id, msg.epoch, steps_field(msg.reply_to))
        if self.observer:
            self.observer.assigned(msg, parent)
        log.info("request.assigned", request_id=rid, traceparent=msg.traceparent,
                 num_prompt_tokens=len(msg.prompt_token_ids), num_resumed_tokens=len(msg.output_token_ids))

    def cancel(self, request_id: str, notify_client: bool) -> bool:
        d = self.engine.abort_request(request_id)
        if d is None:
            self.held.pop(request_id, None)
            return False
        if self.observer:
            self.observer.removed(request_id, "abort", d.index)
        if notify_client:
            self.emit(finals_write([self._final(request_id, OutEntry(d.index, list(d.token_ids), d.text, "abort"))]))
        else:
            self.held.pop(request_id, None)
        self._finished(request_id)
        log.info("request.cancelled", request_id=request_id, notify_client=notify_client)
        return True

    def drop(self, request_id: str, epoch: int | None = None) -> None:
        """Redis refused a write of ours for ``request_id`` (under ``epoch``; None: whatever it is
        held under): someone newer owns it (it was moved, cancelled or finished by the scheduler).
        Stop at once, free its blocks, write nothing. Not reported finished: the reports show it
        gone unfinished, so a scheduler that still has it placed here (its assignment lost in a
        Redis failover) resumes it. A run of it here under a newer epoch (placed here again
        after the refused one) is not that run: it goes on."""
        h = self.held.get(request_id)
        if epoch is not None and h is not None and h.epoch > epoch:
            log.info("request.refusal_of_an_earlier_run", request_id=request_id, epoch=epoch, now=h.epoch)
            return
        if self.engine.abort_request(request_id) is not None:
            self.held.pop(request_id, None)
            if self.observer:
                self.observer.removed(request_id, "fenced_off")
            log.warning("request.fenced_off", request_id=request_id)

    def drop_all(self) -> None:
        """This worker's steps stream was fenced (it was declared dead): everything it holds is
        being resumed elsewhere. Drop it all at once, writing nothing; none of it finished here
        (the reports then show each gone unfinished: whoever still has it placed here resumes it)."""
        for rid in list(self.engine.requests):
            if self.engine.abort_request(rid) is not None and self.observer:
                self.observer.removed(rid, "fenced_off")
            self.held.pop(rid, None)
        log.warning("worker.fenced_off", num_requests=len(self.engine.requests))

    def fail(self, request_id: str, error: str) -> None:
        """A write for ``request_id`` failed for good: end it with an error, visibly."""
        d = self.engine.abort_request(request_id)
        if d is None:
            self.held.pop(request_id, None)
            return  # gone already (its error message was this write, or it finished)
        if self.observer:
            self.observer.removed(request_id, "error", d.index, error)
        self.emit(finals_write([self._final(request_id, OutEntry(d.index, [], "", "error", error))]))

    def preempt(self, request_id: str, mode: int) -> cluster_pb2.PreemptResponse:
        e = self.engine
        req = e.requests.get(request_id)
        if req is None:
            log.warning("preempt.not_found", request_id=request_id, request_ids=list(e.requests))
            return cluster_pb2.PreemptResponse(outcome=cluster_pb2.PREEMPT_OUTCOME_NOT_FOUND)
        before = len(e.kv.block_tables.get(request_id) or ())  # now: the snapshot may be a step old
        if not e.preempt_request(request_id, mode=_PREEMPT_MODES.get(mode, "auto")):
            return cluster_pb2.PreemptResponse(outcome=cluster_pb2.PREEMPT_OUTCOME_REFUSED)
        self._refresh(force_notify=True)
        after = self.snapshot.blocks_per_request.get(request_id, 0)
        if self.observer:
            self.observer.event(request_id, "preempted", directed=True, num_freed_blocks=max(0, before - after))
        return cluster_pb2.PreemptResponse(
            outcome=cluster_pb2.PREEMPT_OUTCOME_KEPT, num_freed_blocks=max(0, before - after)
        )


def finals_write(finals: list[Final]) -> StepWrite:
    """A write of ``finals`` alone."""
    return StepWrite(finals=finals, num_messages=len(finals))
