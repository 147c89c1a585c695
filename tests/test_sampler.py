"""The sampler: seeded draws are a pure function of (seed, position), so a seeded request
continues the same way after a resume on another engine."""

from __future__ import annotations

import torch

from pagefleet import Engine, SamplingParams
from pagefleet.worker.sampler import seeded_exponentials


def test_seeded_draws_depend_on_seed_and_position_only():
    a = seeded_exponentials([7, 7, 8], [10, 11, 10], 500, "cpu")
    b = seeded_exponentials([8, 7], [10, 10], 500, "cpu")  # other rows beside them, other order
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    big = seeded_exponentials([2**64 - 1, -3], [0, 2**40], 4, "cpu")
    assert torch.isfinite(big).all() and (big > 0).all()


def test_seeded_draws_are_exponential():
    q = seeded_exponentials(list(range(64)), [5] * 64, 4096, "cpu").flatten()
    assert abs(q.mean().item() - 1.0) < 0.02  # Exp(1): mean 1, variance 1
    assert abs(q.var().item() - 1.0) < 0.05
    u = torch.exp(-q)  # back to uniform: every decile holds about a tenth
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts / q.numel() - 0.1).abs().max() < 0.01


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
