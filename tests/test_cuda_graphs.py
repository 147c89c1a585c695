"""Decode steps from CUDA graphs (``worker/cuda_graphs.py``).

On the CPU: the ladder of captured sizes, and the graphs' padded static buffers run eagerly
(``capture=False``) giving exactly the tokens of the plain eager path, with inputs staged or
not, at batch sizes on the ladder, between its rungs and past its top. On a GPU (marked
``gpu``): graphs captured at start-up, on and off giving the same tokens, ``enforce_eager``,
and greedy parity with ``transformers`` in bf16 within a tie tolerance.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import make_checkpoint

from pagefleet import Engine, SamplingParams
from pagefleet.worker.cuda_graphs import DecodeGraphs, capture_sizes

_HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(("max_num_seqs", "want"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
    (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_capture_sizes_are_1_2_4_8_then_steps_of_8_up_to_max_num_seqs(max_num_seqs, want):
    assert capture_sizes(max_num_seqs) == want


def test_capture_sizes_of_256_and_padding():
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 3 + 32
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.sizes = sizes
    assert [g.size_for(n) for n in (1, 3, 5, 8, 9, 17, 255, 256, 257)] == [1, 4, 8, 8, 16, 24, 256, 256, None]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def _mixed_requests(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts of different lengths, greedy and seeded alternately, ending at different
    steps so a run's decode batches shrink through every size below ``n``."""
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True,
                             **(dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i)))
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("stage_inputs", [False, True])
@pytest.mark.parametrize(("num_requests", "graph_max"), [(7, 8), (6, 4)])
def test_padded_graph_buffers_give_the_eager_tokens(stage_inputs, num_requests, graph_max):
    """7 requests against sizes 1/2/4/8 pad 7->8, 6->8, 5->8, 3->4; 6 against 1/2/4 run 6 and 5
    eagerly and pad 3->4: the same tokens as the plain path, every pool free after. A second
    batch reuses the first one's freed blocks: a padding row that still carried a finished
    sequence's slot would write into them."""
    prompts, params = _mixed_requests(num_requests)
    later = [[(13 * i + j) % 240 + 5 for j in range(9 + i)] for i in range(3)]
    later_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = Engine("tiny", num_blocks=128, enable_prefix_caching=False)
    want = [o.token_ids for o in plain.generate(prompts, params) + plain.generate(later, later_params)]
    engine = Engine("tiny", num_blocks=128, enable_prefix_caching=False)
    runner = engine.executor.runner
    runner.stage_inputs = stage_inputs
    graphs = runner.capture_graphs(graph_max, capture=False)
    assert not graphs.graphs  # capture=False: the buffers only
    got = [o.token_ids for o in engine.generate(prompts, params) + engine.generate(later, later_params)]
    assert got == want
    assert graphs.num_replays > 0


def test_a_graph_step_is_taken_only_for_decode_steps_that_fit():
    engine = Engine("tiny", num_blocks=128, max_num_batched_tokens=64)
    runner = engine.executor.runner
    graphs = runner.capture_graphs(2, capture=False)
    engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    kinds = []
    while engine.has_unfinished_requests():
        before = graphs.num_replays
        engine.step()
        kinds.append(graphs.num_replays - before)
    # the 57-token prompt takes a chunked prefill (eager), then the decode steps replay
    assert kinds[0] == 0 and sum(kinds) == 3, kinds


def test_enforce_eager_flag_reaches_the_engine_and_is_validated():
    from pagefleet.launcher import build_parser as up_parser
    from pagefleet.worker.service import build_parser as worker_parser

    assert worker_parser().parse_args(["--enforce-eager"]).enforce_eager is True
    assert worker_parser().parse_args([]).enforce_eager is False
    assert up_parser().parse_args(["--enforce-eager"]).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        Engine("tiny", num_blocks=16, enforce_eager="yes")
    # On a CPU nothing is captured either way
    assert Engine("tiny", num_blocks=16).executor.graph_sizes == ([1, 2, 4, 8] + list(range(16, 257, 8))
                                                                 if _HAS_CUDA else [])


