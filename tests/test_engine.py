"""The engine against `transformers`, under every setting that changes the step plan."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy, make_checkpoint

from pagefleet import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts_for(vocab: int, n: int = 6, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def assert_pool_free(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return make_checkpoint(tmp_path_factory.mktemp("llama3"), "llama", rope_parameters=rope)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", num_key_value_heads=1)


SETTINGS = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=7),
    "block-size-4": dict(block_size=4),
    "preemption": dict(block_size=4, num_blocks=24, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("ckpt", ["llama_dir", "qwen2_dir"])
def test_greedy_matches_transformers(request, ckpt, setting):
    path = request.getfixturevalue(ckpt)
    prompts = prompts_for(199)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    engine = Engine(str(path), **{"num_blocks": 256, **SETTINGS[setting]})
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    if setting == "preemption":
        assert engine.stats().num_preemptions_total > 0, "the pool was meant to force preemption"
    assert_pool_free(engine)


@pytest.mark.parametrize("ckpt", ["llama3_dir", "mistral_dir"])
def test_greedy_matches_transformers_other_shapes(request, ckpt):
    """llama3 RoPE scaling past its original context; Mistral with one KV head (GQA 4)."""
    path = request.getfixturevalue(ckpt)
    prompts = prompts_for(199, n=3, max_len=90)
    ref = hf_greedy(path, prompts, 16)
    engine = Engine(str(path), block_size=8, num_blocks=128, max_num_batched_tokens=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert_pool_free(engine)


def test_static_and_continuous_agree(llama_dir):
    prompts = prompts_for(199, n=9, seed=3)
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (3, 15, 7) * 3]
    cont = Engine(str(llama_dir), block_size=4, num_blocks=200, max_num_batched_tokens=32)
    static = Engine(str(llama_dir), block_size=4, num_blocks=200, max_num_seqs=4, batching="static")
    a = cont.generate(prompts, params)
    b = static.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [len(o.token_ids) for o in a] == [p.max_tokens for p in params]
    assert_pool_free(cont)
    assert_pool_free(static)


def test_seeded_sampling_is_independent_of_the_batch():
    engine = Engine("tiny", num_blocks=512)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=42)
    alone = engine.generate(["The seed decides"], params)[0].token_ids
    busy_prompts = ["The seed decides"] + [f"other request {i} " * (i + 1) for i in range(12)]
    busy_params = [params] + [SamplingParams(max_tokens=30, temperature=1.0) for _ in range(12)]
    busy = engine.generate(busy_prompts, busy_params)[0].token_ids
    assert alone == busy
    again = Engine("tiny", num_blocks=64, block_size=4, max_num_batched_tokens=8)
    assert again.generate(["The seed decides"], params)[0].token_ids == alone
    assert_pool_free(engine)
    assert_pool_free(again)


def test_unseeded_sampling_follows_the_engine_seed():
    params = SamplingParams(max_tokens=16, temperature=1.0)
    a = Engine("tiny", num_blocks=64, seed=7).generate(["x"], params)[0].token_ids
    b = Engine("tiny", num_blocks=64, seed=7).generate(["x"], params)[0].token_ids
    c = Engine("tiny", num_blocks=64, seed=8).generate(["x"], params)[0].token_ids
    assert a == b
    assert a != c


def test_top_k_one_is_greedy():
    engine = Engine("tiny", num_blocks=64)
    greedy = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=0))[0]
    top1 = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))[0]
    assert greedy.token_ids == top1.token_ids


@pytest.fixture(scope="module")
def tiny():
    return Engine("tiny", num_blocks=128, max_model_len=256)


def test_stop_token_ids_and_eos(tiny):
    free = tiny.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    third = free.token_ids[2]
    out = tiny.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[third]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(third) + 1]


def test_stop_string_truncates_text(tiny):
    free = tiny.generate(["xyz"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = free.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    out = tiny.generate(["xyz"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_streaming_deltas_are_contiguous_and_match_generate(tiny):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = tiny.generate(["stream me", "and me too"], params)
    for p in ("stream me", "and me too"):
        tiny.add_request(p, params, request_id=f"s-{p}")
    got: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    reasons = {}
    while tiny.has_unfinished_requests():
        for d in tiny.step():
            assert d.index == len(got.get(d.request_id, []))
            got.setdefault(d.request_id, []).extend(d.token_ids)
            text[d.request_id] = text.get(d.request_id, "") + d.text
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    assert got["s-stream me"] == want[0].token_ids
    assert got["s-and me too"] == want[1].token_ids
    assert text["s-stream me"] == want[0].text
    assert reasons == {"s-stream me": "length", "s-and me too": "length"}
    assert_pool_free(tiny)


def test_abort_frees_blocks_at_once(tiny):
    rid = tiny.add_request("a" * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    other = tiny.add_request("b", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    tiny.step()
    assert tiny.stats().blocks_per_request[rid] > 0
    final = tiny.abort_request(rid)
    assert final is not None and final.finish_reason == "abort"
    assert rid not in tiny.stats().blocks_per_request
    assert tiny.abort_request(rid) is None
    done = []
    while tiny.has_unfinished_requests():
        done += [d for d in tiny.step() if d.finished]
    assert [d.request_id for d in done] == [other]
    assert_pool_free(tiny)


def test_resume_from_emitted_tokens(tiny):
    """A request resumed with its first tokens continues exactly where it was."""
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    full = tiny.generate(["resume"], params)[0]
    rid = tiny.add_request("resume", params, output_token_ids=full.token_ids[:5])
    deltas = []
    while tiny.has_unfinished_requests():
        deltas += tiny.step()
    assert deltas[0].index == 5
    assert [t for d in deltas for t in d.token_ids] == full.token_ids[5:]
    assert deltas[-1].request_id == rid


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10_000], SamplingParams(), "prompt"),
        ([1, -1], SamplingParams(), "prompt"),
        ("x" * 300, SamplingParams(max_tokens=1), "max_model_len"),
        ("abc", SamplingParams(max_tokens=254), "max_model_len"),
        ("abc", SamplingParams(max_tokens=0), "max_tokens"),
        ("abc", SamplingParams(temperature=-1), "temperature"),
        ("abc", SamplingParams(temperature=float("nan")), "temperature"),
        ("abc", SamplingParams(top_p=0), "top_p"),
        ("abc", SamplingParams(top_p=1.5), "top_p"),
        ("abc", SamplingParams(top_k=-2), "top_k"),  # -1 is vLLM's off, as 0
        ("abc", SamplingParams(seed=2**64 + 5), "seed"),  # was wrapped to 5
        ("abc", SamplingParams(seed=-(2**63) - 1), "seed"),
        ([72.7, 105], SamplingParams(), "prompt"),  # was truncated to 72
        ([True, 105], SamplingParams(), "prompt"),
    ],
)
def test_bad_input_fails_alone(tiny, prompt, params, field):
    keep = tiny.add_request("still running", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny.step()
    with pytest.raises(ValueError, match=field):
        tiny.add_request(prompt, params)
    with pytest.raises(ValueError, match=field):
        tiny.generate(["fine", prompt], params)
    finished = []
    while tiny.has_unfinished_requests():
        finished += [d.request_id for d in tiny.step() if d.finished]
    assert finished == [keep]
    assert_pool_free(tiny)


def test_bad_engine_arguments():
    with pytest.raises(ValueError, match="batching"):
        Engine("tiny", batching="dynamic")
    with pytest.raises(ValueError, match="model"):
        Engine("/no/such/checkpoint")
    with pytest.raises(ValueError, match="max_model_len"):
        Engine("tiny", max_model_len=10**6)
    with pytest.raises(ValueError, match="dtype"):
        Engine("tiny", dtype="float8")
    with pytest.raises(ValueError, match="block_size"):
        Engine("tiny", block_size=0)


def test_request_larger_than_the_pool_is_refused():
    engine = Engine("tiny", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request("x" * 10, SamplingParams(max_tokens=10))
    assert engine.generate(["ab"], SamplingParams(max_tokens=4, temperature=0))[0].finish_reason
    assert_pool_free(engine)


def test_swap_pool_none_matches_the_device_pool():
    engine = Engine("tiny", num_blocks=32, num_swap_blocks=None, preemption="swap")
    assert engine.stats().num_swap_blocks == 32
    assert Engine("tiny", num_blocks=32).stats().num_swap_blocks == 0
    with pytest.raises(ValueError, match="num_swap_blocks"):
        Engine("tiny", num_blocks=32, num_swap_blocks=-1)


def test_static_batch_takes_only_the_rows_its_pool_can_reserve():
    """Two requests that each fit, but not together at the batch's padded length."""
    engine = Engine("tiny", num_blocks=8, block_size=16, batching="static")
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)]
    outs = engine.generate([[65] * 100, [66] * 10], params)
    assert [len(o.token_ids) for o in outs] == [10, 100]


