"""Structured output in the engine (llguidance token bitmasks in the sampler step): outputs
parse and validate, choices are only ever the choices, and the same tokens come out under
preemption (swap and recompute) and when a request is resumed from its emitted tokens, as on
another worker. The gateway's grammar check refuses what does not compile, naming it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagefleet import Engine, SamplingParams
from pagefleet.common import grammar
from pagefleet.common.sampling_params import StructuredOutputs

pytestmark = pytest.mark.timeout(240)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
CHOICES = ("yes", "no", "maybe so")
REGEX = r"[a-c]{3}-[0-9]{2}"


def _params(so: StructuredOutputs, seed: int, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if seed else 0, seed=seed or None,
                          structured_outputs=so)


def _batch() -> list[SamplingParams]:
    schema = StructuredOutputs(json=json.dumps(SCHEMA))
    out = [_params(schema, s) for s in range(3)]
    out += [_params(StructuredOutputs(choice=CHOICES), s, 12) for s in range(5)]
    out += [_params(StructuredOutputs(regex=REGEX), s, 12) for s in range(2)]
    return out


def _check(outs, params) -> None:
    for o, p in zip(outs, params, strict=True):
        so = p.structured_outputs
        assert o.finish_reason == "stop", (o.text, so)
        if so.json:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif so.choice:
            assert o.text in CHOICES
        else:
            assert re.fullmatch(REGEX, o.text)


def test_outputs_hold_their_constraints_and_survive_preemption():
    params = _batch()
    prompts = [f"prompt {i} " * (1 + i % 3) for i in range(len(params))]
    plain = Engine("tiny", num_blocks=512)
    ref = plain.generate(prompts, params)
    _check(ref, params)
    assert len({o.text for o in ref[3:8]}) > 1, "seeded choices were meant to differ"
    for mode in ("swap", "recompute"):
        tight = Engine("tiny", block_size=4, num_blocks=36, max_num_batched_tokens=16, preemption=mode,
                       num_swap_blocks=None if mode == "swap" else 0)
        outs = tight.generate(prompts, params)
        assert tight.stats().num_preemptions_total > 0, "the pool was meant to force preemption"
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], mode
        _check(outs, params)
    assert plain._grammar_compiler.num_compiled == 3  # once per distinct constraint


def test_resumed_request_rebuilds_its_grammar_from_emitted_tokens():
    """As on another worker: the tokens emitted so far come with the request."""
    params = _params(StructuredOutputs(json=json.dumps(SCHEMA)), 5)
    whole = Engine("tiny", num_blocks=256).generate(["resume me"], params)[0]
    for cut in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        engine = Engine("tiny", num_blocks=256)
        engine.add_request("resume me", params, request_id="r", output_token_ids=whole.token_ids[:cut])
        tokens = list(whole.token_ids[:cut])
        while engine.has_unfinished_requests():
            for d in engine.step():
                tokens += d.token_ids
        assert tokens == whole.token_ids, cut
    jsonschema.validate(json.loads(whole.text), SCHEMA)


@pytest.mark.parametrize(
    ("so", "kind"),
    [
        (StructuredOutputs(regex="a(b"), "regex"),
        (StructuredOutputs(json='{"type": "nope"}'), "json"),
        (StructuredOutputs(json="[1, 2"), "json"),
        (StructuredOutputs(grammar="start: nothere"), "grammar"),
        (StructuredOutputs(grammar="root ::= missing"), "grammar"),
        # Given empty, a kind is still that kind: refused, never taken for json_object (any object).
        (StructuredOutputs(regex=""), "regex"),
        (StructuredOutputs(grammar=""), "grammar"),
        (StructuredOutputs(json=""), "json"),
        # Bounded: a constraint compiles on the gateway's event loop (100,000 choices took 7 s).
        (StructuredOutputs(choice=tuple(f"c{i}" for i in range(1025))), "choice"),
        (StructuredOutputs(regex="a" * (128 * 1024 + 1)), "regex"),
    ],
)
def test_the_gateway_check_names_what_does_not_compile(so, kind):
    with pytest.raises(grammar.GrammarError) as e:
        grammar.check(so)
    assert e.value.field == kind and e.value.reason


def test_a_schema_whose_first_mask_fails_is_refused_at_the_door():
    """``{"$ref": "#"}`` validates, but its first mask cannot be built: the door's check (with the
    model's tokenizer, as the worker compiles it) builds it and refuses it by name."""
    from pagefleet.common.model_config import load_model_spec
    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.gateway.validate import BadField, check
    from pagefleet.protos import generation_pb2 as pb

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json='{"$ref": "#"}'))
    with pytest.raises(BadField) as e:
        check(pb.GenerateRequest(prompt="hi", sampling=to_proto(params)), load_model_spec("tiny"), 512)
    assert e.value.field == "sampling.structured_outputs.json" and "first token's mask" in e.value.reason