# -- on a GPU ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama-gpu"), "llama", hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_on_and_off_give_the_same_tokens_on_a_gpu(gpu_llama, dtype):
    prompts, params = _mixed_requests(11)
    eager = Engine(str(gpu_llama), device="cuda", dtype=dtype, num_blocks=256, max_num_seqs=16, enforce_eager=True)
    assert eager.executor.graph_sizes == []
    want = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = Engine(str(gpu_llama), device="cuda", dtype=dtype, num_blocks=256, max_num_seqs=16)
    assert graphed.executor.graph_sizes == [1, 2, 4, 8, 16]
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert graphed.executor.runner.graphs.num_replays > 0
    assert got == want


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
def test_greedy_matches_transformers_in_bf16_on_a_gpu_within_ties(gpu_llama):
    """bf16 rounds differently in two implementations: the tokens must agree up to the first
    position where the fp32 logits of the two candidates are within ``TIE`` of each other."""
    import transformers

    tie = 0.15
    prompts = [[(11 * i + j) % 500 + 3 for j in range(8 + 5 * i)] for i in range(6)]
    n = 24
    ref_bf16 = transformers.AutoModelForCausalLM.from_pretrained(gpu_llama, dtype=torch.bfloat16).cuda().eval()
    ref_fp32 = transformers.AutoModelForCausalLM.from_pretrained(gpu_llama, dtype=torch.float32).cuda().eval()
    engine = Engine(str(gpu_llama), device="cuda", dtype="bfloat16", num_blocks=256, max_num_seqs=8)
    ours = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            theirs = ref_bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        i = _first_divergence(o.token_ids, theirs)
        if i is None:
            continue
        context = torch.tensor([p + theirs[:i]], device="cuda")
        with torch.no_grad():
            logits = ref_fp32(context).logits[0, -1].float()
        top = float(logits.max())
        gaps = (top - float(logits[o.token_ids[i]]), top - float(logits[theirs[i]]))
        assert max(gaps) <= tie, f"prompt {p[:4]}...: token {i} differs and is no tie (gaps {gaps})"


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
def test_worker_flag_turns_graphs_off_on_a_gpu():
    from pagefleet.worker.service import build_parser, make_engine

    args: argparse.Namespace = build_parser().parse_args(["--device", "cuda", "--num-blocks", "64",
                                                          "--max-num-seqs", "8", "--enforce-eager"])
    assert make_engine(args).executor.graph_sizes == []
    args.enforce_eager = False
    assert make_engine(args).executor.graph_sizes == [1, 2, 4, 8]


def test_dummy_load_format_needs_only_a_config(tmp_path):
    """``load_format="dummy"``: a shape with fixed-seed random weights (the GPU benchmarks'
    Llama-3 shapes); the same tokens every time; no weights: a clear error otherwise."""
    import json

    from pagefleet.benchmarks.decode import SHAPES, write_shape
    from pagefleet.common.model_config import load_model_spec, tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf()))
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = [Engine(str(tmp_path), load_format="dummy", num_blocks=32).generate([[5, 6, 7]], greedy)[0].token_ids
            for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 5
    with pytest.raises(ValueError, match="safetensors"):
        Engine(str(tmp_path), num_blocks=32)
    with pytest.raises(ValueError, match="load_format"):
        Engine(str(tmp_path), num_blocks=32, load_format="random")
    for name in SHAPES:
        cfg = load_model_spec(str(write_shape(name, tmp_path / name))).config
        assert cfg.num_key_value_heads == 8 and cfg.vocab_size == 128256


def test_bench_decode_runs_its_loop_on_the_cpu(tmp_path):
    import json

    from pagefleet.benchmarks.decode import main

    assert main(["--json", str(tmp_path / "d.json")]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [(r["batch"], r["cuda_graphs"]) for r in rows] == [(1, False), (4, False)]
    assert all(r["step_ms_p50"] > 0 and r["kv_bytes"] > 0 for r in rows)
