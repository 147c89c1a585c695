"""The sampler: seeded draws are a pure function of (seed, position), so a seeded request
continues the same way after a resume on another engine; penalties and the min_tokens mask
against a plain reference; logprobs per row."""

from __future__ import annotations

import math

import pytest
import torch

from pagefleet import Engine, SamplingParams
from pagefleet.worker.sampler import sample, seeded_exponentials


def test_seeded_draws_depend_on_seed_and_position_only():
    a = seeded_exponentials([7, 7, 8], [10, 11, 10], 500, "cpu")
    b = seeded_exponentials([8, 7], [10, 10], 500, "cpu")  # other rows beside them, other order
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    big = seeded_exponentials([2**64 - 1, -3], [0, 2**40], 4, "cpu")
    assert torch.isfinite(big).all() and (big > 0).all()


def test_seeded_draws_are_pinned():
    """The draws of a (seed, position) are part of what a seeded request means: the same seed gives
    the same tokens on any worker, version or device, and a request resumed on a worker of another
    release continues its draws. A change to ``seeded_exponentials`` changes every seeded
    request's tokens; it must be made on purpose (and said in the release notes), so the values are
    pinned here (the last changed with the 23-bit uniforms)."""
    q = seeded_exponentials([0, 42, 2**64 - 1], [0, 7, 123456], 4, "cpu")
    pinned = [[0.46304142, 0.45836613, 0.23913071, 1.29811907],
              [0.62875950, 0.55731279, 0.06476342, 0.32797709],
              [0.35328394, 4.55869770, 0.25162965, 0.96484673]]
    assert torch.allclose(q, torch.tensor(pinned), rtol=1e-6, atol=0)


def test_seeded_draws_are_exponential():
    q = seeded_exponentials(list(range(64)), [5] * 64, 4096, "cpu").flatten()
    assert abs(q.mean().item() - 1.0) < 0.02  # Exp(1): mean 1, variance 1
    assert abs(q.var().item() - 1.0) < 0.05
    u = torch.exp(-q)  # back to uniform: every decile holds about a tenth
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts / q.numel() - 0.1).abs().max() < 0.01


def test_seeded_draws_are_never_zero_or_one():
    """A draw of 0 made 0 / 0 = NaN for every token of probability 0, and argmax takes NaN for the
    largest: a masked token won. This (seed, position) once drew -0.0 at column 106 of 320 (a
    uniform that rounded to 1.0 in float32), once in 2**24 draws."""
    q = seeded_exponentials([5519100575163960655], [385], 320, "cpu")
    assert (q > 0).all() and torch.isfinite(q).all()
    for first in range(0, 1 << 22, 1 << 20):  # 4M draws: the extremes are in range too
        q = seeded_exponentials(list(range(first, first + 256)), [3] * 256, 4096, "cpu")
        assert (q > 0).all() and torch.isfinite(q).all()


def test_a_token_of_probability_zero_is_never_sampled():
    """Only token 2 is allowed (the others masked to -inf, as structured output, top-k or
    allowed_token_ids leave a row); at the (seed, position) whose draw at 106 was -0.0, token 106
    was sampled (a CI run's guided_choice text left its choice so)."""
    vocab, seed = 320, 5519100575163960655
    req = _req(list(range(3, 3 + 290)), SamplingParams(temperature=1.0, seed=seed), list(range(3, 3 + 95)))
    assert len(req.all_token_ids) == 385
    for unseeded in (False, True):
        logits = torch.full((2, vocab), -math.inf)
        logits[:, 2] = 0.5
        other = _req([1], SamplingParams(temperature=1.0, seed=None if unseeded else 7))
        out = sample(logits, [req, other], torch.Generator().manual_seed(0))
        assert out.token_ids == [2, 2]


