"""A step's write as the worker encodes it: rows of columns for the common messages, a message
each for those with logprobs, and finals; read back by ``messages`` in the order written."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.common.fencing import entry_of, outputs_of, step_piece
from pagefleet.common.redis import OutEntry
from pagefleet.common.step_write import Row, StepEncoder, StepWrite, messages
from pagefleet.protos import cluster_pb2
from pagefleet.protos import generation_pb2 as pb


def _read(raw: bytes) -> list[tuple]:
    return [(o.request_id, o.index, list(o.token_ids), o.text, o.finish_reason, len(o.logprobs))
            for o in messages(cluster_pb2.StepOutputs.FromString(raw))]


def _lp(token: int) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=token, logprob=-0.5)])


def test_common_messages_are_rows_and_those_with_logprobs_messages():
    enc = StepEncoder()
    enc.add("o:g1", "a", 0, [5, 6], "xy")
    enc.add("o:g1", "b", 3, [9], "")  # no text yet (a character not complete): still a row
    enc.add("o:g1", "c", 1, [7], "q", [_lp(7)])
    enc.add("o:g2", "d", 0, [8], "z")
    step = enc.build()
    assert step.num_messages == 4 and set(step.fields) == {"o:g1", "o:g2"}
    g1 = cluster_pb2.StepOutputs.FromString(step.fields["o:g1"])
    assert list(g1.column_request_ids) == ["a", "b"] and list(g1.column_num_tokens) == [2, 1]
    assert [o.request_id for o in g1.outputs] == ["c"]
    assert _read(step.fields["o:g1"]) == [("a", 0, [5, 6], "xy", "", 0), ("b", 3, [9], "", "", 0),
                                          ("c", 1, [7], "q", "", 1)]
    assert _read(step.fields["o:g2"]) == [("d", 0, [8], "z", "", 0)]
    assert step.request_ids() == {"a", "b", "c", "d"}
    alone = step.split()  # one write a request, each a message as written (a row becomes one)
    assert {rid: _read(w.fields[next(iter(w.fields))]) for rid, w in alone.items()} == {
        "a": [("a", 0, [5, 6], "xy", "", 0)], "b": [("b", 3, [9], "", "", 0)],
        "c": [("c", 1, [7], "q", "", 1)], "d": [("d", 0, [8], "z", "", 0)]}
    row = next(o for o in messages(g1) if isinstance(o, Row))
    assert entry_of(row) == OutEntry(0, [5, 6], "xy")  # as a message of outputs reads


def test_pieces_concatenated_stay_aligned_and_a_final_comes_after_the_rows():
    """Steps coalesced (``StepWrite.extend``) and a final appended by the finish script are
    byte concatenations: every row keeps its tokens and text, each request's in order."""
    first, second = StepEncoder(), StepEncoder()
    first.add("o", "a", 0, [1, 2], "ab")
    first.add("o", "b", 0, [3], "c")
    second.add("o", "a", 2, [4], "d")
    second.add("o", "b", 1, [5, 6, 7], "efg")
    write = first.build()
    write.extend(second.build())
    raw = write.fields["o"] + step_piece("a", OutEntry(3, [8], "h", "stop"))
    assert _read(raw) == [("a", 0, [1, 2], "ab", "", 0), ("b", 0, [3], "c", "", 0), ("a", 2, [4], "d", "", 0),
                          ("b", 1, [5, 6, 7], "efg", "", 0), ("a", 3, [8], "h", "stop", 0)]
    assert [o.request_id for o in outputs_of({b"o": raw, b"x": b"ignored"})] == ["a", "b", "a", "b", "a"]
    assert StepWrite().request_ids() == set() and StepEncoder().build() is None


