"""One write of a worker's steps stream, encoded: what the writer sends, built where the tokens are.

A ``StepWrite`` carries a step's messages already serialized: the steps entry's fields (one
``StepOutputs`` each, ``steps_field``), the messages that finish requests (``Final``: what the
finish script needs of each), the requests whose owner record's TTL is renewed with it, and
the requests whose first message in the stream it holds (the stream is never trimmed past
those while they run). A worker's engine thread builds it straight from the step's deltas
(``StepEncoder``), so the event loop only sends bytes; steps that wait are coalesced with
``extend`` (serialized ``StepOutputs`` concatenate: the pieces of a repeated field).

A step's messages that finish nothing and carry no logprobs (most of them) are written as the
``StepOutputs``' columns (a few arrays for the whole step: ``Row`` reads one back), the others as
its ``outputs`` (a message each). ``messages`` reads both.

Nothing here is per token on the writer's side: ``request_ids`` and ``split`` decode the fields
again, for the failure paths only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.protos import cluster_pb2, generation_pb2


class Row:
    """One message of a ``StepOutputs``' columns, read as a ``StepOutput`` is: it finishes
    nothing and carries no logprobs."""

    __slots__ = ("index", "request_id", "text", "token_ids")
    finish_reason = ""
    error = ""
    logprobs = ()

    def __init__(self, request_id: str, index: int, token_ids: list[int], text: str) -> None:
        self.request_id, self.index, self.token_ids, self.text = request_id, index, token_ids, text


def check_columns(steps) -> list[int]:
    """``steps``' (a ``StepOutputs``) token ids column, once its columns are checked to align
    (``ValueError`` naming what does not: an entry not written as ``StepEncoder`` writes)."""
    ids = list(steps.column_token_ids)
    n = len(steps.column_request_ids)
    if not (len(steps.column_indices) == len(steps.column_num_tokens) == len(steps.column_texts) == n):
        raise ValueError(f"a StepOutputs' columns do not align: {n} request ids, {len(steps.column_indices)} "
                         f"indices, {len(steps.column_num_tokens)} token counts, {len(steps.column_texts)} texts")
    if sum(steps.column_num_tokens) != len(ids):
        raise ValueError(f"a StepOutputs' token counts add up to {sum(steps.column_num_tokens)}, "
                         f"its token ids are {len(ids)}")
    return ids


def row_fields(steps):
    """``(request id, index, token ids, text)`` of each row of ``steps``' (a ``StepOutputs``)
    columns, in order: no object a message (``ValueError`` if its columns do not align)."""
    ids, at = check_columns(steps), 0
    for rid, index, k, text in zip(steps.column_request_ids, steps.column_indices, steps.column_num_tokens,
                                   steps.column_texts, strict=True):
        yield rid, index, ids[at:at + k], text
        at += k


def rows(steps) -> list[Row]:
    """The messages of ``steps``' columns as ``Row``s, in order."""
    return [Row(*fields) for fields in row_fields(steps)]


def messages(steps) -> list:
    """Every message of ``steps`` (a ``StepOutputs``): its columns' rows (``Row``), then its
    ``outputs`` (``StepOutput``); each request's in the order written."""
    return [*rows(steps), *steps.outputs] if steps.column_request_ids else list(steps.outputs)


@dataclass(slots=True)
class Final:
    """A request's last message, encoded: it is appended and the request finished only if
    ``epoch`` is still the request's (the finish script). ``entry_id``: its entry in the
    requests stream, to acknowledge; ``piece``: the message, ``record``: everything its writer
    wrote for it (kept for a retry's replay), each a one-message ``StepOutputs``."""

    request_id: str
    epoch: int
    entry_id: str
    finish_reason: str
    field: str
    piece: bytes
    record: bytes


@dataclass(slots=True)
class StepWrite:
    """Messages for one write (see the module docstring). ``fields``: steps entry field ->
    serialized ``StepOutputs`` of the messages that finish nothing; ``refresh``: request ids
    whose owner record's TTL is renewed; ``first``: request ids whose first message in this
    stream is here; ``num_messages``: every message, finals included (the writer's bound)."""

    fields: dict[str, bytes] = field(default_factory=dict)
    finals: list[Final] = field(default_factory=list)
    refresh: list[str] = field(default_factory=list)
    first: list[str] = field(default_factory=list)
    num_messages: int = 0

    def extend(self, other: StepWrite) -> None:
        """Append ``other``'s messages (a later step's) to this write."""
        fields = self.fields
        for name, raw in other.fields.items():
            fields[name] = fields[name] + raw if name in fields else raw
        self.finals += other.finals
        self.refresh += other.refresh
        self.first += other.first
        self.num_messages += other.num_messages

    def request_ids(self) -> set[str]:
        """Every request with a message here (decodes the fields)."""
        ids = {f.request_id for f in self.finals}
        for raw in self.fields.values():
            ids.update(o.request_id for o in messages(cluster_pb2.StepOutputs.FromString(raw)))
        return ids

    def split(self) -> dict[str, StepWrite]:
        """This write as one write per request, in order (decodes the fields; a row becomes a
        message of ``outputs``)."""
        out: dict[str, StepWrite] = {}
        for name, raw in self.fields.items():
            for o in messages(cluster_pb2.StepOutputs.FromString(raw)):
                w = out.setdefault(o.request_id, StepWrite())
                one = (piece(o.request_id, o.index, o.token_ids, o.text) if isinstance(o, Row) else
                       cluster_pb2.StepOutputs(outputs=[o]).SerializeToString())
                w.fields[name] = w.fields.get(name, b"") + one
                w.num_messages += 1
        for f in self.finals:
            w = out.setdefault(f.request_id, StepWrite())
            w.finals.append(f)
            w.num_messages += 1
        for rid in self.refresh:
            out.setdefault(rid, StepWrite()).refresh.append(rid)
        for rid in self.first:
            out.setdefault(rid, StepWrite()).first.append(rid)
        return out