def test_min_p_samples_only_tokens_near_the_most_likely():
    """vLLM's min_p: a token less likely than min_p times the most likely one is never sampled
    (on the tempered distribution, before top-k and top-p); 0 turns it off, 1 leaves the
    most likely alone."""
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log()
    seen: dict[float, set[int]] = {}
    for min_p in (0.0, 0.5, 1.0):
        got = set()
        for seed in range(200):
            req = _req([1], SamplingParams(temperature=1.0, min_p=min_p, seed=seed))
            got |= set(sample(logits[None].clone(), [req], torch.Generator().manual_seed(seed)).token_ids)
        seen[min_p] = got
    assert seen == {0.0: {0, 1, 2, 3}, 0.5: {1, 2}, 1.0: {1}}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5).validate()


def test_seeded_request_resumed_elsewhere_continues_the_same_tokens():
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    whole = Engine("tiny", device="cpu", num_blocks=64).generate(["Once upon a time"], params)[0]
    # Another engine (another worker), other engine seed, busy with other sampled requests.
    other = Engine("tiny", device="cpu", num_blocks=64, seed=99)
    for i in range(3):
        other.add_request(f"noise {i}", SamplingParams(max_tokens=30, temperature=1.0))
    rid = other.add_request("Once upon a time", params, output_token_ids=whole.token_ids[:10])
    got = list(whole.token_ids[:10])
    while other.has_unfinished_requests():
        for d in other.step():
            if d.request_id == rid:
                got.extend(d.token_ids)
    assert got == whole.token_ids


def _req(prompt, params, output=(), eos=frozenset({2})):
    from pagefleet.worker.request import Request

    return Request("r", list(prompt), params, eos_token_ids=eos, output_token_ids=list(output))


