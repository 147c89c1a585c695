"""The record a worker's final write keeps for a retry's replay is exactly what it wrote.

The engine loop no longer copies each message into a record as it writes it: the record is
read back from the request (its output token ids, its detokenizer's text since a mark, its
logprobs) when a final or a handover needs it. These tests write real steps of a simulated
engine through ``EngineLoop`` and hold every record against the messages the loop wrote for
that request: finished by length and by a stop string (text held back, then cut), resumed
after tokens made elsewhere, with logprobs, cancelled, failed after a hold-back (the error
carries no text, the record none either), mid-run for a handover, after a step that failed
half-way (its tokens never written), and assigned again after an end that was never written.
"""

from __future__ import annotations

from pagefleet.common.fencing import outputs_of
from pagefleet.common.sampling_params import SamplingParams
from pagefleet.common.sampling_proto import to_proto
from pagefleet.common.step_write import Row, messages
from pagefleet.protos import cluster_pb2
from pagefleet.worker.engine_loop import EngineLoop
from pagefleet.worker.sim import SimEngine

PROMPT = [72, 105, 33, 32]


class Written:
    """Every message the loop emitted, by request, and every final's record."""

    def __init__(self) -> None:
        self.messages: dict[str, list] = {}
        self.records: dict[str, object] = {}

    def __call__(self, step) -> None:
        for o in outputs_of({k.encode(): v for k, v in step.fields.items()}):
            self.messages.setdefault(o.request_id, []).append(o)
        for f in step.finals:
            (o,) = messages(cluster_pb2.StepOutputs.FromString(f.piece))
            self.messages.setdefault(f.request_id, []).append(o)
            (self.records[f.request_id],) = messages(cluster_pb2.StepOutputs.FromString(f.record))