def test_good_grammars_compile_lark_and_gbnf():
    for so in (StructuredOutputs(regex=" "), StructuredOutputs(regex="\n"),  # not empty: one character
               StructuredOutputs(grammar='start: "x" NUM\nNUM: /[0-9]+/'),
               StructuredOutputs(grammar='start: "x ::= y"'),  # Lark, though "::=" is in it
               StructuredOutputs(grammar='// a ::= b\nstart: "x"'),
               StructuredOutputs(grammar='root ::= "x" [0-9]+'), StructuredOutputs(choice=('a "quoted"', "b\\n")),
               StructuredOutputs(json_object=True), StructuredOutputs(json=json.dumps(SCHEMA))):
        assert grammar.check(so)


def test_a_schema_of_many_pattern_properties_is_refused_not_compiled_for_seconds():
    """A 19 KB schema of 450 patternProperties held the gateway's event loop for 20 s (and a
    worker's batch for 14): past ``MAX_PATTERN_PROPERTIES`` it is refused by name."""
    many = {"type": "object", "patternProperties": {f"^p{i}[a-z]{{2,40}}$": {"type": "integer"}
                                                    for i in range(grammar.MAX_PATTERN_PROPERTIES + 1)}}
    with pytest.raises(grammar.GrammarError) as e:
        grammar.check(StructuredOutputs(json=json.dumps({"type": "object", "properties": {"x": many}})))
    assert "patternProperties" in e.value.reason
    few = {"type": "object", "patternProperties": {f"^p{i}$": {"type": "integer"} for i in range(8)}}
    assert grammar.check(StructuredOutputs(json=json.dumps(few)))


def test_the_gateway_compiles_off_its_loop_and_refuses_what_takes_too_long(monkeypatch):
    """``compile_ahead`` runs the check in a thread: a constraint not compiled within
    ``GRAMMAR_CHECK_S`` is refused as too complex (the loop went on meanwhile), and the
    gateway's check then finds that refusal; a quick one is cached for the check."""
    import asyncio

    from pagefleet.common.model_config import load_model_spec
    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.gateway import validate

    model = load_model_spec("tiny")
    slow = StructuredOutputs(json=json.dumps({"type": "object", "patternProperties": {
        f"^q{i}[a-z]{{2,40}}$": {"type": "integer"} for i in range(60)}}))
    monkeypatch.setattr(validate, "GRAMMAR_CHECK_S", 1e-4)

    async def main() -> int:
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await validate.compile_ahead(to_proto(SamplingParams(structured_outputs=slow)), model)
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 0
    error = validate.grammar_error(slow, model)
    assert error is not None and "too complex" in error.reason
    quick = StructuredOutputs(regex="[ab]{3}")
    monkeypatch.setattr(validate, "GRAMMAR_CHECK_S", 30.0)
    asyncio.run(validate.compile_ahead(to_proto(SamplingParams(structured_outputs=quick)), model))
    assert validate.grammar_error(quick, model) is None