def test_tiny_temperature_is_greedy(tiny):
    greedy = tiny.generate(["abc"], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    tiny_t = tiny.generate(["abc"], SamplingParams(max_tokens=8, temperature=1e-45))[0].token_ids
    assert tiny_t == greedy


def test_stop_strings_are_bounded(tiny):
    with pytest.raises(ValueError, match="stop"):
        tiny.add_request("abc", SamplingParams(stop=["x"] * 65))
    with pytest.raises(ValueError, match="stop"):
        tiny.add_request("abc", SamplingParams(stop=["y" * 300]))


def test_resumed_request_with_stop_strings_keeps_its_held_back_text(tiny):
    """Text held back for a stop string before the resume point still reaches the client."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["@@@@@@@@"])
    full = tiny.generate(["resume with stops"], params)[0]
    rid = tiny.add_request("resume with stops", params, request_id="first-half")
    text = ""
    while len(tiny.requests[rid].output_token_ids) < 8:
        text += "".join(d.text for d in tiny.step())
    emitted = tiny.requests[rid].output_token_ids[:]
    tiny.abort_request(rid)  # the worker died: its held-back text never went out
    tiny.add_request("resume with stops", params, request_id="second-half", output_token_ids=emitted)
    while tiny.has_unfinished_requests():
        text += "".join(d.text for d in tiny.step())
    assert text == full.text


@pytest.mark.parametrize("bad", [
    dict(bad_words_token_ids=[["a"]]), dict(bad_words_token_ids=[5]), dict(bad_words_token_ids=[[-1]]),
    dict(top_k=10**20), dict(allowed_token_ids=[1000]), dict(logit_bias={1000: 1.0}), dict(logit_bias=[1]),
    dict(repetition_penalty=1e-300), dict(structured_outputs="json"),
])
def test_bad_sampling_params_are_refused_when_added_and_harm_no_other_request(bad):
    """These passed the checks and broke inside a step (every later step of every request in
    the engine raised), or were applied silently wrong (a negative id banned a token from the
    end; an id past the vocabulary masked the whole row; a penalty of 1e-300 was 0 in float32).
    Each is a ValueError naming its field when the request is added; the engine runs on."""
    from pagefleet.common.sampling_params import SamplingParams

    engine = Engine("tiny", device="cpu", num_blocks=32)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="good")
    field = next(iter(bad)).removesuffix("_token_ids") if "bad_words" in next(iter(bad)) else next(iter(bad))
    with pytest.raises(ValueError, match=field):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **bad), request_id="bad")
    while engine.has_unfinished_requests():
        engine.step()
    assert "bad" not in engine.requests


def test_stop_reason_is_the_stop_string_or_token_that_ended_it():
    """As vLLM's ``stop_reason``: the stop string that appeared, or the request's own stop token;
    None when the length ended it."""
    engine = Engine("tiny", num_blocks=64)
    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert free.stop_reason is None and free.finish_reason == "length"
    cut = free.text[3:5]
    by_string = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                            stop=[cut]))[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", cut)
    token = free.token_ids[4]
    by_token = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[token]))[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)


def test_generate_keeps_other_requests_deltas_and_ids_for_their_caller(tiny):
    """``generate`` steps every request in the engine: another one's deltas (``add_request``)
    were dropped, so its output could not be had; they now come from the next ``step``. An id
    the engine draws skips a caller's own of that shape (``req-7``: a clash refused generate)."""
    mine = tiny.add_request("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), request_id="req-1")
    outs = tiny.generate(["a", "b", "c"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3, 3] and mine not in {o.request_id for o in outs}
    got = []
    while tiny.has_unfinished_requests():
        got += [d for d in tiny.step() if d.request_id == mine]
    assert sum(len(d.token_ids) for d in got) == 8 and got[-1].finish_reason == "length"
    assert [d.index for d in got] == sorted(d.index for d in got) and got[0].index == 0
    alone = tiny.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert [t for d in got for t in d.token_ids] == alone.token_ids
    with pytest.raises(ValueError, match="got a dict"):
        tiny.generate(["a"], {"max_tokens": 3})


def test_masks_that_leave_no_token_at_a_step_end_the_request_with_why(tiny):
    """allowed_token_ids [65] with the bad word [65, 65]: after the first 65 nothing may be drawn.
    A token every mask forbade was sent (id 0, NaN log-probabilities); the request now ends with
    an error saying why, its first token kept, and requests beside it run on untouched."""
    params = SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[65], bad_words_token_ids=[[65, 65]],
                            logprobs=2)
    beside = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for p in (params, SamplingParams(max_tokens=4, temperature=1.0, seed=3, allowed_token_ids=[65],
                                     bad_words_token_ids=[[65, 65]])):  # with log-probabilities, and sampled
        rid = tiny.add_request("hi", p)
        other = tiny.add_request("hi", beside)
        deltas = {rid: [], other: []}
        while tiny.has_unfinished_requests():
            for d in tiny.step():
                deltas[d.request_id].append(d)
        last = deltas[rid][-1]
        assert last.finish_reason == "error" and "no token can be drawn" in last.error, last
        assert [t for d in deltas[rid] for t in d.token_ids] == [65]
        assert sum(len(d.token_ids) for d in deltas[other]) == 4 and deltas[other][-1].finish_reason == "length"


def test_an_abort_after_generate_held_its_deltas_sends_them_first(tiny):
    """Deltas ``generate`` held for another request came back after that request's abort delta
    (indices 0-2 after an abort at 3): they now go out in it, in order, and nothing follows."""
    rid = tiny.add_request("x", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    tiny.generate(["a"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    final = tiny.abort_request(rid)
    assert final.finish_reason == "abort" and final.index == 0 and len(final.token_ids) >= 3
    assert not tiny.has_unfinished_requests() and tiny.step() == []
