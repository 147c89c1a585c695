"""Every architecture against `transformers`: greedy tokens equal in each setting that
changes the step plan, seeded sampling the same with the prefix cache on and off."""

from __future__ import annotations

import random

import pytest
import torch
from arch_checkpoints import CASES, WINDOW, hf_greedy, make_arch_checkpoint

from pagefleet import Engine, SamplingParams
from pagefleet.common.model_config import load_model_spec

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
# Phi-3's longrope switches to its long factors past 32 positions; transformers switches a
# whole prompt at once, pagefleet per position, so prompts stay short of it (decoding crosses).
MAX_PROMPT = {"phi3": 28}


def prompts_for(case: str, n: int = 4) -> list[list[int]]:
    rng = random.Random(case)
    longest = MAX_PROMPT.get(case, 40)
    lens = [longest] + [rng.randrange(longest // 2, longest) for _ in range(n - 1)]
    return [[rng.randrange(3, 199) for _ in range(k)] for k in lens]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(case: str):
        if case not in made:
            path = make_arch_checkpoint(tmp_path_factory.mktemp(case), case)
            prompts = prompts_for(case)
            made[case] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_then_prefix_cache_hits(checkpoints, case):
    path, prompts, ref = checkpoints(case)
    assert max(len(p) for p in prompts) > WINDOW
    engine = Engine(str(path), block_size=4, num_blocks=128, max_num_batched_tokens=7, max_model_len=64)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    hits = engine.kv.prefix_cache_hits_total
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert engine.kv.prefix_cache_hits_total > hits, "the second pass was meant to hit the prefix cache"


@pytest.mark.parametrize("case", list(CASES))
def test_preemption_under_a_small_pool(checkpoints, case):
    path, prompts, ref = checkpoints(case)
    # Room for the longest request and a little more: the others take turns.
    num_blocks = -(-(len(prompts[0]) + MAX_TOKENS) // 4) + 3
    engine = Engine(str(path), block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, max_model_len=64)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert engine.stats().num_preemptions_total > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_sampling_is_the_same_with_the_cache_on_and_off(checkpoints, case):
    path, prompts, _ = checkpoints(case)
    on = Engine(str(path), block_size=4, num_blocks=64, max_model_len=64)
    on.generate(prompts[:1], GREEDY)  # the prompt's blocks now cached
    cached = on.generate(prompts[:1], SEEDED)[0].token_ids
    assert on.kv.prefix_cache_hits_total > 0
    off = Engine(str(path), block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=False,
                 max_num_batched_tokens=5)
    assert off.generate(prompts[:1], SEEDED)[0].token_ids == cached


def test_max_model_len_is_the_context_not_the_window(checkpoints):
    path, prompts, _ = checkpoints("mistral-window")
    spec = load_model_spec(str(path))
    assert spec.config.sliding_window == WINDOW
    assert spec.max_model_len() == spec.config.max_position_embeddings > WINDOW


TIE = 0.15  # as the GPU suite's Llama test: a differing token must be a near-tie in fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_in_bf16_on_a_gpu_within_ties(checkpoints, case):
    """The Triton kernels (window, soft-cap and sinks switches, fused MoE) in bf16: tokens agree
    with `transformers` in bf16 up to the first position where fp32 logits are a near-tie."""
    import transformers

    path, prompts, _ = checkpoints(case)
    load = transformers.AutoModelForCausalLM.from_pretrained
    ref_bf16 = load(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    ref_fp32 = load(path, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    engine = Engine(str(path), device="cuda", dtype="bfloat16", block_size=16, num_blocks=64, max_model_len=64,
                    max_num_batched_tokens=16)
    ours = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            theirs = ref_bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        i = next((j for j, (a, b) in enumerate(zip(o.token_ids, theirs, strict=True)) if a != b), None)
        if i is None:
            continue
        with torch.no_grad():
            logits = ref_fp32(torch.tensor([p + theirs[:i]], device="cuda")).logits[0, -1].float()
        top = float(logits.max())
        gaps = (top - float(logits[o.token_ids[i]]), top - float(logits[theirs[i]]))
        assert max(gaps) <= TIE, f"{case}: token {i} differs and is no tie (gaps {gaps})"