def joined(msgs) -> tuple[int, list[int], str, list[float]]:
    """``msgs`` as one message: first index, token ids, text, the chosen tokens' logprobs."""
    assert [m.index for m in msgs] == sorted(m.index for m in msgs)
    return (msgs[0].index, [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
            [lp.logprob for m in msgs if not isinstance(m, Row) for lp in m.logprobs])


def as_tuple(record) -> tuple[int, list[int], str, list[float]]:
    return record.index, list(record.token_ids), record.text, [lp.logprob for lp in record.logprobs or ()]


def assert_cuts(record, msgs) -> None:
    """A reader that takes the record from any message's first token on gets the text of the
    messages from there on (a client that fell behind reads the rest of its stream from it)."""
    from pagefleet.common.fencing import entry_of

    e = entry_of(record)
    assert e.text_lengths is None or len(e.text_lengths) == len(e.token_ids)
    for m in msgs:
        if m.token_ids:
            want = "".join(x.text for x in msgs if x.index >= m.index)
            assert e.text_from(m.index - e.index) == want, (m.index, want)
            assert e.cut(m.index - e.index).token_ids == [t for x in msgs if x.index >= m.index for t in x.token_ids]


def assign(loop: EngineLoop, rid: str, params: SamplingParams, output_token_ids=(), epoch: int = 1) -> None:
    loop.assign(cluster_pb2.AssignRequest(request_id=rid, entry_id=f"{epoch}-0", prompt_token_ids=PROMPT,
                                          output_token_ids=list(output_token_ids), sampling=to_proto(params),
                                          epoch=epoch, reply_to="g"))


def run(loop: EngineLoop, written: Written, max_steps: int = 10_000, until=None) -> None:
    for _ in range(max_steps):
        if not loop.engine.has_unfinished_requests() or (until is not None and until()):
            return
        step = loop._encode(loop.engine.step())
        if step is not None:
            written(step)


def new_loop() -> tuple[EngineLoop, Written]:
    written = Written()
    return EngineLoop(SimEngine(time_scale=float("inf"), max_num_seqs=8), emit=written, notify=lambda: None), written


def test_every_final_record_is_the_messages_written_for_its_request():
    # The full text of a seeded request first, to pick a stop string that occurs in it.
    loop, written = new_loop()
    assign(loop, "probe", SamplingParams(max_tokens=48, seed=7, ignore_eos=True))
    run(loop, written)
    text = joined(written.messages["probe"])[2]
    stop = text[20:23]
    assert len(stop) == 3

    loop, written = new_loop()
    assign(loop, "length", SamplingParams(max_tokens=40, seed=3, ignore_eos=True))
    assign(loop, "held", SamplingParams(max_tokens=40, seed=4, ignore_eos=True, stop=["\x00\x01\x02\x03"]))
    assign(loop, "stop", SamplingParams(max_tokens=48, seed=7, ignore_eos=True, stop=[stop]))
    assign(loop, "logprobs", SamplingParams(max_tokens=24, seed=5, ignore_eos=True, logprobs=2))
    assign(loop, "resumed", SamplingParams(max_tokens=30, seed=7, ignore_eos=True), output_token_ids=[65, 66, 67])
    run(loop, written)
    assert joined(written.messages["stop"])[2] == text[:text.index(stop)]
    assert written.messages["stop"][-1].finish_reason == "stop"
    assert written.messages["resumed"][0].index == 3
    for rid in ("length", "held", "stop", "logprobs", "resumed"):
        assert as_tuple(written.records[rid]) == joined(written.messages[rid]), rid
        assert written.records[rid].finish_reason == written.messages[rid][-1].finish_reason
        assert_cuts(written.records[rid], written.messages[rid])
    assert len(written.records["logprobs"].logprobs) == 24
    assert loop.held == {}


def test_a_cancel_a_failure_and_a_handover_record_what_was_written():
    loop, written = new_loop()
    held = SamplingParams(max_tokens=200, seed=11, ignore_eos=True, stop=["\x00\x01\x02\x03\x04\x05"])
    for rid in ("cancelled", "failed", "moving", "all"):
        assign(loop, rid, held)
    run(loop, written, until=lambda: len(written.messages.get("all", ())) >= 12)

    # A handover mid-run records what was written so far (the held-back tail not among it).
    from pagefleet.common.fencing import entry_of
    (moving,) = messages(cluster_pb2.StepOutputs.FromString(loop.record_piece("moving")))
    assert as_tuple(entry_of(moving)) == joined(written.messages["moving"])

    loop.cancel("cancelled", notify_client=True)
    loop.fail("failed", "boom")  # its held-back tail is not sent: the record has none of it
    loop._fail_all("stopping")
    for rid in ("cancelled", "failed", "moving", "all"):
        assert as_tuple(written.records[rid]) == joined(written.messages[rid]), rid
        assert_cuts(written.records[rid], written.messages[rid])
    assert written.messages["failed"][-1].error == "boom" and written.records["failed"].error == "boom"
    assert written.messages["cancelled"][-1].finish_reason == "abort"
    assert loop.held == {}


def test_a_request_driven_without_an_assignment_still_records_all_it_wrote():
    loop, written = new_loop()
    loop.engine.add_request(PROMPT, SamplingParams(max_tokens=20, seed=2, ignore_eos=True, stop=["\x00\x01\x02"]),
                            request_id="direct")
    loop.engine.add_request(PROMPT, SamplingParams(max_tokens=20, seed=3, ignore_eos=True), request_id="plain")
    loop.engine.add_request(PROMPT, SamplingParams(max_tokens=1, seed=2), request_id="one")
    run(loop, written)
    assert written.messages["plain"][0].text  # its first message's text is the detokenizer's last piece then
    for rid in ("direct", "plain", "one"):
        assert as_tuple(written.records[rid]) == joined(written.messages[rid]), rid


def test_a_step_that_failed_half_way_records_only_what_was_written():
    """A step made tokens and text that were never written (it raised before its messages were
    encoded): the error finals' records end at the last message written, and a request that the
    step finished (gone from the engine, its final never written) is run afresh when assigned
    again, its record its own."""
    loop, written = new_loop()
    params = SamplingParams(max_tokens=40, seed=9, ignore_eos=True)
    assign(loop, "running", params)
    assign(loop, "short", SamplingParams(max_tokens=6, seed=8, ignore_eos=True))
    run(loop, written, until=lambda: len(written.messages.get("short", ())) == 5)
    lost = loop.engine.step()  # the step that fails: its deltas never reach the writer
    assert {d.request_id for d in lost} == {"running", "short"} and any(d.finish_reason for d in lost)
    loop._fail_all("engine step failed")
    assert as_tuple(written.records["running"]) == joined(written.messages["running"])
    assert written.records["running"].error == "engine step failed"
    assert "short" not in written.records and loop.held == {}

    first_run = len(written.messages["short"])
    assign(loop, "short", SamplingParams(max_tokens=6, seed=8, ignore_eos=True), output_token_ids=[70, 71], epoch=2)
    run(loop, written)
    again = written.messages["short"][first_run:]
    assert as_tuple(written.records["short"]) == joined(again) and written.records["short"].index == 2


def test_an_assignment_after_an_unwritten_end_starts_a_new_record():
    loop, written = new_loop()
    assign(loop, "x", SamplingParams(max_tokens=4, seed=5, ignore_eos=True))
    run(loop, written, until=lambda: len(written.messages.get("x", ())) == 3)
    loop.engine.step()  # x's last token: its final is never written, nor failed (no _fail_all)
    assert "x" not in loop.engine.requests and "x" in loop.held
    first_run = len(written.messages["x"])
    assign(loop, "x", SamplingParams(max_tokens=4, seed=5, ignore_eos=True), output_token_ids=[65, 66, 67], epoch=2)
    run(loop, written)
    again = written.messages["x"][first_run:]
    assert as_tuple(written.records["x"]) == joined(again) == (3, [again[0].token_ids[0]], again[0].text, [])


def test_a_prefill_worker_reports_a_prefill_that_ends_at_once():
    """A prefill worker's report names the requests whose prompts are done (their transfer to a
    decode worker starts from it): the step that ends a prompt notifies the reports, not the next
    heartbeat; a step that changes nothing does not."""
    from pagefleet.common.sampling_params import SamplingParams

    calls: list[int] = []
    engine = SimEngine(time_scale=float("inf"), max_num_seqs=8, max_num_batched_tokens=64)
    loop = EngineLoop(engine, emit=lambda b: None, notify=lambda: calls.append(1))
    loop.track_prefilled = True
    engine.add_request([1 + i % 250 for i in range(400)], SamplingParams(max_tokens=50, ignore_eos=True),
                       request_id="a")
    loop._refresh(after_step=True)
    notified = []
    for _ in range(12):
        before = len(calls)
        engine.step()
        loop._refresh(after_step=True)
        notified.append((engine.requests["a"].num_output_tokens, len(calls) - before))
    first = next(i for i, (n, _) in enumerate(notified) if n)
    assert first > 1 and loop.prefilled_ids == ("a",)  # a prompt of several chunks
    assert [k for _, k in notified] == [1 if i == first else 0 for i in range(12)]


def test_a_refusal_of_an_earlier_run_leaves_the_new_one_running():
    """A final written under epoch 1 waits in the writer while the request is resumed and placed
    here again under epoch 3; the old final lands, refused: that ends the run of epoch 1, which
    is over, not the run of epoch 3 (it was aborted, to be found gone and resumed once more)."""
    loop, written = new_loop()
    params = SamplingParams(max_tokens=20, seed=1, ignore_eos=True)
    assign(loop, "R", params, epoch=1)
    run(loop, written)
    assert written.messages["R"][-1].finish_reason == "length"
    assign(loop, "R", params, output_token_ids=[65, 66], epoch=3)
    loop.drop("R", 1)  # the stale final's refusal
    assert "R" in loop.engine.requests and loop.assignment("R")[1] == 3
    loop.drop("R", 3)  # a refusal of this run's own write ends it
    assert "R" not in loop.engine.requests and "R" not in loop.held