def test_token_references_are_checked_against_the_models_vocabulary():
    """A grammar naming a token the model does not have passed the gateway's check (made
    without a tokenizer) and ended at the worker as an empty "stop": it is refused at the door,
    and an engine given one ends the request with an error, not a silent stop."""
    from pagefleet.common.model_config import load_model_spec
    from pagefleet.gateway import validate

    model = load_model_spec("tiny")
    bad = StructuredOutputs(grammar='start: "a" <[99999]>')
    error = validate.grammar_error(bad, model)
    assert error is not None and error.field == "grammar"
    assert validate.grammar_error(StructuredOutputs(grammar='start: "a" <[65]>'), model) is None
    engine = Engine("tiny", num_blocks=64)
    out = engine.generate(["hello"], SamplingParams(max_tokens=8, structured_outputs=bad))[0]
    assert (out.finish_reason, out.token_ids) == ("error", [])


def test_the_grammar_wins_over_masks_that_leave_it_nothing():
    """``min_tokens`` holding back the end the grammar asks for, bad words or allowed ids that
    remove every token it allows, ``ignore_eos`` past its end: the output stays in the grammar
    (before, a token of no probability, byte 0, came out, and its log-probability was NaN)."""
    import math

    engine = Engine("tiny", num_blocks=64)
    choice = StructuredOutputs(choice=("yes", "no"))
    cases = [dict(min_tokens=5), dict(bad_words_token_ids=[[ord("y")], [ord("n")]]), dict(allowed_token_ids=[120]),
             dict(ignore_eos=True, max_tokens=8), dict(min_tokens=5, logprobs=2)]
    for kw in cases:
        params = SamplingParams(**{"max_tokens": 12, **kw, "structured_outputs": choice})
        out = engine.generate(["hello"], params)[0]
        assert out.text in ("yes", "no") and "\x00" not in out.text, (kw, out.text)
        assert 0 not in out.token_ids, (kw, out.token_ids)
        for lp in out.logprobs or []:
            assert not math.isnan(lp.logprob), kw


def test_a_choice_holds_through_preemptions_and_aborts_in_any_order():
    """Sampled requests constrained to one long choice, eight at a time in a pool that keeps
    preempting them, some aborted between steps: every one that finishes says the choice,
    whole. (A CI run once saw such a text leave its choice through the HTTP door; this is the
    engine's part of that path, shaken.)"""
    import random

    said = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    so = StructuredOutputs(choice=(said,))
    engine = Engine("tiny", num_blocks=80, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    rng = random.Random(0)
    live: dict[str, list[int]] = {}
    texts, n = [], 0
    for _ in range(300):
        while len(live) < 8:
            n += 1
            prompt = [rng.randrange(5, 200) for _ in range(rng.randint(3, 30))]
            engine.add_request(prompt, SamplingParams(max_tokens=130, temperature=1.0, seed=n, structured_outputs=so),
                               request_id=f"r{n}")
            live[f"r{n}"] = []
        for _ in range(rng.randint(1, 6)):
            for d in engine.step():
                if d.request_id in live:
                    live[d.request_id] += d.token_ids
                    if d.finished:
                        texts.append(engine.tokenizer.decode(live.pop(d.request_id)))
        if live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            del live[rid]
    assert len(texts) >= 20 and engine.stats().num_preemptions_total >= 50
    assert all(t == said for t in texts), [t for t in texts if t != said][:3]


def test_masks_computed_in_line_wait_for_the_mask_thread():
    """When a step's masks were started for other requests than the sampler masks (the fallback
    computed in line), the in-line masks wait for the mask thread: a matcher never consumes a
    token on two threads at once (which would leave it a token ahead, and its text its choice)."""
    import threading
    import time

    import torch

    from worker import structured

    engine = Engine("tiny")
    so = StructuredOutputs(choice=("yes please", "no thanks"))
    for rid in ("a", "b"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=so), request_id=rid)
    a, b = engine.requests["a"], engine.requests["b"]
    gate, released = threading.Event(), []
    structured._MASK_THREAD.submit(gate.wait)  # the mask thread busy until the gate opens
    structured.start_grammar_masks([b])  # b's mask queued behind it
    timer = threading.Timer(0.3, lambda: (released.append(time.monotonic()), gate.set()))
    try:
        timer.start()
        vocab = engine.model_config.vocab_size
        logits = torch.zeros(2, vocab)
        structured.apply_grammar_masks(logits, [0, 1], [a, b])  # not the started set: computed in line
        returned = time.monotonic()
        timer.join()
    finally:
        gate.set()  # the shared mask thread is never left blocked
    assert released and returned >= released[0]
    assert a.grammar.prepared is None and b.grammar.prepared is None
    allowed = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]
    first = {engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in so.choice}
    assert allowed[0] == allowed[1] and first <= allowed[0]
    assert a.grammar.num_consumed == b.grammar.num_consumed == 0