def _reference_penalties(x: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on one row, written plainly."""
    x = x.clone()
    for t in set(prompt) | set(output):
        v = x[t]
        x[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(output):
        x[t] = x[t] - p.frequency_penalty * output.count(t) - p.presence_penalty
    return x


def test_penalties_match_a_plain_reference_row_by_row():
    from pagefleet.worker.penalties import apply_penalties

    vocab = 50_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=g) * 4
    rows = [
        ([1, 5, 5, vocab - 1], [5, 7, 7, 7, 9], SamplingParams(repetition_penalty=1.3)),
        ([3], [3, 3, 8, vocab - 1], SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)),
        ([4, 4, 6], [6, 6, 11], SamplingParams(repetition_penalty=0.7, presence_penalty=-1.5, frequency_penalty=2.0)),
        ([2, 9], [], SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)),  # no output yet
    ]
    reqs = [_req(p, sp, out) for p, out, sp in rows]
    want = logits.clone()
    for i, (p, out, sp) in zip([0, 2, 3, 4], rows, strict=True):
        want[i] = _reference_penalties(logits[i], p, out, sp)
    got = logits.clone()
    apply_penalties(got, [0, 2, 3, 4], reqs)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])  # a row without penalties is left alone
    # Incremental: new outputs are counted at the next step, the prompt is not copied again.
    prompt_ids = reqs[2].penalty_state.prompt_ids
    assert prompt_ids.tolist() == [4, 6] and reqs[1].penalty_state.prompt_ids is None  # only with repetition
    reqs[2].append_token(11)
    want[3] = _reference_penalties(logits[3], rows[2][0], rows[2][1] + [11], rows[2][2])
    got = logits.clone()
    apply_penalties(got, [0, 2, 3, 4], reqs)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert reqs[2].penalty_state.prompt_ids is prompt_ids and reqs[2].penalty_state.output_counts[11] == 2


def test_min_tokens_masks_finish_ids_until_reached():
    vocab = 100
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=2, stop_token_ids=[7, 500])  # 500: not in vocab
    short, done = _req([1], params, [3]), _req([1], params, [3, 4])
    ignoring = _req([1], SamplingParams(max_tokens=8, temperature=0, min_tokens=2, ignore_eos=True), [3])
    logits = torch.zeros(3, vocab)
    logits[:, 2], logits[:, 7], logits[:, 9] = 10.0, 9.0, 8.0
    out = sample(logits, [short, done, ignoring], torch.Generator())
    assert out.token_ids == [9, 2, 2]  # eos 2 and stop id 7 held back from the short row only
    assert logits[0, 2] == logits[0, 7] == -math.inf and logits[1, 2] == logits[2, 2] == 10.0
    assert logits[2, 7] == 9.0  # ignore_eos and no stop ids: nothing to hold back


def test_min_tokens_holds_back_stop_strings_too():
    """An engine's greedy text with a stop string that appears within its first tokens: it ends
    there, but not with min_tokens past it (vLLM looks for stop strings only after min_tokens)."""
    engine = Engine("tiny", device="cpu", num_blocks=64)
    whole = engine.generate(["Once upon a time"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = whole.text[2:4]
    early = whole.text.index(stop)
    params = dict(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    cut = engine.generate(["Once upon a time"], SamplingParams(**params))[0]
    assert cut.text == whole.text[:early] and len(cut.token_ids) < 10
    held = engine.generate(["Once upon a time"], SamplingParams(**params, min_tokens=10))[0]
    assert len(held.token_ids) >= 10 and held.token_ids[:10] == whole.token_ids[:10]
    assert whole.text.startswith(held.text) and len(held.text) > early


def test_plain_batches_take_the_fast_path_and_rows_get_their_own_logprobs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=g)
    plain = [_req([1], SamplingParams(temperature=0)) for _ in range(3)]
    before = logits.clone()
    out = sample(logits, plain, torch.Generator())
    assert out.token_ids == before.argmax(-1).tolist() and out.logprobs is None
    assert torch.equal(logits, before) and all(r.penalty_state is None for r in plain)
    reqs = [_req([1], SamplingParams(temperature=0, logprobs=n)) for n in (5, None, 0)]
    out = sample(logits, reqs, torch.Generator())
    ref = torch.log_softmax(before, dim=-1)
    assert out.logprobs[1] is None and out.logprobs[2].top_token_ids == []
    top = ref[0].topk(5)
    assert out.logprobs[0].top_token_ids == top.indices.tolist()
    assert out.logprobs[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[2].logprob == pytest.approx(ref[2].max().item(), abs=1e-6)


def test_token_masks_bias_allow_and_ban_bad_words():
    """logit_bias adds, allowed_token_ids keeps only its ids, a bad word's last token is masked
    only where the output ends with the word's other tokens."""
    from pagefleet.worker.token_masks import banned_token_ids

    vocab = 12
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 5.0
    reqs = [
        _req([1], SamplingParams(temperature=0, logit_bias={3: 10.0, 7: -1.0})),
        _req([1], SamplingParams(temperature=0, allowed_token_ids=[4, 5])),
        _req([1], SamplingParams(temperature=0, bad_words_token_ids=[[7], [4, 9]]), output=[4]),
    ]
    gen = torch.Generator().manual_seed(0)
    out = sample(logits.clone(), reqs, gen)
    assert out.token_ids[0] == 3
    assert out.token_ids[1] in (4, 5)
    x = logits.clone()
    x[2, 9] = 6.0
    assert sample(x, reqs, gen).token_ids[2] not in (7, 9)
    assert banned_token_ids([1, 4], [[4, 9], [2, 9], [8]]) == [9, 8]
    assert banned_token_ids([], [[4, 9]]) == []


def test_a_row_without_top_p_keeps_its_whole_vocabulary_beside_one_that_filters():
    """In float32 the running mass of a sorted row reaches 1.0 before its tail's end: a row with
    top_p 1 batched with a row that filters lost its rarest tokens, so a seeded request's draw
    depended on what ran beside it."""
    from pagefleet.worker.sampler import _filter_top_k_top_p

    torch.manual_seed(0)
    logits = torch.randn(2, 259) * 12  # peaked: a long tail of tiny probabilities
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    assert (probs.cumsum(-1) - probs >= 1.0).any(), "the case needs a mass that reaches 1 early"
    out = _filter_top_k_top_p(logits.clone(), [0, 5], [1.0, 1.0])
    assert torch.equal(out[0], logits[0])  # nothing dropped from the row that asks for nothing
    assert (out[1] > float("-inf")).sum() == 5
    out = _filter_top_k_top_p(logits.clone(), [0, 0], [1.0, 0.5])
    assert torch.equal(out[0], logits[0]) and (out[1] == float("-inf")).any()
