"""Penalties, min_tokens and logprobs: against transformers on a real checkpoint, through the
engine, the output stream and the relay; a bad value is refused by its field's name."""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers
from conftest import hf_greedy, make_checkpoint

from pagefleet import Engine, SamplingParams
from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.model_config import load_model_spec
from pagefleet.common.redis import OutEntry
from pagefleet.common.sampling_proto import from_proto, to_proto
from pagefleet.gateway.relay import Reorder
from pagefleet.gateway.validate import BadField, check
from pagefleet.protos import generation_pb2 as pb
from pagefleet.protos.cluster_pb2 import StepOutputs
from pagefleet.worker.engine_loop import EngineLoop

VOCAB = 199
MAX_TOKENS = 12


def prompts_for(n: int, seed: int = 0, max_len: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, max_len))] for _ in range(n)]


class OutputPenalties(transformers.LogitsProcessor):
    """The reference for presence and frequency penalties (vLLM's), over the tokens after the prompt."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.num_prompt_tokens :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return model.eval()


def hf_generate(model, prompt: list[int], *, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0):
    """transformers greedy decoding with the penalties: the tokens and each step's processed logits."""
    ids = torch.tensor([prompt])
    procs = None
    if presence_penalty or frequency_penalty:
        procs = transformers.LogitsProcessorList([OutputPenalties(len(prompt), presence_penalty, frequency_penalty)])
    with torch.no_grad():
        g = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
            repetition_penalty=repetition_penalty, logits_processor=procs, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    return g.sequences[0, len(prompt) :].tolist(), torch.stack(g.scores)[:, 0]


def hf_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """``[len(out), vocab]``: log_softmax of the raw logits that predicted each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_logprobs_match(got: list[TokenLogprobs], out: list[int], ref: torch.Tensor, num_top: int) -> None:
    assert len(got) == len(out) == ref.shape[0]
    for lp, tok, row in zip(got, out, ref, strict=True):
        assert abs(lp.logprob - row[tok].item()) < 1e-4
        values, ids = row.topk(num_top)
        assert lp.top_token_ids == ids.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), values, atol=1e-4)


# -- penalties against transformers ---------------------------------------------------------------
SETTINGS = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_blocks=24, max_num_batched_tokens=16),
    "static": dict(batching="static", max_num_seqs=3),
}


@pytest.fixture(scope="module")
def repetition_refs(hf_model):
    prompts = prompts_for(4)
    return prompts, [hf_generate(hf_model, p, repetition_penalty=1.3)[0] for p in prompts]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_with_repetition_penalty_matches_transformers(llama_dir, repetition_refs, setting):
    prompts, ref = repetition_refs
    plain = hf_greedy(llama_dir, prompts[:2], MAX_TOKENS)
    assert plain != ref[:2], "the penalty changes nothing here: the test would prove nothing"
    engine = Engine(str(llama_dir), **{"num_blocks": 256, **SETTINGS[setting]})
    penalized = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    # Penalized and plain rows share the batch: each row gets its own treatment.
    outs = engine.generate(prompts + prompts[:2], [penalized] * 4 + [greedy] * 2)
    assert [o.token_ids for o in outs] == ref + plain


PENALTY_CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.75),
    dict(presence_penalty=-0.5, frequency_penalty=1.25, repetition_penalty=0.8),
    dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3),
]


def test_greedy_with_presence_and_frequency_penalties_matches_a_reference(llama_dir, hf_model):
    prompts = prompts_for(3, seed=1)
    cases = [(p, c) for c in PENALTY_CASES for p in prompts]
    refs = [hf_generate(hf_model, p, **c)[0] for p, c in cases]
    plain = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    for i in range(len(PENALTY_CASES)):
        assert refs[i * 3 : i * 3 + 3] != plain, f"case {PENALTY_CASES[i]} changes nothing here"
    engine = Engine(str(llama_dir), num_blocks=256)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **c) for _, c in cases]
    outs = engine.generate([p for p, _ in cases], params)
    assert [o.token_ids for o in outs] == refs


def test_resumed_request_counts_its_earlier_output(llama_dir):
    """The penalties see the tokens a request produced before it was resumed here."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2)
    prompt = prompts_for(1, seed=2)[0]
    whole = Engine(str(llama_dir), num_blocks=64).generate([prompt], params)[0].token_ids
    other = Engine(str(llama_dir), num_blocks=64)
    rid = other.add_request(prompt, params, output_token_ids=whole[:5])
    got = list(whole[:5])
    while other.has_unfinished_requests():
        for d in other.step():
            if d.request_id == rid:
                got.extend(d.token_ids)
    assert got == whole