def set_output(o, request_id: str, index: int, token_ids, text: str, finish_reason: str = "",
               error: str = "", logprobs=None, text_lengths=None, stop: str | int | None = None) -> None:
    """Fill ``o``, a new ``StepOutput``: its fields set one by one, the empty ones not at all
    (0.7 µs, against 1.2 for ``add(**fields)``; built in place, as appending a built one copies)."""
    o.request_id = request_id
    o.index = index
    o.token_ids.extend(token_ids)
    if text:
        o.text = text
    if finish_reason:
        o.finish_reason = finish_reason
    if error:
        o.error = error
    if logprobs:
        add_logprobs(o, logprobs)
    if text_lengths:
        o.text_lengths.extend(text_lengths)
    if stop is not None:
        set_stop(o, stop)


def set_stop(o, stop: str | int) -> None:
    """What ended a request (a ``StepOutput``'s or ``GenerateResponse``'s ``stop_reason``): the
    stop string, or the stop token's id."""
    if isinstance(stop, str):
        o.stop_string = stop
    else:
        o.stop_token_id = stop


def stop_of(o) -> str | int | None:
    """The stop string or stop token id that ended a message's request (an ``OutEntry``, a
    ``StepOutput`` or a ``GenerateResponse``), None if none did (or a row, which ends nothing)."""
    which = getattr(o, "WhichOneof", None)
    if which is None:  # an OutEntry (a row has no stop either)
        return getattr(o, "stop", None)
    kind = which("stop_reason")
    return getattr(o, kind) if kind else None


def add_logprobs(o, logprobs) -> None:
    """Append ``logprobs`` (``TokenLogprobs``, ours or protobuf's) to ``StepOutput`` ``o``."""
    o.logprobs.extend(
        x if isinstance(x, generation_pb2.TokenLogprobs) else generation_pb2.TokenLogprobs(
            logprob=x.logprob,
            top_logprobs=[generation_pb2.TopLogprob(token_id=t, logprob=v)
                          for t, v in zip(x.top_token_ids, x.top_logprobs, strict=True)])
        for x in logprobs)


def piece(request_id: str, index: int, token_ids, text: str = "", finish_reason: str = "", error: str = "",
          logprobs=None, text_lengths=None, stop: str | int | None = None) -> bytes:
    """One message as a one-message ``StepOutputs`` (pieces concatenated: the StepOutputs of all)."""
    steps = cluster_pb2.StepOutputs()
    set_output(steps.outputs.add(), request_id, index, token_ids, text, finish_reason, error, logprobs, text_lengths,
               stop)
    return steps.SerializeToString()


class StepEncoder:
    """Builds one ``StepWrite``: ``add`` each message that finishes nothing, ``finish`` each
    last one, then ``build``. Not thread-safe: one step, one thread."""

    __slots__ = ("_columns", "_outputs", "finals", "first", "num_messages", "refresh")

    def __init__(self) -> None:
        self._outputs: dict[str, object] = {}  # field -> its StepOutputs (messages with logprobs)
        self._columns: dict[str, tuple[list, list, list, list, list]] = {}  # field -> its columns
        self.finals: list[Final] = []
        self.refresh: list[str] = []
        self.first: list[str] = []
        self.num_messages = 0

    def add(self, field_name: str, request_id: str, index: int, token_ids, text: str, logprobs=None) -> None:
        """A message that finishes nothing: a row of its field's columns, or (with logprobs) a
        message of its ``outputs``. A request's messages are all one or all the other (every
        message that finishes nothing has tokens, and a request that asked for logprobs has
        them for each), so its rows keep their order; its last one (``finish``) comes after
        them. Readers place messages by index anyway (the gateway's ``Reorder``)."""
        self.num_messages += 1
        if logprobs:
            outs = self._outputs.get(field_name)
            if outs is None:
                outs = self._outputs[field_name] = cluster_pb2.StepOutputs()
            set_output(outs.outputs.add(), request_id, index, token_ids, text, logprobs=logprobs)
            return
        cols = self._columns.get(field_name)  # a row: this runs for (nearly) every token
        if cols is None:
            cols = self._columns[field_name] = ([], [], [], [], [])
        cols[0].append(request_id)
        cols[1].append(index)
        cols[2].append(len(token_ids))
        cols[3].extend(token_ids)
        cols[4].append(text)

    def finish(self, final: Final) -> None:
        self.finals.append(final)
        self.num_messages += 1

    def build(self) -> StepWrite | None:
        """The write (None if it has no message)."""
        if not self.num_messages:
            return None
        fields = {f: outs.SerializeToString() for f, outs in self._outputs.items()}
        for f, (rids, indices, counts, ids, texts) in self._columns.items():  # rows, then the messages
            cols = cluster_pb2.StepOutputs(column_request_ids=rids, column_indices=indices, column_num_tokens=counts,
                                           column_token_ids=ids, column_texts=texts)
            fields[f] = cols.SerializeToString() + fields.get(f, b"")  # serialized StepOutputs concatenate
        return StepWrite(fields, self.finals, self.refresh, self.first, self.num_messages)
