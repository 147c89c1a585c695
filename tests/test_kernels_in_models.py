"""The Triton kernels inside a model: gpt-oss (sliding window and sinks in the attention
kernel, the fused-MoE kernel) and Gemma 2 (window and soft-cap, Gemma's norm offset, the fused
norms and RoPE) through the engine with every
kernel call sent to Triton (its interpreter without a GPU), greedy tokens equal to
`transformers`'."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from arch_checkpoints import hf_greedy, make_arch_checkpoint  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import pagefleet.kernels as kernels  # noqa: E402
from pagefleet import Engine, SamplingParams  # noqa: E402
from pagefleet.kernels import fused_triton, moe_triton, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_calls(monkeypatch) -> dict[str, int]:
    """Every kernel call sent to Triton; how many calls each launcher took."""
    calls = {"paged_attention_triton": 0, "fused_moe_triton": 0}
    for module, name in ((triton_ops, "paged_attention_triton"), (moe_triton, "fused_moe_triton")):
        if DEVICE == "cpu" and not isinstance(getattr(module, "_grouped_gemm_kernel", None)
                                              or module._paged_attention_kernel, InterpretedFunction):
            importlib.reload(module)  # decorated before the interpreter was switched on
        launch = getattr(module, name)

        def counted(*args, _launch=launch, _name=name, **kwargs):
            calls[_name] += 1
            return _launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    if DEVICE == "cpu" and not isinstance(fused_triton._rms_norm_kernel, InterpretedFunction):
        importlib.reload(fused_triton)  # the norms, SiLU-and-mul and RoPE go to Triton too
    monkeypatch.setattr(kernels, "_use_triton", lambda t: True)
    return calls


@pytest.mark.parametrize("case", ["gpt_oss", "gemma2"])
def test_engine_on_the_triton_kernels_matches_transformers(tmp_path, triton_calls, case):
    path = make_arch_checkpoint(tmp_path, case)
    prompts = [[5, 9, 17, 33, 4, 71, 8, 19, 101, 3, 44, 12, 6, 7], [150, 7, 7, 90]]  # longer than the window
    want = hf_greedy(path, prompts, 5)
    engine = Engine(str(path), device=DEVICE, dtype="float32", block_size=4, num_blocks=64, max_model_len=64,
                    max_num_batched_tokens=6)
    got = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert triton_calls["paged_attention_triton"] > 0
    assert (triton_calls["fused_moe_triton"] > 0) == (case == "gpt_oss")