def test_seeded_requests_with_penalties_are_independent_of_the_batch(llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25)
    prompt = prompts_for(1, seed=3)[0]
    alone = Engine(str(llama_dir), num_blocks=128).generate([prompt], params)[0]
    others = [
        SamplingParams(max_tokens=20, temperature=1.0, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, repetition_penalty=0.7, min_tokens=4, logprobs=5),
        SamplingParams(max_tokens=14, temperature=1.2, seed=9, presence_penalty=-1.0),
    ]
    busy = Engine(str(llama_dir), num_blocks=128, block_size=4, max_num_batched_tokens=24, seed=3)
    outs = busy.generate(prompts_for(3, seed=4)[:1] + [prompt] + prompts_for(2, seed=5), [others[0], params, *others[1:]])
    assert outs[1].token_ids == alone.token_ids
    for a, b in zip(outs[1].logprobs, alone.logprobs, strict=True):
        assert a.top_token_ids == b.top_token_ids
        assert abs(a.logprob - b.logprob) < 1e-4


# -- min_tokens ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_min_tokens_holds_back_eos_and_stop_ids(llama_dir, hf_model, tmp_path, how):
    prompt = prompts_for(1, seed=6)[0]
    first = hf_greedy(llama_dir, [prompt], 1)[0][0]
    if how == "eos":  # the same weights, with the greedy first token as end-of-sequence
        path, extra = make_checkpoint(tmp_path / "eos", "llama", eos_token_id=first), {}
    else:
        path, extra = llama_dir, {"stop_token_ids": [first]}
    engine = Engine(str(path), num_blocks=64)
    base = dict(max_tokens=MAX_TOKENS, temperature=0, **extra)
    early = engine.generate([prompt], SamplingParams(**base))[0]
    assert early.token_ids == [first] and early.finish_reason == "stop"
    held = engine.generate([prompt], SamplingParams(min_tokens=4, logprobs=3, **base))[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    ref = hf_logprobs(hf_model, prompt, held.token_ids[:1])[0]
    assert held.token_ids[0] == ref.topk(2).indices[1].item()  # the best token but the masked one
    # Logprobs come after the mask: the held-back token has none to offer.
    assert all(first not in lp.top_token_ids for lp in held.logprobs[:4])
    assert held.logprobs[0].logprob > ref[held.token_ids[0]].item()  # renormalised without it
    if first in held.token_ids:  # once allowed, it ends the request as usual
        assert held.token_ids.index(first) == len(held.token_ids) - 1 and held.finish_reason == "stop"


# -- logprobs -----------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_the_model_logits(llama_dir, hf_model):
    prompts = prompts_for(3, seed=7)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True,
                       logprobs=20),  # before temperature, top-k and top-p: the model's own distribution
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
    ]
    engine = Engine(str(llama_dir), num_blocks=128)
    outs = engine.generate(prompts + prompts[:1], [*params, SamplingParams(max_tokens=4, temperature=0)])
    for p, sp, o in zip(prompts, params, outs, strict=False):
        assert_logprobs_match(o.logprobs, o.token_ids, hf_logprobs(hf_model, p, o.token_ids), sp.logprobs)
    assert all(lp.top_token_ids[0] == t for lp, t in zip(outs[0].logprobs, outs[0].token_ids, strict=True))
    assert outs[3].logprobs is None


def test_logprobs_come_after_the_penalties(llama_dir, hf_model):
    prompt = prompts_for(1, seed=8)[0]
    case = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3)
    ref_ids, scores = hf_generate(hf_model, prompt, **case)
    engine = Engine(str(llama_dir), num_blocks=64)
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                   logprobs=3, **case))[0]
    assert out.token_ids == ref_ids
    assert_logprobs_match(out.logprobs, out.token_ids, torch.log_softmax(scores, dim=-1), 3)


def test_streamed_logprobs_line_up_with_tokens(llama_dir):
    engine = Engine(str(llama_dir), num_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)
    whole = engine.generate([[5, 6, 7]], params)[0]
    rid = engine.add_request([5, 6, 7], params)
    loop = EngineLoop(engine, emit=lambda batch: None, notify=lambda: None)
    tokens, lps = [], []
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert d.request_id == rid and len(d.logprobs) == len(d.token_ids)
            step = loop._encode([d])
            raw = step.fields["o"] if step.fields else step.finals[0].piece
            message = StepOutputs.FromString(raw).outputs[0]
            assert list(message.token_ids) == d.token_ids
            assert [([t.token_id for t in x.top_logprobs], x.logprob) for x in message.logprobs] == \
                [(x.top_token_ids, pytest.approx(x.logprob, rel=1e-6, abs=1e-6)) for x in d.logprobs]
            tokens += d.token_ids
            lps += d.logprobs
    assert tokens == whole.token_ids and lps == whole.logprobs