def test_the_gateways_reader_feeds_each_relay_its_rows_and_messages_in_order():
    from pagefleet.gateway.relay import StepReader, StepRelay

    async def go():
        reader = StepReader.__new__(StepReader)
        loop = asyncio.get_running_loop()
        reader.relays = {rid: StepRelay(rid, loop, set()) for rid in ("a", "b")}
        enc = StepEncoder()
        enc.add("o", "a", 0, [1, 2], "ab")
        enc.add("o", "zz", 0, [9], "?")  # another process's request: not relayed here
        enc.add("o", "b", 0, [3], "c", [_lp(3)])
        enc.add("o", "a", 2, [4], "d")
        reader._dispatch(enc.build().fields["o"])
        reader._dispatch(step_piece("a", OutEntry(3, [5], "e", "length")))
        a, b = reader.relays["a"].take(), reader.relays["b"].take()
        assert (a.index, list(a.token_ids), a.text, a.finish_reason) == (0, [1, 2, 4, 5], "abde",
                                                                      pb.FINISH_REASON_LENGTH)
        assert (list(b.token_ids), b.text, [x.logprob for x in b.logprobs]) == ([3], "c", [-0.5])
        # A later row before an earlier one (an old worker's write landing late): held, then in order.
        c = reader.relays["c"] = StepRelay("c", loop, set())
        late, early = StepEncoder(), StepEncoder()
        late.add("o", "c", 2, [7], "g")
        early.add("o", "c", 0, [5, 6], "ef")
        reader._dispatch(late.build().fields["o"])
        assert c.take() is None
        reader._dispatch(early.build().fields["o"])
        reader._dispatch(early.build().fields["o"])  # a repeat (a retried write): dropped
        got = c.take()
        assert (got.index, list(got.token_ids), got.text) == (0, [5, 6, 7], "efg")

    asyncio.run(go())


def test_a_request_that_asked_for_logprobs_never_writes_rows_and_an_abort_after_rows_ends_it():
    """The engine loop's encoding of real deltas: a request with logprobs is all messages, one
    without all rows; a coalesced write whose last piece is a zero-token abort final ends the
    relay after the rows before it."""
    from pagefleet.common.sampling_params import SamplingParams
    from pagefleet.worker.engine_loop import EngineLoop
    from pagefleet.worker.sim import SimEngine

    engine = SimEngine(time_scale=float("inf"), max_num_seqs=4)
    loop = EngineLoop(engine, emit=lambda b: None, notify=lambda: None)
    engine.add_request([65, 66, 67], SamplingParams(max_tokens=6, logprobs=2, seed=1), request_id="lp")
    engine.add_request([65, 66, 68], SamplingParams(max_tokens=6, seed=2), request_id="plain")
    written = None
    while engine.has_unfinished_requests():
        step = loop._encode(engine.step())
        if step is not None and step.fields:
            if written is None:
                written = step
            else:
                written.extend(step)
    got = cluster_pb2.StepOutputs.FromString(written.fields["o"])
    assert set(got.column_request_ids) == {"plain"} and {o.request_id for o in got.outputs} == {"lp"}
    assert all(len(o.logprobs) == len(o.token_ids) > 0 for o in got.outputs)

    from pagefleet.gateway.relay import StepReader, StepRelay

    async def go():
        reader = StepReader.__new__(StepReader)
        r = StepRelay("plain", asyncio.get_running_loop(), set())
        reader.relays = {"plain": r}
        n = len([i for i in got.column_request_ids if i == "plain"])
        reader._dispatch(written.fields["o"] + step_piece("plain", OutEntry(n, [], "", "abort")))
        msg = r.take()
        assert msg.finish_reason == pb.FINISH_REASON_ABORT and len(msg.token_ids) == n

    asyncio.run(go())


def test_columns_that_do_not_align_are_refused_by_name():
    bad = cluster_pb2.StepOutputs(column_request_ids=["a"], column_indices=[0], column_num_tokens=[2],
                                  column_token_ids=[1], column_texts=["x"])
    with pytest.raises(ValueError, match="token counts add up to 2, its token ids are 1"):
        messages(bad)
    short = cluster_pb2.StepOutputs(column_request_ids=["a", "b"], column_indices=[0], column_num_tokens=[1],
                                    column_token_ids=[1], column_texts=["x"])
    with pytest.raises(ValueError, match="do not align: 2 request ids, 1 indices"):
        messages(short)