def test_min_tokens_with_only_end_tokens_allowed_is_refused_at_the_door_and_by_the_engine():
    """``allowed_token_ids`` of end-of-sequence alone with ``min_tokens``: nothing may be drawn
    before ``min_tokens`` (byte 0, outside the allowed set, came out). Refused by name."""
    from pagefleet.common.model_config import load_model_spec
    from pagefleet.common.sampling_proto import to_proto
    from pagefleet.gateway.validate import BadField, check
    from pagefleet.protos import generation_pb2 as pb

    model = load_model_spec("tiny")
    eos = model.config.eos_token_ids[0]
    params = SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=[eos])
    with pytest.raises(BadField) as e:
        check(pb.GenerateRequest(prompt="hi", sampling=to_proto(params)), model, 512)
    assert e.value.field == "sampling.allowed_token_ids"
    engine = Engine("tiny", num_blocks=64)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request([1, 2, 3], params)
    fine = SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=[eos, 65])
    assert check(pb.GenerateRequest(prompt="hi", sampling=to_proto(fine)), model, 512)
    assert engine.generate([[1, 2, 3]], fine)[0].token_ids[:3] == [65, 65, 65]


def _added_as_text() -> tuple:
    from tokenizers import AddedToken

    # As Qwen's tokenizer adds them; then one of byte-level symbols (its bytes are not its text's)
    # and one that takes the space before it (matched in " <tag>", its bytes "<tag>").
    return ("<think>", "</think>", "<tool_call>", "</tool_call>", "é!",
            AddedToken("<tag>", lstrip=True, special=False, normalized=False))


ADDED_AS_TEXT = _added_as_text()
LITERALS = [
    StructuredOutputs(choice=("<think>yes", "<think>no")),
    StructuredOutputs(regex="abc</think>hello"),
    StructuredOutputs(regex="x</s>y"),  # a special token's text, as text
    StructuredOutputs(json=json.dumps({"type": "object", "properties": {"tag": {"const": "<tool_call>"}},
                                       "required": ["tag"], "additionalProperties": False})),
    StructuredOutputs(choice=("café!", "non")),
    StructuredOutputs(regex="x <tag>y"),
]


@pytest.fixture(scope="module")
def added_tokens_checkpoint(tmp_path_factory):
    from conftest import make_checkpoint
    from test_openai import build_tokenizer, write_tokenizer_config

    path = tmp_path_factory.mktemp("added-tokens")
    vocab_size = build_tokenizer(path, added=ADDED_AS_TEXT)
    make_checkpoint(path, "llama", vocab_size=vocab_size, max_position_embeddings=512)
    write_tokenizer_config(path, None)
    return path


def _fits(text: str, so: StructuredOutputs) -> bool:
    if so.choice:
        return text in so.choice
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    return json.loads(text) == {"tag": "<tool_call>"}


@pytest.mark.parametrize("so", LITERALS, ids=["choice", "added-regex", "special-regex", "json-const", "byte-symbols",
                                               "lstrip"])