# -- validation and the proto -----------------------------------------------------------------------
BAD = [
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=math.nan)),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty="1")),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=True)),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD)
def test_bad_values_are_refused_by_name(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(("field", "sampling"), [
    ("presence_penalty", pb.SamplingParams(presence_penalty=-3)),
    ("frequency_penalty", pb.SamplingParams(frequency_penalty=2.5)),
    ("repetition_penalty", pb.SamplingParams(repetition_penalty=0)),
    ("repetition_penalty", pb.SamplingParams(repetition_penalty=math.nan)),
    ("min_tokens", pb.SamplingParams(max_tokens=4, min_tokens=5)),
    ("min_tokens", pb.SamplingParams(min_tokens=17)),  # past the default max_tokens
    ("logprobs", pb.SamplingParams(logprobs=21)),
    # past the vocabulary: it passed the door and failed at the worker (the proto's name)
    ("bad_words_token_ids", pb.SamplingParams(bad_words_token_ids=[pb.TokenIds(ids=[1_000_000])])),
    ("bad_words_token_ids", pb.SamplingParams(bad_words_token_ids=[pb.TokenIds(ids=[])])),
])
def test_gateway_refuses_bad_values_by_name(field, sampling):
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]), sampling=sampling)
    with pytest.raises(BadField) as e:
        check(req, load_model_spec("tiny"), 256)
    assert e.value.field == f"sampling.{field}"


def test_good_values_pass_and_survive_the_proto():
    params = SamplingParams(max_tokens=9, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.5,
                            min_tokens=9, logprobs=20)
    params.validate()
    back = from_proto(to_proto(params))
    assert back == params
    defaults = from_proto(pb.SamplingParams())
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.repetition_penalty) == (0, 0, 1)
    assert defaults.min_tokens == 0 and defaults.logprobs is None
    assert from_proto(pb.SamplingParams(logprobs=0)).logprobs == 0  # set to 0: the sampled token's only
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5]), sampling=to_proto(params))
    assert check(req, load_model_spec("tiny"), 256) == [5]


# -- the output stream and the relay ----------------------------------------------------------------
def lp(i: int, k: int = 2) -> TokenLogprobs:
    """A distinct, float32-exact entry for token ``i``."""
    return TokenLogprobs(-0.5 * i, [i + j for j in range(k)], [-0.5 * i - 0.25 * j for j in range(k)])


def test_reorder_cuts_logprobs_with_their_tokens():
    order = Reorder()
    assert order.add(OutEntry(4, [4], "e", logprobs=[lp(4)])) == []  # early: waits for the gap
    got = order.add(OutEntry(0, [0, 1], "ab", logprobs=[lp(0), lp(1)]))
    assert [m.token_ids for m in got] == [[0, 1]] and got[0].logprobs == [lp(0), lp(1)]
    # A repeat from a resumed worker that overlaps what was relayed: cut by skip, logprobs too.
    got = order.add(OutEntry(1, [1, 2, 3], "bcd", logprobs=[lp(1), lp(2), lp(3)]))
    assert [(m.index, m.token_ids) for m in got] == [(2, [2, 3]), (4, [4])]
    assert [m.logprobs for m in got] == [[lp(2), lp(3)], [lp(4)]]
    got = order.add(OutEntry(5, [5], "", "length", logprobs=[lp(5)]))
    assert got[0].logprobs == [lp(5)] and got[0].finish_reason == "length"
    plain = Reorder().add(OutEntry(0, [0], "a"))
    assert plain[0].logprobs is None


def test_a_record_is_cut_with_its_text():
    """A record (everything a worker wrote, one message) read from a token past its first: the
    text of the tokens kept comes with them (``text_lengths``); it was dropped whole, so a client
    that fell behind got the rest of its tokens with no text. Text past the lengths' sum (a
    finish's, after the last token) comes with the end."""
    from pagefleet.common.fencing import merged

    record = OutEntry(0, [0, 1, 2, 3, 4], "ab\u00e9cdEF", "length", text_lengths=[1, 1, 0, 2, 1])
    order = Reorder()
    order.next_index = 2  # the client has tokens 0 and 1 (text "ab")
    (got,) = order.add(record)
    assert (got.index, got.token_ids, got.text, got.text_lengths) == (2, [2, 3, 4], "\u00e9cdEF", [0, 2, 1])
    order = Reorder()
    order.next_index = 5  # every token, not the finish's own text
    (got,) = order.add(record)
    assert (got.token_ids, got.text, got.finish_reason) == ([], "EF", "length")
    old = Reorder()  # a record written without lengths: its text cannot be cut
    old.next_index = 2
    assert old.add(OutEntry(0, [0, 1, 2], "abc", "stop"))[0].text == ""
    # A resume's record, merged from a record and a step's messages that overlap it.
    tokens, _, whole = merged([OutEntry(0, [0, 1, 2], "abc", text_lengths=[1, 1, 1]),
                               OutEntry(2, [2, 3], "cd", text_lengths=[1, 1]), OutEntry(4, [4], "e")])
    assert (tokens, whole.text, whole.text_lengths) == ([0, 1, 2, 3, 4], "abcde", [1, 1, 1, 1, 1])
    assert whole.text_from(3) == "de"