def test_every_token_a_mask_allows_its_matcher_takes(added_tokens_checkpoint, so):
    """llguidance's own loader makes every added token special yet forced a literal's text as
    them: the mask allowed ``<think>``'s id, its matcher refused it, and the request ended
    quietly with half a choice. Every allowed token, at every step of a path, is taken."""
    import random

    import numpy as np
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from pagefleet.common.tokenizer import HFTokenizer

    tok = HFTokenizer(added_tokens_checkpoint / "tokenizer.json", (2,), 1)
    vocab = tok.vocab_size + 5  # a model's padded vocabulary
    ll = grammar.ll_tokenizer(tok, vocab, (2,))
    rng = random.Random(0)
    for attempt in range(4):
        m = LLMatcher(ll, grammar.grammar_of(so), log_level=0)
        out: list[int] = []
        while not m.is_stopped() and len(out) < 40:
            bm = allocate_token_bitmask(1, vocab)
            fill_next_token_bitmask(m, bm, 0)
            allowed = np.nonzero(np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[0, :vocab])[0].tolist()
            assert allowed, tok.decode(out, skip_special_tokens=False)
            for t in allowed:
                trial = m.deep_copy()
                assert trial.consume_token(t) and not trial.is_error(), (t, trial.get_error())
            # Prefer the added token where the mask offers it (what a model of that vocabulary draws).
            added = [t for t in allowed if t >= tok.vocab_size - len(ADDED_AS_TEXT) and t < tok.vocab_size]
            t = added[0] if added and attempt % 2 == 0 else rng.choice(allowed)
            if t == 2:
                break
            assert m.consume_token(t)
            out.append(t)
        assert _fits(tok.decode(out, skip_special_tokens=False), so)


def test_an_engine_keeps_literals_of_added_and_special_tokens_text(added_tokens_checkpoint):
    """On a real checkpoint whose tokenizer adds ``<think>`` as text: every output is one of
    its constraint's, whatever the seed (the random model draws the added tokens too)."""
    engine = Engine(str(added_tokens_checkpoint), device="cpu")
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=seed, structured_outputs=so)
              for so in LITERALS for seed in range(4)]
    outs = engine.generate(["think about it"] * len(params), params)
    for o, p in zip(outs, params, strict=True):
        assert o.finish_reason == "stop" and _fits(o.text, p.structured_outputs), (o.text, o.token_ids)


def test_tokens_after_a_met_constraint_are_no_error_and_a_refused_token_is_one():
    """A constraint met (its matcher stopped) and then an end token the request does not end on
    (``ignore_eos``, another end id) is no failure: only the end goes through after it. A token
    the matcher refuses ends the request with why, in one line, not as a quiet ``stop``."""
    from pagefleet.common.tokenizer import ByteTokenizer
    from pagefleet.worker.structured import GrammarCompiler

    compiler = GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, (ByteTokenizer.EOS,))
    so = StructuredOutputs(choice=("ab",))
    met = compiler.request_grammar(so)
    assert met.matcher(list(b"ab") + [ByteTokenizer.EOS, ByteTokenizer.EOS]) is not None and met.error is None
    refused = compiler.request_grammar(so)
    assert refused.matcher(list(b"ax")) is None and refused.failed
    assert refused.error and "\n" not in refused.error
    compiler.close()


def test_a_constraint_that_fails_at_its_first_mask_ends_the_request_with_why():
    """``{"$ref": "#"}`` compiles but its matcher fails building its first mask, which then lets
    only the end through: the request ended as a clean ``stop`` with an empty output outside its
    constraint (a review's repro). It ends with the matcher's error instead, on every run (the
    compiled grammar is cached and copied)."""
    engine = Engine("tiny", num_blocks=64)
    so = StructuredOutputs(json='{"$ref": "#"}')
    for _ in range(2):
        (out,) = engine.generate([[70, 71]], SamplingParams(max_tokens=8, temperature=0, structured_outputs=so))
        assert out.finish_reason == "error", (out.finish_reason, out.token_ids)
    engine.add_request([70, 71], SamplingParams(max_tokens=8, temperature=0, structured_outputs=so), request_id="why")
    last = None
    while last is None or not last.finished:
        last = next((d for d in engine.step() if d.request_id == "why"), last)
    assert last.finish_reason == "error" and last.error.startswith("structured output:") and "\n" not in last.error
    (fine,) = engine.generate([[70, 71]], SamplingParams(max_tokens=8, temperature=0,
                                                         structured_outputs=StructuredOutputs(choice=("ok",))))
    assert fine.text == "ok"
